"""Asyncio front end: the step loop runs in the background while callers stream outputs.

All engine state is touched only under one asyncio lock: the step loop holds it while a step runs in a worker
thread, and every other operation (adding or aborting a request, pausing, weight updates, sleep) takes it
between steps. Blocking calls (a step, a weight transfer) run in a thread so the event loop stays responsive:
always the same thread (the engine's), so that one OpenMP team runs torch's CPU work; with one team per calling
thread, a team left spinning after a weight update's slice took the cores from the next step (docs/log.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import itertools
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from hotswap.config import EngineConfig
from hotswap.engine.client import EngineStatus, Pairs, SessionFigures, UpdateInfo
from hotswap.engine.detokenizer import Detokenizer
from hotswap.engine.llm_engine import LLMEngine
from hotswap.engine.lora_registry import LoRARegistry
from hotswap.engine.lora_updates import lora_target
from hotswap.engine.state import EngineState
from hotswap.engine.weights_controller import WeightsController
from hotswap.errors import EngineBusy, EngineUnavailable, EngineUnresponsive
from hotswap.inputs import PromptType, Tokenizer
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput, TokenScores
from hotswap.sampling_params import SamplingParams
from hotswap.weights.version import VersionArg, parse_version

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


def _between_steps(
    method: Callable[Concatenate[S, P], R], of: Callable[[AsyncLLMEngine], S]
) -> Callable[Concatenate[AsyncLLMEngine, P], Coroutine[object, None, R]]:
    """`method` of the object `of(engine)` (the `LLMEngine`, or its weights controller) as a coroutine method of
    `AsyncLLMEngine`: run in the engine's thread under the engine lock, between steps (same parameters, result and
    docstring): a "between_steps" verb of `hotswap.engine.client.VERBS`."""

    async def call(self: AsyncLLMEngine, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._locked(method, of(self), *args, **kwargs)

    functools.update_wrapper(call, method)
    call.__dict__["__verb__"] = "between_steps"  # its kind in the verb table
    return call


def _weights(engine: AsyncLLMEngine) -> WeightsController:
    return engine.engine.weights


def _engine(engine: AsyncLLMEngine) -> LLMEngine:
    return engine.engine


def engine_status(engine: LLMEngine) -> EngineStatus:
    """`engine`'s state now (versions, pause, sleep, health, load, the open change); answers at once, no worker
    call: what `AsyncLLMEngine.status` and `LLM.status` answer."""
    weights = engine.weights
    return EngineStatus(
        weight_version=weights.version,
        weight_version_label=weights.current_label,
        draft_weight_version=weights.draft_version,
        draft_weight_version_label=weights.labels.label(weights.draft_version),
        draft_stale=weights.draft_stale,
        paused=engine.is_paused(),
        pause_mode=engine.pause_mode,
        refusing_new_requests=engine.refusing_new_requests(),
        asleep=engine.is_asleep(),
        health_problem=engine.health_problem(),
        requests=len(engine.requests),
        running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting),
        stats=engine.stats(),
        change=weights.change,
    )


class AsyncLLMEngine:
    """Background-stepped engine. Create it inside or outside a running loop; the step loop starts with the
    first request. `generate` streams one request's outputs; pause/resume, weight updates, sleep/wake and
    `collective_rpc` mirror `LLM`."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.config = config
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # the one thread that runs steps and every call under the lock (see the module doc)
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotswap-engine")
        self._thread_closed = False
        self._loop_task: asyncio.Task[None] | None = None
        self._holder: tuple[str, float] | None = None  # what holds the engine lock now ("step" or a call), since
        self._ids = itertools.count()
        self._stopped = False
        # Requests whose consumer went away; aborted by the loop (a cancelled caller cannot await the lock).
        self._pending_aborts: set[str] = set()

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> AsyncLLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def tokenizer(self) -> Tokenizer:
        tokenizer: Tokenizer = self.engine.tokenizer
        return tokenizer

    @property
    def detokenizer(self) -> Detokenizer:
        return self.engine.detokenizer

    def status(self) -> EngineStatus:
        """The engine's state now (`engine_status`); answers at once, without the engine lock."""
        return engine_status(self.engine)

    @property
    def local(self) -> AsyncLLMEngine:
        return self

    @property
    def replicas(self) -> None:
        return None

    @property
    def world_size(self) -> int:
        """Workers a group transport's trainer broadcasts to (the trainer not counted)."""
        return self.config.parallel_config.tensor_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return 1

    # ---- the loop -----------------------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._lock is None:
            self._lock, self._wake = asyncio.Lock(), asyncio.Event()
        if self._loop_task is None or self._loop_task.done():
            if self._stopped:
                raise RuntimeError("the engine has been shut down")
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._lock is not None and self._wake is not None
        while not self._stopped:
            await self._wake.wait()
            async with self._lock:
                engine = self.engine
                while self._pending_aborts:
                    engine.abort_request(self._pending_aborts.pop())
                if not engine.state.steps or not engine.has_unfinished_requests():
                    self._wake.clear()
                    continue
                try:
                    self._holder = ("step", time.monotonic())
                    outputs = await self._on_engine_thread(engine.step)
                except Exception as err:  # a worker failure ends the requests in flight, not the loop
                    for request_id in list(engine.requests):
                        engine.abort_request(request_id)
                        self._deliver_error(request_id, err)
                    continue
                finally:
                    self._holder = None
            for out in outputs:
                error = engine.take_error(out.request_id)
                if error is not None:
                    self._deliver_error(out.request_id, error)
                else:
                    self._deliver(out)
            await asyncio.sleep(0)  # let callers take the lock between steps

    def _deliver(self, out: RequestOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is not None:
            queue.put_nowait(out)

    def _deliver_error(self, request_id: str, err: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(err)

    async def between_steps(
        self, fn: Callable[Concatenate[LLMEngine, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Runs `fn(engine, *args, **kwargs)` (a blocking call on the `LLMEngine`) in a thread, between two steps,
        with the engine lock held: nothing else touches the engine meanwhile (e.g. a consistent snapshot of its
        weights, version and adapters)."""
        return await self._locked(fn, self.engine, *args, **kwargs)

    async def _on_engine_thread(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """`fn(*args, **kwargs)` on the engine's thread, in the caller's context (as `asyncio.to_thread`)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        if self._thread_closed:  # after shutdown (a late call): any thread
            return await asyncio.to_thread(call)
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    async def _locked(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Runs a blocking engine call in a thread, between steps."""
        self._ensure_loop()
        assert self._lock is not None and self._wake is not None
        try:
            async with self._lock:
                self._holder = (getattr(fn, "__name__", "call"), time.monotonic())
                try:
                    return await self._on_engine_thread(fn, *args, **kwargs)
                finally:
                    self._holder = None
        finally:
            self._wake.set()  # the call may have made the engine able to step again (an update ended, a wake-up)

    # ---- requests ------------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        routing_key: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams outputs of one request until it finishes (the last has `finished` True). A request that
        arrives while the engine is paused waits for resume; one while it is asleep raises EngineUnavailable.
        Cancelling the iteration aborts the request. `routing_key` (a fleet routes by it) names the request's
        session here, as a prompt dict's "session_id" does (hotswap/engine/sessions.py). `lora_request`: the LoRA
        adapter it runs with (loaded from its path on first use)."""
        params = sampling_params or SamplingParams()
        request_id = request_id or f"async-{next(self._ids)}"
        if self.engine.is_asleep():  # would wait for a wake_up that may never come
            raise EngineUnavailable("the engine is asleep; retry after wake_up")
        text, token_ids = await asyncio.to_thread(self._tokenize, prompt)  # CPU work off the event loop
        self._ensure_loop()
        assert self._lock is not None and self._wake is not None
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        async with self._lock:
            if self.engine.is_asleep():  # it fell asleep while the prompt was tokenized
                raise EngineUnavailable("the engine is asleep; retry after wake_up")
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use")
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            session = routing_key or (prompt.get("session_id") if isinstance(prompt, dict) else None)
            if (
                lora_request is not None
                and self.engine.loras is not None
                and lora_request.lora_name not in self.engine.loras.adapters
            ):
                # a first use reads the adapter's folder: off the event loop
                await asyncio.to_thread(self.engine.resolve_lora, lora_request)
            self.engine.add_request(
                request_id,
                text,
                token_ids,
                params,
                stream=True,
                cache_salt=salt,
                session_id=session,
                lora_request=lora_request,
            )
            self._queues[request_id] = queue
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the consumer stopped early (cancelled, disconnected): abort without awaiting
                self._pending_aborts.add(request_id)
                self._wake.set()

    async def score_tokens(
        self,
        sequences: list[list[int]],
        temperature: float = 1.0,
        top_logprobs: int = 0,
        top_k: int = -1,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ) -> list[TokenScores]:
        """`LLMEngine.score_tokens`, between steps (in a thread, under the engine lock)."""
        return await self._locked(self.engine.score_tokens, sequences, temperature, top_logprobs, top_k, top_p, min_p)

    # ---- sessions (hotswap/engine/sessions.py) --------------------------------------------------------------

    async def open_session(self, session_id: str) -> None:
        """Opens a session: its requests' cached prefixes are evicted after other traffic's."""
        self._ensure_loop()
        assert self._lock is not None
        async with self._lock:
            self.engine.sessions.open(session_id)

    async def close_session(self, session_id: str) -> SessionFigures | None:
        """Closes a session; returns its figures (None if it was not open)."""
        self._ensure_loop()
        assert self._lock is not None
        async with self._lock:
            stats = self.engine.sessions.close(session_id)
        return stats.json() if stats is not None else None

    async def session_stats(self, session_id: str) -> SessionFigures | None:
        """An open session's figures: requests, prompt tokens, prefix-cache hits (None if it is not open)."""
        stats = self.engine.sessions.stats.get(session_id)
        return stats.json() if stats is not None else None

    async def abort(self, request_id: str) -> None:
        """Ends a request now with finish_reason 'abort'; its stream receives the final output."""
        await self.abort_requests([request_id])

    async def abort_requests(self, request_ids: list[str] | None = None, prefix: str | None = None) -> list[str]:
        """Group abort between two steps (see `LLMEngine.abort_requests`): each stream receives its final output;
        returns the ids aborted."""
        self._ensure_loop()
        assert self._lock is not None
        async with self._lock:
            outs = self.engine.abort_requests(request_ids, prefix)
        for out in outs:
            self._deliver(out)
        return [out.request_id for out in outs]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self._tokenize(prompt["prompt"])
        raise ValueError("a prompt must be a string or a dict with 'prompt_token_ids' or 'prompt'")

    # ---- pause and resume -----------------------------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pauses generation (modes as in `LLMEngine.pause`). Returns once paused: for 'wait', after the
        requests in flight finished on the current weights."""
        self._ensure_loop()
        assert self._lock is not None and self._wake is not None
        async with self._lock:
            outputs = self.engine.pause(mode, clear_cache)
        for out in outputs:
            self._deliver(out)
        self._wake.set()
        while True:
            async with self._lock:
                if self.engine.is_paused():  # 'wait': the step loop drains the requests in flight
                    return
            await asyncio.sleep(0.001)

    async def resume_generation(self) -> None:
        self._ensure_loop()
        assert self._lock is not None and self._wake is not None
        async with self._lock:
            self.engine.resume()
        self._wake.set()

    async def is_paused(self) -> bool:
        return self.engine.is_paused()

    # ---- weights, memory, workers -----------------------------------------------------------------------------

    # Changes of the weights run in a thread under the engine lock, between steps (see WeightsController).
    start_weight_update = _between_steps(WeightsController.start_weight_update, _weights)

    async def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Pairs | None = None,
        target: str = "model",
        weight_version: VersionArg = None,
        encoding: str | None = None,
        base_version: VersionArg = None,
        checksums: dict[str, str] | None = None,
    ) -> None:
        """`LLM.reload_weights`, between steps; staged (`update_staging="shadow"`), received in slices of
        `staging_slice_ms` that alternate with the steps of running requests, then committed between two. An
        adapter's next version is received in slices either way."""
        weights = self.engine.weights
        args = (weights_path, weights_iterator, target, weight_version, encoding, base_version, checksums)
        sliced = weights.staged or lora_target(target) is not None
        await self._locked(weights.reload_weights, *args, sliced=sliced)
        if sliced:
            await self._advance_staged()

    async def update_weights(self, update_info: UpdateInfo, session_token: str | None = None) -> None:
        """`LLM.update_weights`, between steps; staged, received in slices that alternate with steps."""
        weights = self.engine.weights
        await self._locked(weights.update_weights, update_info, session_token, sliced=weights.staged)
        if weights.staged:
            await self._advance_staged()

    async def _advance_staged(self) -> None:
        """Receives the staged change just opened, one slice of `staging_slice_ms` between two steps at a time."""
        weights = self.engine.weights
        budget = self.config.weight_transfer_config.staging_slice_ms / 1000
        try:
            while not await self._locked(weights.advance_staged, budget):
                pass
        except asyncio.CancelledError:  # the caller went away mid-receive: the staged change is dropped
            if weights.receiving is not None:
                asyncio.get_running_loop().create_task(self._locked(weights.abort_weight_update))
            raise

    finish_weight_update = _between_steps(WeightsController.finish_weight_update, _weights)
    prepare_weight_update = _between_steps(WeightsController.prepare_weight_update, _weights)
    prepare_reload = _between_steps(WeightsController.prepare_reload, _weights)
    commit_weight_update = _between_steps(WeightsController.commit_weight_update, _weights)
    export_weights = _between_steps(WeightsController.export_weights, _weights)
    adopt_weights = _between_steps(WeightsController.adopt_weights, _weights)
    shutdown_weight_transfer_engine = _between_steps(WeightsController.shutdown_weight_transfer_engine, _weights)

    async def check_liveness(self, timeout_s: float = 5.0) -> float:
        """Waits (up to `timeout_s`) for the engine to come between steps, then makes a no-op round trip through
        every worker within the time left (at least a second); returns the seconds it all took. Raises
        EngineBusy when an admin call (a reload, an update, a sleep) held the engine all along (it is working;
        the workers were not asked), EngineUnresponsive when a step did not end in time or a worker did not
        answer."""
        self._ensure_loop()
        assert self._lock is not None and self._wake is not None
        start = time.monotonic()
        lock = self._lock
        acquiring = asyncio.ensure_future(lock.acquire())
        done, _ = await asyncio.wait({acquiring}, timeout=timeout_s)
        if not done:
            acquiring.cancel()
            # it may have taken the lock as it was cancelled: then give it back
            acquiring.add_done_callback(
                lambda t: lock.release() if not t.cancelled() and t.exception() is None else None
            )
            holder = self._holder
            if holder is not None and holder[0] != "step":
                raise EngineBusy(f"{holder[0]}() has held the engine for {time.monotonic() - holder[1]:.1f} s")
            raise EngineUnresponsive(f"the engine did not come between steps within {timeout_s:g} s")
        try:
            left = max(1.0, timeout_s - (time.monotonic() - start))  # a late turn still gets a fair round trip
            await asyncio.to_thread(self.engine.check_liveness, left)
        finally:
            lock.release()
            self._wake.set()
        return time.monotonic() - start

    update_config = _between_steps(LLMEngine.update_config, _engine)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Creates the receiving side of a transport and waits until its trainer joined; generation goes on
        meanwhile (the engine lock is taken only to start and to poll)."""
        await self._locked(self.engine.weights.begin_weight_transfer_engine, init_info)
        while not await self._locked(self.engine.weights.weight_transfer_ready):
            await asyncio.sleep(0.01)

    async def abort_weight_update(self, session_token: str | None = None) -> None:
        """Ends the open update session. An update blocked waiting for its trainer is interrupted first (it fails
        and rolls back), so the abort does not wait for that transport's timeout."""
        self.engine.weights.check_session(session_token, ending=True)
        if self.engine.state is EngineState.UPDATING:
            self.engine.executor.interrupt_waits()
        await self._locked(self.engine.weights.abort_weight_update, session_token)

    async def set_change_version(self, weight_version: VersionArg, session_token: str | None = None) -> None:
        """Records on the open session the version it is to commit as (`OpenChange.version`, which a later
        `finish_weight_update` is given: SGLang's sessions name it with an update, not with their end). Raises
        ValueError for a bad version, RuntimeError without an open session or with another session's token."""
        parse_version(weight_version)
        weights = self.engine.weights

        def record() -> None:  # between steps, as every other change of the open session
            weights.check_session(session_token)
            if weights.change is None or weights.change.token is None:
                raise RuntimeError("no weight-update session is open; call start_weight_update() first")
            weights.change.version = weight_version

        await self._locked(record)

    async def get_weight_version(self, target: str = "model") -> int:
        return self.engine.draft_weight_version if target == "draft" else self.engine.weight_version

    async def update_weight_version(self, new_version: int | str, abort_all_requests: bool = False) -> str:
        """Renames the served version (see `LLM.update_weight_version`); returns the new label. With
        `abort_all_requests`, every request ends now (finish_reason 'abort', its stream gets the partial output)."""
        await self._locked(self.engine.weights.rename, new_version)  # never between a commit's version and label
        if abort_all_requests:
            for request_id in list(self.engine.requests):
                await self.abort(request_id)
        return self.engine.weight_version_label

    async def reset_prefix_cache(self) -> None:
        await self._locked(self.engine.reset_prefix_cache, True)

    # ---- LoRA adapters (see LLM's methods of the same names) -------------------------------------------------

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        load_inplace: bool = False,
        tensors: dict[str, torch.Tensor] | None = None,
        peft_config: dict[str, Any] | None = None,
        lora_int_id: int | None = None,
        pinned: bool = False,
    ) -> dict[str, Any]:
        registry = self._registry()
        adapter = await self._locked(
            registry.load, lora_name, lora_path, tensors, peft_config, lora_int_id, load_inplace, pinned
        )
        return next(d for d in registry.describe() if d["lora_name"] == adapter.name)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._locked(self._registry().unload, lora_name)

    async def list_loras(self) -> list[dict[str, Any]]:
        return [] if self.engine.loras is None else self.engine.loras.describe()

    def _registry(self) -> LoRARegistry:
        if self.engine.loras is None:
            raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True")
        return self.engine.loras

    sleep = _between_steps(LLMEngine.sleep, _engine)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._locked(self.engine.wake_up, tags)
        assert self._wake is not None
        self._wake.set()

    async def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return await self._locked(self.engine.executor.collective_rpc, method, args, kwargs)

    async def shutdown(self) -> None:
        """Stops the step loop; requests still in flight are aborted."""
        self._stopped = True
        if self._lock is not None:
            async with self._lock:
                for request_id in list(self.engine.requests):
                    out = self.engine.abort_request(request_id)
                    if out is not None:
                        self._deliver(out)
        if self._wake is not None:
            self._wake.set()
        if self._loop_task is not None:
            await self._loop_task
        self._thread_closed = True
        self._thread.shutdown(wait=False)
