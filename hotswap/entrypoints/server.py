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
from typing import TYPE_CHECKING, Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotswap.engine.async_llm_engine import AsyncLLMEngine, EngineUnavailable
from hotswap.entrypoints import openai_protocol as oai
from hotswap.entrypoints.metrics import Metrics
from hotswap.sampling_params import SamplingParams
from hotswap.weights.session import WeightUpdateFailed

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


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class ReloadBody(_Body):
    weights_path: str | None = None
    target: str = Field(default="model", pattern="^(model|draft)$")


class InitBody(_Body):
    init_info: dict[str, Any]


class StartBody(_Body):
    target: str = Field(default="model", pattern="^(model|draft|all)$")


class UpdateBody(_Body):
    update_info: dict[str, Any]
    session_token: str | None = None


class FinishBody(_Body):
    weight_version: int | None = None
    session_token: str | None = None


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
    engine: AsyncLLMEngine,
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
                       "change the served weights; use this on a trusted network only")  # fmt: skip

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
    metrics.describe("hotswap_weight_version", "gauge", "Weight version being served")
    for name, (kind, text) in SPEC_METRIC_HELP.items():
        metrics.describe(name, kind, text)
    metrics.describe("hotswap_requests_running", "gauge", "Requests queued or being generated")
    metrics.describe("hotswap_weight_update_seconds", "summary", "Duration of weight updates (start to finish)")
    metrics.set("hotswap_weight_version", 0)
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
                           "permission_error")  # fmt: skip
        if "origin" in request.headers:
            raise ApiError(403, "admin routes refuse cross-origin (browser) requests", "permission_error")
        if admin_auth == "none":
            return
        if admin_key is None:
            raise ApiError(403, "admin routes are off: start the server with --admin-key (or --admin-auth none on "
                           "a trusted network)", "permission_error")  # fmt: skip
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
                                         "invalid_request_error", 413)).encode()  # fmt: skip
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})  # fmt: skip

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
        return metrics.render()

    @app.get("/v1/models", dependencies=[Depends(user_auth)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "owned_by": "hotswap"}]}

    async def run(
        prompt: Any, params: Any, request_id: str, make_chunk: Any, make_full: Any, stream: bool, http: Request
    ) -> Any:
        start = time.perf_counter()
        # an async generator function: its iterator has aclose()
        generator = cast("AsyncGenerator[RequestOutput, None]", engine.generate(prompt, params, request_id))

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
                                       "(--max-pause-wait-s)", "service_unavailable", {"Retry-After": "5"})  # fmt: skip
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

    @app.post("/v1/completions", dependencies=[Depends(user_auth)])
    async def completions(body: oai.CompletionRequest, http: Request) -> Any:
        check_model(body.model)
        try:
            if isinstance(body.prompt, str):
                check_unicode(body.prompt, "the prompt")
            params = oai.sampling_params(body, body.logprobs, body.max_tokens)
            check_limits(body.stop, params)
        except ValueError as err:
            raise ApiError(400, str(err)) from err
        prompt = body.prompt if isinstance(body.prompt, str) else {"prompt_token_ids": body.prompt}
        request_id = oai.new_id("cmpl")
        created = int(time.time())

        def chunk(out: Any) -> dict[str, Any]:
            return {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": served_model_name,
                "choices": [
                    {
                        "index": c.index,
                        "text": c.text,
                        "logprobs": oai.completion_logprobs(c, 0),
                        "finish_reason": c.finish_reason,
                        "weight_versions": oai.spans(c),
                    }
                    for c in out.outputs
                ],
            }

        return await run(
            prompt,
            params,
            request_id,
            chunk,
            lambda o: oai.completion_response(o, served_model_name, request_id),
            body.stream,
            http,
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(user_auth)])
    async def chat_completions(body: oai.ChatCompletionRequest, http: Request) -> Any:
        check_model(body.model)
        top_n = body.top_logprobs or 0
        try:
            params = oai.sampling_params(
                body, top_n if body.logprobs else None, body.max_completion_tokens or body.max_tokens
            )
            check_limits(body.stop, params)
            for message in body.messages:
                check_unicode(message.content, "a message's content")
            ids = await asyncio.to_thread(  # CPU work off the event loop
                engine.tokenizer.apply_chat_template,
                [m.model_dump() for m in body.messages], add_generation_prompt=True, tokenize=True, return_dict=False,
            )  # fmt: skip
        except ValueError as err:
            raise ApiError(400, str(err)) from err
        request_id = oai.new_id("chatcmpl")
        created = int(time.time())
        sent_role: set[int] = set()

        def chunk(out: Any) -> dict[str, Any]:
            choices = []
            for c in out.outputs:
                delta: dict[str, Any] = {"content": c.text}
                if c.index not in sent_role:
                    delta["role"] = "assistant"
                    sent_role.add(c.index)
                choices.append(
                    {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": oai.chat_logprobs(c, top_n),
                        "finish_reason": c.finish_reason,
                        "weight_versions": oai.spans(c),
                    }
                )
            return {
                "id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": served_model_name, "choices": choices,
            }  # fmt: skip

        return await run(
            {"prompt_token_ids": list(ids)}, params, request_id, chunk,
            lambda o: oai.chat_response(o, served_model_name, request_id, top_n), body.stream, http,
        )  # fmt: skip

    if not enable_admin:
        return app

    # ---- admin routes ---------------------------------------------------------------------------------------

    admin = [Depends(require_admin)]

    def version_changed() -> None:
        metrics.set("hotswap_weight_version", engine.engine.weight_version)

    def versions() -> dict[str, Any]:
        """The served version, and with a speculative draft model the version it was last updated for."""
        out: dict[str, Any] = {"weight_version": engine.engine.weight_version}
        if engine.engine.config.draft_model_config is not None:
            out["draft_weight_version"] = engine.engine.draft_weight_version
            out["draft_stale"] = engine.engine.draft_stale
        return out

    @app.post("/reload_weights", dependencies=admin)
    async def reload_weights(body: ReloadBody | None = None) -> dict[str, Any]:
        start = time.perf_counter()
        body = body or ReloadBody()
        await guarded(engine.reload_weights(weights_path=body.weights_path, target=body.target))
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
    async def pause(body: PauseBody | None = None) -> dict[str, bool]:
        body = body or PauseBody()
        await guarded(engine.pause_generation(body.mode, body.clear_cache))
        return {"paused": True}

    @app.post("/resume", dependencies=admin)
    async def resume() -> dict[str, bool]:
        await guarded(engine.resume_generation())
        return {"paused": False}

    @app.get("/is_paused", dependencies=admin)
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await engine.is_paused()}

    @app.post("/sleep", dependencies=admin)
    async def sleep(body: SleepBody | None = None) -> dict[str, str]:
        await guarded(engine.sleep((body or SleepBody()).level))
        return {"status": "ok"}

    @app.post("/wake_up", dependencies=admin)
    async def wake_up(body: WakeBody | None = None) -> dict[str, str]:
        await guarded(engine.wake_up((body or WakeBody()).tags))
        return {"status": "ok"}

    @app.post("/reset_prefix_cache", dependencies=admin)
    async def reset_prefix_cache() -> dict[str, str]:
        await guarded(engine.reset_prefix_cache())
        return {"status": "ok"}

    @app.get("/get_weight_version", dependencies=admin)
    async def get_weight_version() -> dict[str, Any]:
        return versions()

    @app.get("/get_world_size", dependencies=admin)
    async def get_world_size() -> dict[str, int]:
        """Worker processes a torch_dist trainer broadcasts to (the engine's tensor_parallel_size)."""
        return {"world_size": engine.config.parallel_config.tensor_parallel_size}

    @app.get("/weight_checksums", dependencies=admin)
    async def weight_checksums() -> dict[str, Any]:
        (checksums,) = await guarded(engine.collective_rpc("weight_checksums"))
        return {"weight_version": engine.engine.weight_version, "checksums": checksums}

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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="Hugging Face checkpoint folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer' on /v1 routes")
    parser.add_argument("--admin-key", default=None, help="required as 'Authorization: Bearer' on admin routes")
    parser.add_argument(
        "--admin-auth", default="key", choices=["key", "none"],
        help="'none' opens the admin routes without a key (loopback hosts only: a trusted network)",
    )  # fmt: skip
    parser.add_argument(
        "--allowed-host", action="append", default=[],
        help="a Host header name admin routes answer to, besides localhost / 127.0.0.1 / ::1 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--disable-admin", action="store_true", help="serve only the OpenAI routes")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument("--prefix-cache-policy", default="reset", choices=["reset", "salt"])
    parser.add_argument("--max-request-bytes", type=int, default=RequestLimits.max_request_bytes)
    parser.add_argument("--max-stop-strings", type=int, default=RequestLimits.max_stop_strings)
    parser.add_argument("--max-stop-string-chars", type=int, default=RequestLimits.max_stop_string_chars)
    parser.add_argument("--max-n", type=int, default=RequestLimits.max_n, help="samples one request may ask for")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens one request may generate (default: up to the context length)")  # fmt: skip
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="log probabilities one token may return (-1: the whole vocabulary)")  # fmt: skip
    parser.add_argument("--max-pause-wait-s", type=float, default=RequestLimits.max_pause_wait_s,
                        help="how long a request waits while generation is paused before it gets 503")  # fmt: skip
    parser.add_argument("--shutdown-timeout-s", type=float, default=5.0,
                        help="on SIGTERM, how long requests in flight may take before they are cut")  # fmt: skip
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                        'or \'{"method": "draft_model", "model": DRAFT_DIR}\'')  # fmt: skip
    parser.add_argument("--log-level", default="warning")


def serve(args: argparse.Namespace) -> int:
    """Runs the server until interrupted. Refuses admin routes on a non-loopback host without an admin key."""
    import os

    import uvicorn

    enable_admin = not args.disable_admin
    check_keys(args.api_key, args.admin_key)
    if enable_admin and args.admin_auth == "none" and not is_loopback(args.host):
        raise ValueError(f"--admin-auth none is refused on non-loopback host {args.host!r}; use --admin-key")
    if enable_admin and args.admin_key is None and not is_loopback(args.host):
        raise ValueError(f"admin routes on non-loopback host {args.host!r} need --admin-key (or pass --disable-admin)")
    # bound to loopback, only loopback names are expected (another Host is a DNS-rebinding page); on a public
    # address the admin key protects the routes, and --allowed-host narrows the names if given
    allowed: frozenset[str] | None = None
    if is_loopback(args.host) or args.allowed_host:
        allowed = frozenset(LOOPBACK_NAMES | {args.host, *args.allowed_host})
    engine = AsyncLLMEngine.from_kwargs(
        args.model,
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
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    limits = RequestLimits(
        args.max_request_bytes, args.max_stop_strings, args.max_stop_string_chars, args.max_pause_wait_s,
        args.max_n, args.max_tokens,
    )  # fmt: skip
    app = create_app(engine, name, args.api_key, args.admin_key, enable_admin, args.admin_auth, allowed, limits)
    print(
        f"serving {name!r} on http://{args.host}:{args.port} (admin routes {'on' if enable_admin else 'off'})",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=max(1, round(args.shutdown_timeout_s)))  # fmt: skip
    return 0
