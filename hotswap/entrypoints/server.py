"""OpenAI-compatible HTTP server with an authenticated admin API for RL weight updates.

OpenAI routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`, streaming over SSE) need
`Authorization: Bearer <api key>` when one is set. Admin routes (weights, generation control, inspection,
allow-listed `collective_rpc`) need `Authorization: Bearer <admin key>`, and are never open by accident:
- without an admin key they answer 403, unless `admin_auth="none"` opens them on purpose (loopback hosts
  only; it logs a warning), for a trusted network whose RL framework sends no key;
- empty keys are refused at start;
- an admin request whose Host header is not an allowed host (DNS rebinding), or that carries an Origin header
  (a web page's cross-site request), is refused with 403.
Client mistakes get 4xx in OpenAI's error shape. `/health` answers 503 with the reason when the engine cannot
serve (a dead worker, invalid weights).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, cast

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.entrypoints import openai_protocol as oai
from hotswap.entrypoints.metrics import Metrics
from hotswap.entrypoints.sglang_routes import add_sglang_routes
from hotswap.errors import EngineUnavailable
from hotswap.fleet.async_fleet import AsyncFleet
from hotswap.sampling_params import SamplingParams
from hotswap.weights.session import WeightUpdateFailed
from hotswap.weights.version import parse_version

if TYPE_CHECKING:
    from hotswap.outputs import RequestOutput

# Worker methods `/collective_rpc` may call: read-only inspection.
RPC_ALLOWLIST = frozenset({"weight_checksums", "determine_num_kv_blocks", "shard_plan"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


class BodyTooLarge(BaseException):
    """Raised from `receive` past the body limit. A BaseException, so that the framework's body parsing (which
    turns an Exception into a 400) lets it reach the middleware that answers 413."""


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


_IGNORED_LOGGED: set[tuple[str, str]] = set()


# A weight version a client gives: a label or an integer (bools and floats are a 400 naming the field).
VersionField = StrictInt | StrictStr | None


class _Body(BaseModel):
    """Admin bodies are lenient, as vLLM's and RL frameworks' clients need (TRL sends `is_checkpoint_format`,
    AReaL a `pp_rank`): unknown fields are ignored, and logged once per route model and field."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in sorted(set(data) - set(cls.model_fields))[:8]:
                if (cls.__name__, key) not in _IGNORED_LOGGED and len(_IGNORED_LOGGED) < 256:
                    _IGNORED_LOGGED.add((cls.__name__, key))
                    logger.info("ignoring field %r of a %s request (not used by hotswap)", key[:64], cls.__name__)
        return data


# engine stats -> Prometheus names, with speculative decoding on
SPEC_METRICS = {
    "spec_draft_tokens": "hotswap_spec_draft_tokens",
    "spec_accepted_tokens": "hotswap_spec_accepted_tokens",
    "spec_steps": "hotswap_spec_steps",
    "spec_acceptance_rate": "hotswap_spec_acceptance_rate",
    "spec_mean_accepted_length": "hotswap_spec_mean_accepted_length",
    "draft_weight_version": "hotswap_draft_weight_version",
    "draft_stale": "hotswap_draft_stale",
}
SPEC_METRIC_HELP = {
    "hotswap_spec_draft_tokens": ("counter", "Speculative tokens proposed"),
    "hotswap_spec_accepted_tokens": ("counter", "Speculative tokens the target accepted"),
    "hotswap_spec_steps": ("counter", "Speculative verification steps (one per sequence and step)"),
    "hotswap_spec_acceptance_rate": ("gauge", "Accepted / proposed speculative tokens since start"),
    "hotswap_spec_mean_accepted_length": ("gauge", "Tokens emitted per verification step since start"),
    "hotswap_draft_weight_version": ("gauge", "The target weight version the draft model was last updated for"),
    "hotswap_draft_stale": ("gauge", "1 while the target was updated after the draft model"),
}

# a fleet's stats -> Prometheus names (and per replica, labelled replica="i": up, weight version, requests routed)
FLEET_METRICS = {
    "fleet_replicas": "hotswap_fleet_replicas",
    "fleet_replicas_up": "hotswap_fleet_replicas_up",
    "fleet_updates_committed": "hotswap_fleet_updates_committed",
    "fleet_updates_failed": "hotswap_fleet_updates_failed",
    "fleet_replica_failures": "hotswap_fleet_replica_failures",
    "fleet_replica_restarts": "hotswap_fleet_replica_restarts",
}
FLEET_METRIC_HELP = {
    "hotswap_fleet_replicas": ("gauge", "Replicas in the fleet"),
    "hotswap_fleet_replicas_up": ("gauge", "Replicas taking requests (up, at the fleet's weight version)"),
    "hotswap_fleet_updates_committed": ("counter", "Fleet-wide weight changes committed on every replica"),
    "hotswap_fleet_updates_failed": ("counter", "Fleet-wide weight changes rolled back on every replica"),
    "hotswap_fleet_replica_failures": ("counter", "Replicas found dead or unresponsive"),
    "hotswap_fleet_replica_restarts": ("counter", "Replicas restarted and brought to the fleet's version"),
    "hotswap_fleet_replica_up": ("gauge", "1 while the replica takes requests"),
    "hotswap_fleet_replica_weight_version": ("gauge", "The weight version the replica holds"),
    "hotswap_fleet_replica_requests_routed": ("counter", "Requests routed to the replica"),
}


class ReloadBody(_Body):
    weights_path: str | None = None
    target: str = Field(default="model", pattern="^(model|draft)$")
    weight_version: VersionField = None


class InitBody(_Body):
    init_info: dict[str, Any]


class StartBody(_Body):
    target: str = Field(default="model", pattern="^(model|draft|all)$")


class UpdateBody(_Body):
    update_info: dict[str, Any] | list[dict[str, Any]]  # vLLM: one per worker, or empty to repeat the last
    session_token: str | None = None


class FinishBody(_Body):
    weight_version: VersionField = None  # a label (vLLM and SGLang send strings) or an integer
    session_token: str | None = None


class RenameBody(_Body):
    """vLLM's and SGLang's /update_weight_version."""

    new_version: StrictInt | StrictStr
    abort_all_requests: bool = False  # SGLang defaults to true; here a rename never ends work unless asked


class AbortRequestsBody(_Body):
    request_ids: list[str] | None = None


class TokenizeBody(_Body):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(_Body):
    tokens: list[int]


class AbortBody(_Body):
    session_token: str | None = None


class PauseBody(_Body):
    mode: str = Field(default="abort", pattern="^(abort|wait|keep)$")
    clear_cache: bool = True


class SleepBody(_Body):
    level: int = Field(default=1, ge=1, le=2)


class WakeBody(_Body):
    tags: list[str] | None = None


class RpcBody(_Body):
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else None


def _host_name(host_header: str) -> str:
    """The host part of a Host header ("example.com:8000" -> "example.com", "[::1]:80" -> "::1")."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def check_keys(api_key: str | None, admin_key: str | None) -> None:
    """Raises ValueError for an empty (or blank) key: it would otherwise match a request without one."""
    for flag, key in (("--api-key", api_key), ("--admin-key", admin_key)):
        if key is not None and not key.strip():
            raise ValueError(f"{flag} is empty; give a real key, or leave the option out")


def create_app(
    engine: AsyncLLMEngine | AsyncFleet,
    served_model_name: str,
    api_key: str | None = None,
    admin_key: str | None = None,
    enable_admin: bool = True,
    admin_auth: str = "key",
    allowed_hosts: frozenset[str] | None = LOOPBACK_NAMES,
    limits: RequestLimits = RequestLimits(),
) -> FastAPI:
    """The FastAPI app serving `engine`. `admin_auth` "key" (admin routes need `admin_key`; without one they are
    off) or "none" (no key asked: a trusted network). Admin requests must name one of `allowed_hosts` in their
    Host header (None: any, for a server bound to a public address, where the key is what protects them).
    Raises ValueError for empty keys or an unknown `admin_auth`."""
    check_keys(api_key, admin_key)
    if admin_auth not in ("key", "none"):
        raise ValueError(f"admin_auth must be 'key' or 'none', got {admin_auth!r}")
    if enable_admin and admin_auth == "none":
        logger.warning("admin routes answer WITHOUT a key (admin_auth='none'): anyone who reaches this port can "
                       "change the served weights; use this on a trusted network only")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()  # on server shutdown (SIGTERM): requests still in flight end

    app = FastAPI(title="hotswap", version="0.1.0", lifespan=lifespan)
    metrics = Metrics()
    metrics.describe("hotswap_requests", "counter", "Requests by route and status")
    metrics.describe("hotswap_prompt_tokens", "counter", "Prompt tokens processed")
    metrics.describe("hotswap_generation_tokens", "counter", "Tokens generated")
    metrics.describe("hotswap_request_latency_seconds", "summary", "End-to-end latency of generation requests")
    metrics.describe("hotswap_weight_version", "gauge", "Weight version being served (the integer that orders them)")
    metrics.describe("hotswap_weight_version_info", "gauge", "1, labelled with the served version's label")
    for name, (kind, text) in SPEC_METRIC_HELP.items():
        metrics.describe(name, kind, text)
    if isinstance(engine, AsyncFleet):
        for name, (kind, text) in FLEET_METRIC_HELP.items():
            metrics.describe(name, kind, text)
    metrics.describe("hotswap_requests_running", "gauge", "Requests queued or being generated")
    metrics.describe("hotswap_weight_update_seconds", "summary", "Duration of weight updates (start to finish)")
    metrics.set("hotswap_weight_version", 0)
    metrics.set_only("hotswap_weight_version_info", 1, weight_version=engine.engine.weight_version_label)
    update_started: list[float] = []

    def check(expected: str | None, request: Request) -> None:
        given = (_bearer(request) or "").encode("utf-8", "surrogateescape")
        if expected is not None and not secrets.compare_digest(given, expected.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)", "authentication_error")

    def user_auth(request: Request) -> None:
        check(api_key, request)

    def require_admin(request: Request) -> None:
        host = _host_name(request.headers.get("host", "")).lower()
        if allowed_hosts is not None and host not in allowed_hosts:
            raise ApiError(403, f"admin routes do not answer for Host {host!r} (allowed: {sorted(allowed_hosts)})",
                           "permission_error")
        if "origin" in request.headers:
            raise ApiError(403, "admin routes refuse cross-origin (browser) requests", "permission_error")
        if admin_auth == "none":
            return
        if admin_key is None:
            raise ApiError(403, "admin routes are off: start the server with --admin-key (or --admin-auth none on "
                           "a trusted network)", "permission_error")
        check(admin_key, request)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(
            oai.error_body(err.message, err.kind, err.status), status_code=err.status, headers=err.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in err.errors()
        )
        return JSONResponse(
            oai.error_body(problems or "invalid request", "invalid_request_error", 400), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(oai.error_body(str(err.detail), "invalid_request_error", err.status_code), err.status_code)

    class Guard:
        """Pure ASGI middleware (unlike @app.middleware, it keeps disconnect detection working for streams):
        refuses request bodies over `limits.max_request_bytes` with 413 before they are read into memory or
        tokenized (by Content-Length when given, else as the bytes arrive), and counts responses by route."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await self.inner(scope, receive, send)
                return
            limit = limits.max_request_bytes
            declared = dict(scope.get("headers") or []).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                await too_large(send, limit)
                return
            seen = 0

            async def counting_receive() -> Any:
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > limit:
                        raise BodyTooLarge
                return message

            async def counting_send(message: Any) -> None:
                if message["type"] == "http.response.start":
                    # the matched route's template, never the raw path: a bounded set of label values
                    route = getattr(scope.get("route"), "path", None) or "unmatched"
                    metrics.inc("hotswap_requests", route=route, status=str(message["status"]))
                await send(message)

            try:
                await self.inner(scope, counting_receive, counting_send)
            except BodyTooLarge:
                await too_large(counting_send, limit)

    async def too_large(send: Any, limit: int) -> None:
        body = json.dumps(oai.error_body(f"request body over {limit} bytes (--max-request-bytes)",
                                         "invalid_request_error", 413)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    app.add_middleware(Guard)

    async def guarded(coro: Any) -> Any:
        """Maps engine errors to client errors: bad values 400, wrong state 409, timeouts 504."""
        try:
            return await coro
        except ValueError as err:
            raise ApiError(400, str(err)) from err
        except TimeoutError as err:
            raise ApiError(504, str(err), "timeout_error") from err
        except WeightUpdateFailed as err:
            raise ApiError(409, str(err), "weight_update_failed") from err
        except EngineUnavailable as err:
            raise ApiError(503, str(err), "service_unavailable", {"Retry-After": "5"}) from err
        except RuntimeError as err:
            raise ApiError(409, str(err), "conflict") from err

    def check_limits(stop: str | list[str] | None, params: SamplingParams) -> None:
        """Raises ValueError naming the limit a request exceeds: `n`, `max_tokens`, and the stop strings (searched
        after every token, so their number and length are bounded)."""
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

    def check_unicode(text: str, what: str) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"{what} is not valid Unicode ({err.reason} at character {err.start})") from None

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {served_model_name!r}", "not_found")

    # ---- OpenAI routes ------------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        problem = engine.engine.health_problem()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics() -> str:
        metrics.set("hotswap_requests_running", len(engine.engine.requests))
        stats = engine.engine.stats()
        for key, name in SPEC_METRICS.items():
            if key in stats:
                metrics.set(name, float(stats[key]))
        if isinstance(engine, AsyncFleet):
            for key, name in FLEET_METRICS.items():
                metrics.set(name, float(stats[key]))
            for replica in engine.fleet.replica_status():
                label = str(replica["index"])
                metrics.set("hotswap_fleet_replica_up", float(replica["routable"]), replica=label)
                metrics.set("hotswap_fleet_replica_weight_version", float(replica["version_id"]), replica=label)
                metrics.set("hotswap_fleet_replica_requests_routed", float(replica["routed"]), replica=label)
        return metrics.render()

    @app.get("/v1/models", dependencies=[Depends(user_auth)])
    async def models() -> dict[str, Any]:
        max_len = engine.engine.config.model_config.max_model_len
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "owned_by": "hotswap",
                                            "max_model_len": max_len}]}

    async def run(
        prompt: Any,
        params: Any,
        request_id: str,
        make_chunk: Any,
        make_full: Any,
        stream: bool,
        http: Request,
        final_chunk: Any = None,
    ) -> Any:
        start = time.perf_counter()
        if engine.engine.refusing_new_requests():
            raise ApiError(503, f"generation is paused (mode {engine.engine.pause_mode!r}); retry after /resume",
                           "service_unavailable", {"Retry-After": "1"})
        # an async generator function: its iterator has aclose()
        # an async generator function: its iterator has aclose(); a session id keeps a fleet's routing sticky
        key = http.headers.get("x-session-id")
        generator = cast("AsyncGenerator[RequestOutput, None]", engine.generate(prompt, params, request_id, key))

        async def next_output() -> Any:
            """The request's next output; a client that went away meanwhile (e.g. while generation is paused)
            aborts the request, and so does a pause longer than `limits.max_pause_wait_s` (503)."""
            pending = asyncio.ensure_future(generator.__anext__())
            paused_since: float | None = None
            try:
                while not (await asyncio.wait({pending}, timeout=0.5))[0]:
                    now = time.monotonic()
                    paused_since = (paused_since or now) if engine.engine.is_paused() else None
                    if await http.is_disconnected():
                        raise ApiError(499, "the client disconnected", "client_closed_request")
                    if paused_since is not None and now - paused_since > limits.max_pause_wait_s:
                        raise ApiError(503, f"generation has been paused for over {limits.max_pause_wait_s:.0f} s "
                                       "(--max-pause-wait-s)", "service_unavailable", {"Retry-After": "5"})
                return await guarded(pending)
            finally:
                if not pending.done():  # ended early (an error above, or this handler cancelled): stop the wait
                    pending.cancel()
                    with contextlib.suppress(BaseException):  # let it unwind before the generator is closed
                        await pending

        try:
            first = await next_output()
        except StopAsyncIteration as err:  # pragma: no cover - generate always yields at least once
            raise ApiError(500, "no output", "internal_error") from err

        def account(out: Any) -> None:
            if out.finished:
                metrics.inc("hotswap_prompt_tokens", len(out.prompt_token_ids))
                metrics.observe("hotswap_request_latency_seconds", time.perf_counter() - start)

        if not stream:
            out = first
            try:
                while not out.finished:
                    out = await next_output()
            finally:
                await generator.aclose()  # an unfinished request is aborted
            metrics.inc("hotswap_generation_tokens", sum(len(c.token_ids) for c in out.outputs))
            account(out)
            return make_full(out)

        async def sse() -> AsyncIterator[str]:
            out = first
            pending = None
            try:
                while True:
                    metrics.inc("hotswap_generation_tokens", sum(len(c.token_ids) for c in out.outputs))
                    yield f"data: {json.dumps(make_chunk(out))}\n\n"
                    account(out)
                    if out.finished:
                        if final_chunk is not None:  # stream_options.include_usage
                            yield f"data: {json.dumps(final_chunk())}\n\n"
                        break
                    pending = asyncio.ensure_future(generator.__anext__())
                    while not (await asyncio.wait({pending}, timeout=0.5))[0]:
                        # No output (e.g. generation paused): an SSE comment lets a closed connection show up,
                        # since a disconnect is only seen when sending.
                        if await http.is_disconnected():
                            return
                        yield ": keep-alive\n\n"
                    out, pending = pending.result(), None
                yield "data: [DONE]\n\n"
            finally:
                if pending is not None:
                    pending.cancel()
                await generator.aclose()  # a client that disconnected aborts its request

        return StreamingResponse(sse(), media_type="text/event-stream")

    vocab = int(engine.engine.config.model_config.hf_config.get("vocab_size", 0))

    def engine_prompt(prompt: str | list[int], salt: str | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        if salt is not None:
            entry["cache_salt"] = salt
        return entry

    def usage_chunk(request_id: str, created: int, kind: str, counts: dict[str, int]) -> dict[str, Any]:
        total = counts["prompt"] + counts["completion"]
        return {"id": request_id, "object": kind, "created": created, "model": served_model_name, "choices": [],
                "usage": {"prompt_tokens": counts["prompt"], "completion_tokens": counts["completion"],
                          "total_tokens": total}}

    @app.post("/v1/completions", dependencies=[Depends(user_auth)])
    async def completions(body: oai.CompletionRequest, http: Request) -> Any:
        check_model(body.model)
        prompts = body.prompts()
        echo_only = body.echo and body.max_tokens == 0
        try:
            if body.max_tokens == 0 and not body.echo:
                raise ValueError("max_tokens=0 needs echo=true (the prompt is all there is to return)")
            for p in prompts:
                if isinstance(p, str):
                    check_unicode(p, "the prompt")
            echo_logprobs = None
            if body.echo and body.logprobs is not None:  # the prompt's logprobs, in the same top-k shape
                echo_logprobs = max(body.logprobs, 0) if body.prompt_logprobs is None else body.prompt_logprobs
            params = oai.sampling_params(body, body.logprobs, 1 if echo_only else body.max_tokens, vocab,
                                         echo_logprobs)
            check_limits(body.stop, params)
            if body.stream and len(prompts) > 1:
                raise ValueError("stream=true takes one prompt per request; send a batch without streaming")
            if body.stream and params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs (and echo with logprobs) are not available with stream=true")
        except ValueError as err:
            raise ApiError(400, str(err)) from err
        shape = oai.Shape.of(body, echo=body.echo, drop_output=echo_only)
        request_id = oai.new_id("cmpl")
        created = int(time.time())
        tok = engine.tokenizer
        texts = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if body.echo else [""] * len(prompts)

        if not body.stream:
            try:
                async with asyncio.TaskGroup() as group:  # one failing prompt cancels the others
                    tasks = [group.create_task(run(engine_prompt(p, body.cache_salt), params, f"{request_id}-{i}",
                                                   None, lambda o: o, False, http))
                             for i, p in enumerate(prompts)]
            except BaseExceptionGroup as group_error:  # the first prompt's error, as one prompt would give it
                raise group_error.exceptions[0] from None
            outs = [task.result() for task in tasks]
            firsts = [engine.engine.detokenizer.token_text(o.prompt_token_ids[0]) if body.echo else "" for o in outs]
            return oai.completion_response(outs, served_model_name, request_id, shape, texts, firsts)

        counts = {"prompt": 0, "completion": 0}
        echoed = [False]

        def chunk(out: Any) -> dict[str, Any]:
            counts["prompt"] = len(out.prompt_token_ids)
            counts["completion"] += sum(len(c.token_ids) for c in out.outputs)
            prefix = texts[0] if not echoed[0] else ""
            echoed[0] = True
            choices = [oai.completion_choice(out, c, c.index, shape, prefix) for c in out.outputs]
            return {"id": request_id, "object": "text_completion", "created": created, "model": served_model_name,
                    "choices": choices}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return await run(
            engine_prompt(prompts[0], body.cache_salt), params, request_id, chunk, None, True, http,
            (lambda: usage_chunk(request_id, created, "text_completion", counts)) if include_usage else None,
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(user_auth)])
    async def chat_completions(body: oai.ChatCompletionRequest, http: Request) -> Any:
        check_model(body.model)
        top_n = body.top_logprobs or 0
        top_n = vocab if top_n == -1 else top_n
        try:
            params = oai.sampling_params(
                body, top_n if body.logprobs else None, body.max_completion_tokens or body.max_tokens, vocab
            )
            check_limits(body.stop, params)
            if body.stream and params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs are not available with stream=true")
            messages = body.template_messages()
            for message in messages:
                check_unicode(message["content"], "a message's content")
            ids = await asyncio.to_thread(  # CPU work off the event loop
                engine.tokenizer.apply_chat_template, messages, tools=body.tools, chat_template=body.chat_template,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message, tokenize=True, return_dict=False,
                **(body.chat_template_kwargs or {}),
            )
        except ValueError as err:
            raise ApiError(400, str(err)) from err
        except Exception as err:  # a template that cannot render these messages (jinja errors)
            raise ApiError(400, f"the chat template failed on these messages: {err}") from err
        shape = oai.Shape.of(body)
        request_id = oai.new_id("chatcmpl")
        created = int(time.time())
        sent_role: set[int] = set()
        counts = {"prompt": 0, "completion": 0}

        def chunk(out: Any) -> dict[str, Any]:
            counts["prompt"] = len(out.prompt_token_ids)
            counts["completion"] += sum(len(c.token_ids) for c in out.outputs)
            choices = []
            for c in out.outputs:
                delta: dict[str, Any] = {"content": c.text}
                if c.index not in sent_role:
                    delta["role"] = "assistant"
                    sent_role.add(c.index)
                choice = {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": oai.chat_logprobs(c, top_n, shape),
                    "finish_reason": c.finish_reason,
                    "weight_versions": oai.spans(c, shape),
                }
                if shape.token_ids:
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
            response = {
                "id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": served_model_name, "choices": choices,
            }
            if shape.token_ids and not counts.get("sent_prompt"):  # the first chunk carries the prompt's ids
                response["prompt_token_ids"] = list(out.prompt_token_ids)
                counts["sent_prompt"] = 1
            return response

        def full(out: Any) -> dict[str, Any]:
            response = oai.chat_response(out, served_model_name, request_id, top_n, shape)
            if out.prompt_logprobs is not None:
                response["prompt_logprobs"] = oai.prompt_logprobs_json(out)
            return response

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return await run(
            engine_prompt(list(ids), body.cache_salt), params, request_id, chunk, full, body.stream, http,
            (lambda: usage_chunk(request_id, created, "chat.completion.chunk", counts)) if include_usage else None,
        )

    if not enable_admin:
        if isinstance(engine, AsyncLLMEngine):
            add_sglang_routes(app, engine, None, user_auth, guarded, lambda: None, served_model_name, check_limits)
        return app

    # ---- admin routes ---------------------------------------------------------------------------------------

    admin = [Depends(require_admin)]

    def version_changed() -> None:
        metrics.set("hotswap_weight_version", engine.engine.weight_version)
        metrics.set_only("hotswap_weight_version_info", 1, weight_version=engine.engine.weight_version_label)

    def versions() -> dict[str, Any]:
        """The served version's label, and with a speculative draft model the label of the version it was last
        updated for (strings, as vLLM's and SGLang's clients compare them)."""
        out: dict[str, Any] = {"weight_version": engine.engine.weight_version_label}
        if engine.engine.config.draft_model_config is not None:
            out["draft_weight_version"] = engine.engine.version_labels.label(engine.engine.draft_weight_version)
            out["draft_stale"] = engine.engine.draft_stale
        return out

    if isinstance(engine, AsyncLLMEngine):  # SGLang's routes reach into one engine's scheduler and session
        add_sglang_routes(app, engine, admin, user_auth, guarded, version_changed, served_model_name, check_limits)
    else:

        @app.get("/fleet_status", dependencies=admin)
        async def fleet_status() -> dict[str, Any]:
            """The fleet's version and, per replica, its state, version, routing and last health report."""
            return {"weight_version": engine.fleet.get_weight_version_label(), "version_id": engine.fleet.version,
                    "replicas": engine.fleet.replica_status()}

    @app.post("/reload_weights", dependencies=admin)
    async def reload_weights(body: ReloadBody | None = None) -> dict[str, Any]:
        start = time.perf_counter()
        body = body or ReloadBody()
        await guarded(engine.reload_weights(weights_path=body.weights_path, target=body.target,
                                            weight_version=body.weight_version))
        metrics.observe("hotswap_weight_update_seconds", time.perf_counter() - start)
        version_changed()
        return versions()

    @app.post("/init_weight_transfer_engine", dependencies=admin)
    async def init_weight_transfer_engine(body: InitBody) -> dict[str, str]:
        await guarded(engine.init_weight_transfer_engine(body.init_info))
        return {"status": "ok"}

    @app.post("/start_weight_update", dependencies=admin)
    async def start_weight_update(body: StartBody | None = None) -> dict[str, str]:
        token = await guarded(engine.start_weight_update((body or StartBody()).target))
        update_started[:] = [time.perf_counter()]
        return {"status": "ok", "session_token": token}

    @app.post("/update_weights", dependencies=admin)
    async def update_weights(body: UpdateBody) -> dict[str, str]:
        await guarded(engine.update_weights(body.update_info, body.session_token))
        return {"status": "ok"}

    @app.post("/finish_weight_update", dependencies=admin)
    async def finish_weight_update(body: FinishBody | None = None) -> dict[str, Any]:
        body = body or FinishBody()
        try:
            parse_version(body.weight_version)  # before anything moves; the session stays open for a retry
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        await guarded(engine.finish_weight_update(body.weight_version, body.session_token))
        if update_started:
            metrics.observe("hotswap_weight_update_seconds", time.perf_counter() - update_started.pop())
        version_changed()
        return versions()

    @app.post("/abort_weight_update", dependencies=admin)
    async def abort_weight_update(body: AbortBody | None = None) -> dict[str, str]:
        await guarded(engine.abort_weight_update((body or AbortBody()).session_token))
        update_started.clear()
        return {"status": "ok"}

    @app.post("/shutdown_weight_transfer_engine", dependencies=admin)
    async def shutdown_weight_transfer_engine() -> dict[str, str]:
        await guarded(engine.shutdown_weight_transfer_engine())
        update_started.clear()
        return {"status": "ok"}

    @app.post("/pause", dependencies=admin)
    async def pause(
        body: PauseBody | None = None,
        mode: str | None = Query(None, pattern="^(abort|wait|keep)$"),
        clear_cache: bool | None = Query(None),
    ) -> dict[str, Any]:
        """Pauses generation; `mode` and `clear_cache` from the query string (vLLM's form) or the JSON body."""
        body = body or PauseBody()
        await guarded(
            engine.pause_generation(mode or body.mode, body.clear_cache if clear_cache is None else clear_cache)
        )
        return {"paused": True, "status": "paused"}

    @app.post("/resume", dependencies=admin)
    async def resume() -> dict[str, Any]:
        await guarded(engine.resume_generation())
        return {"paused": False, "status": "resumed"}

    @app.get("/is_paused", dependencies=admin)
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await engine.is_paused()}

    @app.post("/sleep", dependencies=admin)
    async def sleep(
        body: SleepBody | None = None,
        level: int | None = Query(None, ge=1, le=2),
        mode: str | None = Query(None, pattern="^(abort|wait)$"),
    ) -> dict[str, Any]:
        """Releases memory (`level` from the query or the body); with `mode`, generation is paused that way first
        (requests in flight otherwise refuse the sleep)."""
        level = level or (body or SleepBody()).level
        if mode is not None:
            await guarded(engine.pause_generation(mode))
        try:
            await guarded(engine.sleep(level))
        except ApiError:
            if mode is not None:
                await engine.resume_generation()  # the pause was only for the sleep
            raise
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up", dependencies=admin)
    async def wake_up(body: WakeBody | None = None, tags: Annotated[list[str] | None, Query()] = None
                      ) -> dict[str, Any]:
        """Re-allocates what sleep released: `tags` (repeatable query parameter, or the body; none: all)."""
        chosen = tags if tags is not None else (body or WakeBody()).tags
        await guarded(engine.wake_up(chosen))
        return {"status": "sleeping" if engine.engine.is_asleep() else "awake", "tags": chosen}

    @app.get("/is_sleeping", dependencies=admin)
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": engine.engine.is_asleep()}

    @app.post("/reset_prefix_cache", dependencies=admin)
    async def reset_prefix_cache() -> dict[str, Any]:
        """Drops the prefix cache (query parameters and a body, as vLLM clients send them, are accepted)."""
        await guarded(engine.reset_prefix_cache())
        return {"status": "ok", "success": True}

    @app.post("/abort_requests", dependencies=admin)
    async def abort_requests(body: AbortRequestsBody | None = None) -> dict[str, Any]:
        """Ends the named requests (none named: all of them) with finish_reason 'abort'."""
        wanted = (body or AbortRequestsBody()).request_ids
        current = list(engine.engine.requests)  # a snapshot: the step thread removes finished requests
        ids = current if not wanted else [r for r in wanted if r in current]
        for request_id in ids:
            await engine.abort(request_id)
        return {"status": "aborted", "aborted": len(ids)}

    @app.get("/weight_info", dependencies=admin)
    async def weight_info() -> dict[str, Any]:
        return {"weight_version": engine.engine.weight_version_label}

    @app.post("/update_weight_version", dependencies=admin)
    async def update_weight_version(body: RenameBody) -> dict[str, Any]:
        """Renames the served version (vLLM's and SGLang's route): weights, the integer version and requests stay
        as they are unless `abort_all_requests`, which ends every request with its partial output."""
        try:
            label = await engine.update_weight_version(body.new_version, body.abort_all_requests)
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        version_changed()
        return {"success": True, "message": "Weight version updated.", "new_version": label}

    @app.get("/server_info", dependencies=admin)
    async def server_info(config_format: str = Query("json", pattern="^(json|text)$")) -> dict[str, Any]:
        """The engine's configuration in vLLM's shape (`vllm_config`), which RL clients read for the dtype, the
        context length and whether a weight transport is configured."""
        config = vllm_config(engine.engine.config, served_model_name, engine.data_parallel_size)
        tp = engine.engine.config.parallel_config.tensor_parallel_size
        sglang = {"tp_size": tp, "tensor_parallel_size": tp, "pp_size": 1, "dp_size": 1, "ep_size": 1,
                  "moe_dp_size": 1, "num_gpus": 0, "disaggregation_mode": "null", "encoder_only": False,
                  "model_path": engine.engine.config.model_config.model,
                  "weight_version": engine.engine.weight_version_label}
        return {"vllm_config": config if config_format == "json" else json.dumps(config), "vllm_env": {},
                "system_env": {}, **sglang}

    @app.post("/tokenize", dependencies=[Depends(user_auth)])
    async def tokenize(body: TokenizeBody) -> dict[str, Any]:
        tok = engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give 'prompt' or 'messages'")
        try:
            if body.messages is not None:
                ids = tok.apply_chat_template(body.messages, add_generation_prompt=body.add_generation_prompt,
                                              tokenize=True, return_dict=False)
            else:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except Exception as err:
            raise ApiError(400, f"cannot tokenize: {err}") from err
        max_len = engine.engine.config.model_config.max_model_len
        return {"tokens": list(ids), "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize", dependencies=[Depends(user_auth)])
    async def detokenize(body: DetokenizeBody) -> dict[str, Any]:
        vocab_size = int(engine.engine.config.model_config.hf_config.get("vocab_size", 0))
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab_size})")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/get_weight_version", dependencies=admin)
    async def get_weight_version() -> dict[str, Any]:
        return versions()

    @app.get("/get_world_size", dependencies=admin)
    async def get_world_size() -> dict[str, int]:
        """Worker processes a torch_dist trainer broadcasts to (the engine's tensor_parallel_size)."""
        return {"world_size": engine.world_size}

    @app.get("/weight_checksums", dependencies=admin)
    async def weight_checksums() -> dict[str, Any]:
        checksums = (await guarded(engine.collective_rpc("weight_checksums")))[0]  # rank 0 (of replica 0)
        return {"weight_version": engine.engine.weight_version_label, "checksums": checksums}

    @app.post("/collective_rpc", dependencies=admin)
    async def collective_rpc(body: RpcBody) -> dict[str, Any]:
        if body.method not in RPC_ALLOWLIST:
            raise ApiError(403, f"method {body.method!r} is not allowed; allowed: {sorted(RPC_ALLOWLIST)}", "forbidden")
        try:
            results = await guarded(engine.collective_rpc(body.method, tuple(body.args), body.kwargs))
        except TypeError as err:  # arguments the method does not take
            raise ApiError(400, f"{body.method}(): {err}") from err
        return {"results": results}

    return app


def vllm_config(config: Any, served_name: str, data_parallel_size: int = 1) -> dict[str, Any]:
    """The fields of vLLM's `vllm_config` that RL clients read, from hotswap's config."""
    mc, pc, cc = config.model_config, config.parallel_config, config.cache_config
    spec = config.speculative_config
    return {
        "model_config": {
            "model": mc.model, "served_model_name": served_name, "dtype": str(mc.torch_dtype),
            "max_model_len": mc.max_model_len, "max_logprobs": mc.max_logprobs, "seed": mc.seed,
        },
        "parallel_config": {"tensor_parallel_size": pc.tensor_parallel_size, "pipeline_parallel_size": 1,
                            "data_parallel_size": data_parallel_size,
                            "world_size": pc.tensor_parallel_size * data_parallel_size,
                            "enable_expert_parallel": pc.enable_expert_parallel},
        "cache_config": {"block_size": cc.block_size, "enable_prefix_caching": cc.enable_prefix_caching,
                         "num_gpu_blocks": cc.num_kv_blocks},
        # every transport is available on request; clients only check that one is configured
        "weight_transfer_config": {"backend": "torch_dist", "backends": ["tensors", "shm", "torch_dist", "disk"],
                                   "atomic": config.weight_transfer_config.atomic},
        "speculative_config": None if not spec.enabled else {
            "method": spec.method, "model": spec.model, "num_speculative_tokens": spec.num_speculative_tokens},
        "quant_config": {"quantization": config.quant_config.quantization},
    }


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="Hugging Face checkpoint folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer' on /v1 routes")
    parser.add_argument("--admin-key", default=None, help="required as 'Authorization: Bearer' on admin routes")
    parser.add_argument(
        "--admin-auth", default="key", choices=["key", "none"],
        help="'none' opens the admin routes without a key (loopback hosts, or with --trusted-network)",
    )
    parser.add_argument("--trusted-network", action="store_true",
                        help="allow --admin-auth none on a non-loopback address: everyone who can reach the port "
                        "may change the weights (frameworks send no key; a private network only)")
    parser.add_argument(
        "--allowed-host", action="append", default=[],
        help="a Host header name admin routes answer to, besides localhost / 127.0.0.1 / ::1 (repeatable)",
    )
    parser.add_argument("--disable-admin", action="store_true", help="serve only the OpenAI routes")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="engine replicas on Ray behind this server (a fleet; needs hotswap[ray])")
    parser.add_argument("--ray-address", default=None,
                        help="a Ray cluster to run the fleet on ('auto', 'ray://host:port'; default: a local Ray)")
    parser.add_argument("--num-cpus-per-worker", type=float, default=1.0,
                        help="CPUs each worker of a fleet replica reserves in its placement group")
    parser.add_argument("--num-gpus-per-worker", type=float, default=None,
                        help="GPUs each worker of a fleet replica reserves (default: 1 where CUDA is available)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument("--prefix-cache-policy", default="reset", choices=["reset", "salt"])
    parser.add_argument("--max-request-bytes", type=int, default=RequestLimits.max_request_bytes)
    parser.add_argument("--max-stop-strings", type=int, default=RequestLimits.max_stop_strings)
    parser.add_argument("--max-stop-string-chars", type=int, default=RequestLimits.max_stop_string_chars)
    parser.add_argument("--max-n", type=int, default=RequestLimits.max_n, help="samples one request may ask for")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens one request may generate (default: up to the context length)")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="log probabilities one token may return (-1: the whole vocabulary)")
    parser.add_argument("--max-pause-wait-s", type=float, default=RequestLimits.max_pause_wait_s,
                        help="how long a request waits while generation is paused before it gets 503")
    parser.add_argument("--shutdown-timeout-s", type=float, default=5.0,
                        help="on SIGTERM, how long requests in flight may take before they are cut")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                        'or \'{"method": "draft_model", "model": DRAFT_DIR}\'')
    parser.add_argument("--log-level", default="warning")


def serve(args: argparse.Namespace) -> int:
    """Runs the server until interrupted. Refuses admin routes on a non-loopback host without an admin key."""
    import os

    import uvicorn

    enable_admin = not args.disable_admin
    check_keys(args.api_key, args.admin_key)
    trusted = getattr(args, "trusted_network", False)
    if enable_admin and args.admin_auth == "none" and not is_loopback(args.host) and not trusted:
        raise ValueError(f"--admin-auth none is refused on non-loopback host {args.host!r}; use --admin-key (or "
                         "--trusted-network on a private network)")
    if (
        enable_admin
        and args.admin_key is None
        and not is_loopback(args.host)
        and not (trusted and args.admin_auth == "none")
    ):
        raise ValueError(f"admin routes on non-loopback host {args.host!r} need --admin-key (or pass --disable-admin)")
    # bound to loopback, only loopback names are expected (another Host is a DNS-rebinding page); on a public
    # address the admin key protects the routes, and --allowed-host narrows the names if given
    allowed: frozenset[str] | None = None
    if is_loopback(args.host) or args.allowed_host:
        allowed = frozenset(LOOPBACK_NAMES | {args.host, *args.allowed_host})
    engine_kwargs = dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        quantization=args.quantization,
        prefix_cache_policy=args.prefix_cache_policy,
        tensor_parallel_size=args.tensor_parallel_size,
        max_logprobs=args.max_logprobs,
        speculative_config=args.speculative_config,
    )
    engine: AsyncLLMEngine | AsyncFleet
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 or args.ray_address is not None:
        from hotswap.fleet import Fleet

        engine = AsyncFleet(Fleet(args.model, num_replicas=args.data_parallel_size, address=args.ray_address,
                                  num_cpus_per_worker=args.num_cpus_per_worker,
                                  num_gpus_per_worker=args.num_gpus_per_worker, **engine_kwargs))
    else:
        engine = AsyncLLMEngine.from_kwargs(args.model, **engine_kwargs)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    limits = RequestLimits(
        args.max_request_bytes, args.max_stop_strings, args.max_stop_string_chars, args.max_pause_wait_s,
        args.max_n, args.max_tokens,
    )
    app = create_app(engine, name, args.api_key, args.admin_key, enable_admin, args.admin_auth, allowed, limits)
    print(
        f"serving {name!r} on http://{args.host}:{args.port} (admin routes {'on' if enable_admin else 'off'})",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=max(1, round(args.shutdown_timeout_s)))
    return 0
