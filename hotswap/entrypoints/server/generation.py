"""One OpenAI-route request on the engine, from its first output to its answer: a whole response, or a stream
of server-sent events.

While no output comes (generation paused), the request watches its client: a client that went away aborts it
(499), and so does a pause longer than `RequestLimits.max_pause_wait_s` (503 with Retry-After). A stream sends
SSE comments meanwhile, so that a closed connection shows up. Token counts and latency go to the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

from fastapi import Request
from fastapi.responses import StreamingResponse

from hotswap.entrypoints.server.state import ApiError, ServerState
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams


async def start(
    state: ServerState,
    prompt: dict[str, Any],
    params: SamplingParams,
    request_id: str,
    http: Request,
    lora: LoRARequest | None = None,
) -> Generation:
    """Submits `prompt` (run with LoRA adapter `lora` if given) and waits for its first output. Raises ApiError 503
    while generation is paused for new requests, and (499/503 as above, the app's exception handlers mapping the
    engine's errors) while waiting."""
    started = time.perf_counter()
    engine = state.engine
    now = engine.status()
    if now.refusing_new_requests:
        raise ApiError(
            503,
            f"generation is paused (mode {now.pause_mode!r}); retry after /resume",
            "service_unavailable",
            {"Retry-After": "1"},
        )
    # an async generator function: its iterator has aclose(); a session id keeps a fleet's routing sticky
    key = http.headers.get("x-session-id")
    generator = cast(
        "AsyncGenerator[RequestOutput, None]", engine.generate(prompt, params, request_id, key, lora_request=lora)
    )
    watch = ClientWatch(http)
    try:
        first = await next_output(state, generator, watch)
    except StopAsyncIteration as err:  # pragma: no cover - generate always yields at least once
        raise ApiError(500, "no output", "internal_error") from err
    except BaseException:
        await generator.aclose()  # a request that ends here (its client left, a refusal) is aborted now
        raise
    return Generation(state, generator, http, started, first, watch)


async def generate_full(
    state: ServerState,
    prompt: dict[str, Any],
    params: SamplingParams,
    request_id: str,
    http: Request,
    lora: LoRARequest | None = None,
) -> RequestOutput:
    """The request's final output (`start`, then `Generation.collect`)."""
    return await (await start(state, prompt, params, request_id, http, lora)).collect()


@dataclass
class ClientWatch:
    """Whether a request's client is still there, asked at most every `DISCONNECT_CHECK_S` (a non-streaming
    request learns that its client left while outputs keep coming, not only while it waits for one)."""

    http: Request
    checked: float = 0.0

    async def gone(self) -> bool:
        now = time.monotonic()
        if now - self.checked < DISCONNECT_CHECK_S:
            return False
        self.checked = now
        return await self.http.is_disconnected()


DISCONNECT_CHECK_S = 0.01  # about an engine step: a request whose client left is aborted within a few steps


async def next_output(
    state: ServerState, generator: AsyncGenerator[RequestOutput, None], watch: ClientWatch
) -> RequestOutput:
    """The request's next output; a client that went away meanwhile (while outputs come, or while generation is
    paused) aborts the request (499), and so does a pause longer than `limits.max_pause_wait_s` (503)."""
    limits = state.limits
    pending = asyncio.ensure_future(generator.__anext__())
    paused_since: float | None = None
    try:
        while True:
            arrived = (await asyncio.wait({pending}, timeout=0.5))[0]
            if await watch.gone():
                raise ApiError(499, "the client disconnected", "client_closed_request")
            if arrived:
                break
            now = time.monotonic()
            paused_since = (paused_since or now) if state.engine.status().paused else None
            if paused_since is not None and now - paused_since > limits.max_pause_wait_s:
                raise ApiError(
                    503,
                    f"generation has been paused for over {limits.max_pause_wait_s:.0f} s (--max-pause-wait-s)",
                    "service_unavailable",
                    {"Retry-After": "5"},
                )
        return await pending
    finally:
        if not pending.done():  # ended early (an error above, or this handler cancelled): stop the wait
            pending.cancel()
            with contextlib.suppress(BaseException):  # let it unwind before the generator is closed
                await pending
        elif not pending.cancelled():
            pending.exception()  # an error that came as the client left is retrieved here, not logged as lost


@dataclass
class Generation:
    """A submitted request whose first output (`first`) has come; `started`: when it was received
    (perf_counter)."""

    state: ServerState
    generator: AsyncGenerator[RequestOutput, None]
    http: Request
    started: float
    first: RequestOutput
    watch: ClientWatch

    def _account(self, out: RequestOutput) -> None:
        if out.finished:
            self.state.metrics.inc("hotswap_prompt_tokens", len(out.prompt_token_ids))
            self.state.metrics.observe("hotswap_request_latency_seconds", time.perf_counter() - self.started)

    async def collect(self) -> RequestOutput:
        """Waits for the final output (the request is aborted when this ends early)."""
        out = self.first
        try:
            while not out.finished:
                out = await next_output(self.state, self.generator, self.watch)
        finally:
            await self.generator.aclose()  # an unfinished request is aborted
        self.state.metrics.inc("hotswap_generation_tokens", sum(len(c.token_ids) for c in out.outputs))
        self._account(out)
        return out

    def stream(
        self,
        make_chunk: Callable[[RequestOutput], dict[str, Any]],
        final_chunk: Callable[[], dict[str, Any]] | None = None,
    ) -> StreamingResponse:
        """The outputs as server-sent events: `make_chunk` of each, then `final_chunk()` if given (the usage),
        then `[DONE]`. A client that disconnects aborts the request."""
        return StreamingResponse(self._events(make_chunk, final_chunk), media_type="text/event-stream")

    async def _events(
        self,
        make_chunk: Callable[[RequestOutput], dict[str, Any]],
        final_chunk: Callable[[], dict[str, Any]] | None,
    ) -> AsyncIterator[str]:
        metrics = self.state.metrics
        out = self.first
        pending: asyncio.Future[RequestOutput] | None = None
        try:
            while True:
                metrics.inc("hotswap_generation_tokens", sum(len(c.token_ids) for c in out.outputs))
                yield f"data: {json.dumps(make_chunk(out))}\n\n"
                self._account(out)
                if out.finished:
                    if final_chunk is not None:  # stream_options.include_usage
                        yield f"data: {json.dumps(final_chunk())}\n\n"
                    break
                pending = asyncio.ensure_future(self.generator.__anext__())
                while not (await asyncio.wait({pending}, timeout=0.5))[0]:
                    # No output (e.g. generation paused): an SSE comment lets a closed connection show up,
                    # since a disconnect is only seen when sending.
                    if await self.http.is_disconnected():
                        return
                    yield ": keep-alive\n\n"
                out, pending = pending.result(), None
            yield "data: [DONE]\n\n"
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):  # unwound before the generator is closed (closing a
                    await pending  # generator whose __anext__ still runs raises "already running")
            await self.generator.aclose()  # a client that disconnected aborts its request
