"""What every route of the server shares: the engine, the metrics, the settings (keys, admin auth, request
limits), and the bits of state the routes keep between requests, in one `ServerState` that `create_app` builds
and stores on `app.state.server`. Routes receive it through the `StateDep` dependency.

Also here: `ApiError` (an error a route answers in OpenAI's error shape) and `RequestLimits`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request

from hotswap.engine.client import ChangeRecord, EngineClient
from hotswap.entrypoints.metrics import Metrics
from hotswap.errors import EngineUnavailable
from hotswap.lora.request import LoRARequest
from hotswap.sampling_params import SamplingParams
from hotswap.worker.session import WeightUpdateFailed


class ApiError(Exception):
    """An error answered as `status` with OpenAI's error body (`kind` its type), and `headers` (e.g. Retry-After)."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what one request may ask for, so that it cannot slow or stall the others: the request body
    (prompts are tokenized from it), and the stop strings searched after every token; and how long a request
    waits for its next output while generation is paused (then 503 with Retry-After); the samples (`n`) and
    tokens (`max_tokens`, None: up to the context length) one request may ask for. Log probabilities are bounded
    by the engine's `max_logprobs`, prompt tokens by its `max_model_len`."""

    max_request_bytes: int = 4 << 20
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_pause_wait_s: float = 600.0
    max_n: int = 64
    max_tokens: int | None = None


@dataclass(frozen=True)
class ChatSettings:
    """How chat outputs are read: the tool-call parser (`--tool-call-parser`: hermes, llama3_json, mistral; None:
    tool_choice "auto" is refused, "required" and named choices use hermes' format) and the reasoning parser
    (`--reasoning-parser`: deepseek_r1, qwen3; None: no reasoning_content)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        from hotswap.entrypoints.chat_output import check_reasoning_parser
        from hotswap.entrypoints.tools import tool_parser

        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)
        check_reasoning_parser(self.reasoning_parser)


@dataclass
class ServerState:
    """The server's engine (one `AsyncLLMEngine`, or an `AsyncFleet` of replicas), its settings and its
    request-spanning state. `vocab_size` is read from the model's config when the app is built."""

    engine: EngineClient
    served_model_name: str
    metrics: Metrics
    limits: RequestLimits
    api_key: str | None
    admin_key: str | None
    admin_auth: str  # "key" or "none"
    allowed_hosts: frozenset[str] | None  # Host header names admin routes answer to (None: any)
    vocab_size: int
    # the token of the session SGLang's /begin_weight_update opened (its version and start are the engine's
    # record, `status().change`); a session opened by another route is not SGLang's to feed or end
    sglang_token: str | None = None
    chat: ChatSettings = field(default_factory=ChatSettings)
    # why the server does not serve yet (--join: catching up with a live server); None once it does
    not_ready: str | None = None

    def version_changed(self) -> None:
        """Brings the weight-version metrics to the engine's served version (after a committed change)."""
        now = self.engine.status()
        self.metrics.set("hotswap_weight_version", now.weight_version)
        self.metrics.set_only("hotswap_weight_version_info", 1, weight_version=now.weight_version_label)

    def versions(self) -> dict[str, object]:
        """The served version's label, and with a speculative draft model the label of the version it was last
        updated for (strings, as vLLM's and SGLang's clients compare them)."""
        now = self.engine.status()
        out: dict[str, object] = {"weight_version": now.weight_version_label}
        if self.engine.config.draft_model_config is not None:
            out["draft_weight_version"] = now.draft_weight_version_label
            out["draft_stale"] = now.draft_stale
        return out

    def sglang_session(self) -> ChangeRecord | None:
        """The open change while it is the session SGLang's /begin_weight_update opened (one that ended another
        way, by abort, destroy or a vLLM-route finish, is forgotten)."""
        change = self.engine.status().change
        if self.sglang_token is None or change is None or change.token != self.sglang_token:
            self.sglang_token = None
            return None
        return change

    def check_limits(self, stop: str | list[str] | None, params: SamplingParams) -> None:
        """Raises ValueError naming the limit a request exceeds: `n`, `max_tokens`, and the stop strings (searched
        after every token, so their number and length are bounded)."""
        limits = self.limits
        if params.n > limits.max_n:
            raise ValueError(f"n={params.n}; the limit is {limits.max_n} (--max-n)")
        if limits.max_tokens is not None and (params.max_tokens is None or params.max_tokens > limits.max_tokens):
            raise ValueError(f"max_tokens={params.max_tokens}; the limit is {limits.max_tokens} (--max-tokens)")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > limits.max_stop_strings:
            raise ValueError(f"{len(stops)} stop strings; the limit is {limits.max_stop_strings} (--max-stop-strings)")
        longest = max((len(s) for s in stops), default=0)
        if longest > limits.max_stop_string_chars:
            raise ValueError(f"a stop string of {longest} characters; the limit is {limits.max_stop_string_chars}")

    def check_lora_enabled(self) -> None:
        """Raises ValueError unless the engine serves LoRA adapters (the server was started with --enable-lora)."""
        if not self.engine.config.lora_config.enable_lora:
            raise ValueError(
                "LoRA is not enabled: start the server with --enable-lora (and --max-lora-rank, "
                "--max-loras as the adapters need)"
            )

    async def loras(self) -> dict[str, dict[str, Any]]:
        """The loaded adapters by name (`EngineClient.list_loras`' entries); {} without LoRA."""
        if not self.engine.config.lora_config.enable_lora:
            return {}
        return {d["lora_name"]: d for d in await self.engine.list_loras()}

    async def model_lora(self, name: str) -> LoRARequest | None:
        """What an OpenAI request's `model` names: None for the served model, the adapter's LoRARequest for a
        loaded LoRA adapter (vLLM's convention: an adapter is a model). Raises a 404 ApiError (vLLM's message)
        for any other name."""
        if name == self.served_model_name:
            return None
        adapter = (await self.loras()).get(name)
        if adapter is None:
            raise ApiError(404, f"The model `{name}` does not exist.", "NotFoundError")
        return LoRARequest(name, int(adapter["lora_int_id"]))


def api_error(err: BaseException) -> ApiError | None:
    """The client error an engine error is answered as (the app's exception handlers answer these): bad values
    400, wrong state 409, timeouts 504, a failed weight change 409, an engine that cannot serve 503 (with
    Retry-After). None for any other error (a 500)."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ValueError):
        return ApiError(400, str(err))
    if isinstance(err, TimeoutError):
        return ApiError(504, str(err), "timeout_error")
    if isinstance(err, WeightUpdateFailed):
        return ApiError(409, str(err), "weight_update_failed")
    if isinstance(err, EngineUnavailable):
        return ApiError(503, str(err), "service_unavailable", {"Retry-After": "5"})
    if isinstance(err, RuntimeError):
        return ApiError(409, str(err), "conflict")
    return None


ENGINE_ERRORS: tuple[type[Exception], ...] = (
    ValueError,
    TimeoutError,
    WeightUpdateFailed,
    EngineUnavailable,
    RuntimeError,
)
"""The errors `api_error` maps: each has an exception handler in the app."""


def get_state(request: Request) -> ServerState:
    """The `ServerState` of the app serving `request` (a FastAPI dependency)."""
    state: ServerState = request.app.state.server
    return state


StateDep = Annotated[ServerState, Depends(get_state)]
