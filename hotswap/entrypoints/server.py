"""OpenAI-compatible HTTP server with an authenticated admin API for RL weight updates.

OpenAI routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`, streaming over SSE) need
`Authorization: Bearer <api key>` when one is set. Admin routes (weights, generation control, inspection,
allow-listed `collective_rpc`) need `Authorization: Bearer <admin key>`; the server refuses to start with admin
routes on a non-loopback host without an admin key. Client mistakes get 4xx in OpenAI's error shape.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.entrypoints import openai_protocol as oai
from hotswap.entrypoints.metrics import Metrics
from hotswap.weights.session import WeightUpdateFailed

if TYPE_CHECKING:
    from hotswap.outputs import RequestOutput

# Worker methods `/collective_rpc` may call: read-only inspection.
RPC_ALLOWLIST = frozenset({"weight_checksums", "determine_num_kv_blocks", "shard_plan"})


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReloadBody(_Body):
    weights_path: str | None = None


class InitBody(_Body):
    init_info: dict[str, Any]


class StartBody(_Body):
    target: str = "model"


class UpdateBody(_Body):
    update_info: dict[str, Any]


class FinishBody(_Body):
    weight_version: int | None = None


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


def create_app(
    engine: AsyncLLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    admin_key: str | None = None,
    enable_admin: bool = True,
) -> FastAPI:
    """The FastAPI app serving `engine`."""
    app = FastAPI(title="hotswap", version="0.1.0")
    metrics = Metrics()
    metrics.describe("hotswap_requests", "counter", "Requests by route and status")
    metrics.describe("hotswap_prompt_tokens", "counter", "Prompt tokens processed")
    metrics.describe("hotswap_generation_tokens", "counter", "Tokens generated")
    metrics.describe("hotswap_request_latency_seconds", "summary", "End-to-end latency of generation requests")
    metrics.describe("hotswap_weight_version", "gauge", "Weight version being served")
    metrics.describe("hotswap_requests_running", "gauge", "Requests queued or being generated")
    metrics.describe("hotswap_weight_update_seconds", "summary", "Duration of weight updates (start to finish)")
    metrics.set("hotswap_weight_version", 0)
    update_started: list[float] = []

    def check(expected: str | None, request: Request) -> None:
        if expected is not None and not secrets.compare_digest(_bearer(request) or "", expected):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)", "authentication_error")

    def user_auth(request: Request) -> None:
        check(api_key, request)

    def admin_auth(request: Request) -> None:
        check(admin_key, request)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(oai.error_body(err.message, err.kind, err.status), status_code=err.status)

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

    class CountRequests:
        """Pure ASGI middleware (unlike @app.middleware, it keeps disconnect detection working for streams)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await self.inner(scope, receive, send)
                return

            async def counting_send(message: Any) -> None:
                if message["type"] == "http.response.start":
                    metrics.inc("hotswap_requests", route=scope["path"], status=str(message["status"]))
                await send(message)

            await self.inner(scope, receive, counting_send)

    app.add_middleware(CountRequests)

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
        except RuntimeError as err:
            raise ApiError(409, str(err), "conflict") from err

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {served_model_name!r}", "not_found")

    # ---- OpenAI routes ------------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics() -> str:
        metrics.set("hotswap_requests_running", len(engine.engine.requests))
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
        try:
            first = await guarded(generator.__anext__())
        except StopAsyncIteration as err:  # pragma: no cover - generate always yields at least once
            raise ApiError(500, "no output", "internal_error") from err

        def account(out: Any) -> None:
            if out.finished:
                metrics.inc("hotswap_prompt_tokens", len(out.prompt_token_ids))
                metrics.observe("hotswap_request_latency_seconds", time.perf_counter() - start)

        if not stream:
            out = first
            while not out.finished:
                out = await guarded(generator.__anext__())
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
            params = oai.sampling_params(body, body.logprobs, body.max_tokens)
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
            ids = engine.tokenizer.apply_chat_template(
                [m.model_dump() for m in body.messages], add_generation_prompt=True, tokenize=True, return_dict=False
            )
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

    admin = [Depends(admin_auth)]

    def version_changed() -> None:
        metrics.set("hotswap_weight_version", engine.engine.weight_version)

    @app.post("/reload_weights", dependencies=admin)
    async def reload_weights(body: ReloadBody | None = None) -> dict[str, Any]:
        start = time.perf_counter()
        await guarded(engine.reload_weights(weights_path=(body or ReloadBody()).weights_path))
        metrics.observe("hotswap_weight_update_seconds", time.perf_counter() - start)
        version_changed()
        return {"weight_version": engine.engine.weight_version}

    @app.post("/init_weight_transfer_engine", dependencies=admin)
    async def init_weight_transfer_engine(body: InitBody) -> dict[str, str]:
        await guarded(engine.init_weight_transfer_engine(body.init_info))
        return {"status": "ok"}

    @app.post("/start_weight_update", dependencies=admin)
    async def start_weight_update(body: StartBody | None = None) -> dict[str, str]:
        await guarded(engine.start_weight_update((body or StartBody()).target))
        update_started[:] = [time.perf_counter()]
        return {"status": "ok"}

    @app.post("/update_weights", dependencies=admin)
    async def update_weights(body: UpdateBody) -> dict[str, str]:
        await guarded(engine.update_weights(body.update_info))
        return {"status": "ok"}

    @app.post("/finish_weight_update", dependencies=admin)
    async def finish_weight_update(body: FinishBody | None = None) -> dict[str, Any]:
        await guarded(engine.finish_weight_update((body or FinishBody()).weight_version))
        if update_started:
            metrics.observe("hotswap_weight_update_seconds", time.perf_counter() - update_started.pop())
        version_changed()
        return {"weight_version": engine.engine.weight_version}

    @app.post("/abort_weight_update", dependencies=admin)
    async def abort_weight_update() -> dict[str, str]:
        await guarded(engine.abort_weight_update())
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
    async def get_weight_version() -> dict[str, int]:
        return {"weight_version": await engine.get_weight_version()}

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
        results = await guarded(engine.collective_rpc(body.method, tuple(body.args), body.kwargs))
        return {"results": results}

    return app


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="Hugging Face checkpoint folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer' on /v1 routes")
    parser.add_argument("--admin-key", default=None, help="required as 'Authorization: Bearer' on admin routes")
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
    parser.add_argument("--log-level", default="warning")


def serve(args: argparse.Namespace) -> int:
    """Runs the server until interrupted. Refuses admin routes on a non-loopback host without an admin key."""
    import os

    import uvicorn

    enable_admin = not args.disable_admin
    if enable_admin and args.admin_key is None and not is_loopback(args.host):
        raise ValueError(f"admin routes on non-loopback host {args.host!r} need --admin-key (or pass --disable-admin)")
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
    )
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = create_app(engine, name, args.api_key, args.admin_key, enable_admin)
    print(
        f"serving {name!r} on http://{args.host}:{args.port} (admin routes {'on' if enable_admin else 'off'})",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
