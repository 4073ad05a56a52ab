"""The fleet behind the OpenAI server: `AsyncLLMEngine`'s interface over a `Fleet`.

Requests stream from their replica through Ray's streaming generators; a client that goes away cancels the
replica's call, which aborts the request there. A replica that dies before a request's first output has the
request started again on another; one that dies later ends the request with finish_reason 'abort' (its tokens so
far and their version spans kept). Everything else runs the fleet's blocking methods in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.engine.client import EngineClient, EngineStatus, SessionFigures
from hotswap.engine.detokenizer import Detokenizer
from hotswap.errors import EngineUnavailable
from hotswap.fleet.fleet import Fleet
from hotswap.fleet.replicas import _cause, _first_line, _ray
from hotswap.inputs import PromptType, Tokenizer
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams

P = ParamSpec("P")
R = TypeVar("R")


def _in_thread(
    method: Callable[Concatenate[Fleet, P], R],
) -> Callable[Concatenate[AsyncFleet, P], Coroutine[object, None, R]]:
    """`method` of the fleet as a coroutine method of `AsyncFleet`, run in a worker thread (same parameters, same
    result, same docstring): an "in_thread" verb of `hotswap.engine.client.VERBS`."""

    async def call(self: AsyncFleet, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(method, self.fleet, *args, **kwargs)

    functools.update_wrapper(call, method)
    call.__dict__["__verb__"] = "in_thread"  # its kind in the verb table
    return call


class AsyncFleet:
    """A `Fleet` with the coroutine methods `create_app` calls on an `AsyncLLMEngine`."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.config = fleet.config
        self.tokenizer: Tokenizer = fleet.tokenizer
        self.detokenizer: Detokenizer = fleet.detokenizer

    def status(self) -> EngineStatus:
        """`Fleet.status`: answers at once (replica figures are those of the last health check)."""
        return self.fleet.status()

    @property
    def local(self) -> None:
        return None

    @property
    def replicas(self) -> AsyncFleet:
        return self

    def replica_status(self) -> list[dict[str, Any]]:
        """`Fleet.replica_status`: per replica, its state, version, routing and last health report."""
        return self.fleet.replica_status()

    @property
    def world_size(self) -> int:
        """Workers a group transport's trainer broadcasts to: every replica's."""
        return self.fleet.get_world_size()

    @property
    def data_parallel_size(self) -> int:
        return self.fleet.num_replicas

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        routing_key: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs from the replica the router chose (see the module docstring).
        `lora_request`: the adapter it runs with; one the fleet has not loaded is loaded on every replica first
        (`Fleet.resolve_loras`)."""
        ray = _ray()
        fleet = self.fleet
        params = sampling_params or SamplingParams()
        request_id = request_id or fleet.next_request_id()
        staged = await asyncio.to_thread(fleet.prepare_prompt, prompt)
        if lora_request is not None:
            lora_request = (await asyncio.to_thread(fleet.resolve_loras, [lora_request]))[0]
        if routing_key is not None:  # the session the replica keeps its KV for
            staged["session_id"] = routing_key
        routing_key = routing_key or staged.get("session_id")
        tried: set[int] = set()
        last: RequestOutput | None = None
        while True:
            member = fleet.route(staged, params, request_id, routing_key, avoid=tried)
            actor, stream = member.actor, None
            finished, produced = False, 0
            try:
                stream = actor.stream.options(num_returns="streaming").remote(staged, params, request_id, lora_request)
                async for ref in stream:
                    out: RequestOutput = await ref
                    total = sum(len(c.token_ids) for c in out.outputs)
                    fleet.router.progressed(request_id, total if params.output_kind == "delta" else total - produced)
                    produced = total if params.output_kind != "delta" else produced + total
                    last, finished = out, out.finished
                    yield out
                return
            except ray.exceptions.RayTaskError as err:
                raise _cause(err) from None
            except ray.exceptions.RayError as err:  # the replica died (or Ray lost the call)
                await asyncio.to_thread(fleet._failed, member, f"it failed while generating: {_first_line(err)}", actor)
                finished = True  # nothing left to cancel there
                if last is None:  # nothing delivered yet: the request starts again on another replica
                    tried.add(member.index)
                    continue
                yield _aborted(last, params)
                return
            finally:
                fleet.router.finished(request_id)
                if not finished and stream is not None:  # the consumer went away: the replica aborts the request
                    with contextlib.suppress(Exception):
                        ray.cancel(stream)

    # ---- sessions: answered by the replica the session id routes to ----------------------------------------

    async def _session_call(self, method: str, session_id: str) -> object:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"a session id must be a non-empty string, got {session_id!r}")
        try:
            index = self.fleet.router.pick(self.fleet.routable(), session_id)
        except RuntimeError as err:
            raise EngineUnavailable(str(err)) from None
        return await asyncio.wait_for(getattr(self.fleet.members[index].actor, method).remote(session_id), timeout=30)

    async def open_session(self, session_id: str) -> None:
        """Opens the session on the replica its id routes to (where its requests go)."""
        await self._session_call("open_session", session_id)

    async def close_session(self, session_id: str) -> SessionFigures | None:
        return cast("SessionFigures | None", await self._session_call("close_session", session_id))

    async def session_stats(self, session_id: str) -> SessionFigures | None:
        return cast("SessionFigures | None", await self._session_call("session_stats", session_id))

    async def abort(self, request_id: str) -> None:
        """Ends a request now with finish_reason 'abort'; its stream receives the final output."""
        await self.abort_requests([request_id])

    async def abort_requests(self, request_ids: list[str] | None = None, prefix: str | None = None) -> list[str]:
        """Group abort on every replica holding one of the requests (as `AsyncLLMEngine.abort_requests`, one call
        per replica, concurrently); returns the ids aborted."""
        wanted = set(request_ids or ())
        chosen = [
            r
            for r in self.fleet.router.in_flight()
            if (request_ids is None and prefix is None) or r in wanted or (prefix is not None and r.startswith(prefix))
        ]
        by_replica: dict[int, list[str]] = {}
        for request_id in chosen:
            index = self.fleet.router.replica_of(request_id)
            if index is not None:
                by_replica.setdefault(index, []).append(request_id)

        async def one(index: int, ids: list[str]) -> list[str]:
            with contextlib.suppress(Exception):  # a replica that is gone took its requests with it
                return cast(
                    list[str],
                    await asyncio.wait_for(self.fleet.members[index].actor.abort_requests.remote(ids), timeout=30),
                )
            return []

        done = await asyncio.gather(*(one(i, ids) for i, ids in by_replica.items()))
        return [r for ids in done for r in ids]

    # The fleet's verbs block (they wait on every replica): each runs in a worker thread.
    check_liveness = _in_thread(Fleet.check_liveness)
    pause_generation = _in_thread(Fleet.pause_generation)
    resume_generation = _in_thread(Fleet.resume_generation)
    sleep = _in_thread(Fleet.sleep)
    wake_up = _in_thread(Fleet.wake_up)
    reset_prefix_cache = _in_thread(Fleet.reset_prefix_cache)
    update_config = _in_thread(Fleet.update_config)
    reload_weights = _in_thread(Fleet.reload_weights)
    init_weight_transfer_engine = _in_thread(Fleet.init_weight_transfer_engine)
    start_weight_update = _in_thread(Fleet.start_weight_update)
    update_weights = _in_thread(Fleet.update_weights)
    finish_weight_update = _in_thread(Fleet.finish_weight_update)
    abort_weight_update = _in_thread(Fleet.abort_weight_update)
    set_change_version = _in_thread(Fleet.set_change_version)
    shutdown_weight_transfer_engine = _in_thread(Fleet.shutdown_weight_transfer_engine)
    update_weight_version = _in_thread(Fleet.update_weight_version)
    load_lora_adapter = _in_thread(Fleet.load_lora_adapter)
    unload_lora_adapter = _in_thread(Fleet.unload_lora_adapter)
    list_loras = _in_thread(Fleet.list_loras)
    collective_rpc = _in_thread(Fleet.collective_rpc)
    add_replicas = _in_thread(Fleet.add_replicas)
    remove_replicas = _in_thread(Fleet.remove_replicas)
    shutdown = _in_thread(Fleet.shutdown)

    async def is_paused(self) -> bool:
        return self.fleet.is_paused()

    async def get_weight_version(self, target: str = "model") -> int:
        return self.fleet.get_weight_version(target)


def _aborted(last: RequestOutput, params: SamplingParams) -> RequestOutput:
    """The final output of a request whose replica died: unfinished completions end with 'abort' (a delta
    carries no new tokens; version spans still cover the whole output)."""
    outputs = []
    for c in last.outputs:
        c = dataclasses.replace(c, finish_reason=c.finish_reason or "abort")
        if params.output_kind == "delta":
            c = dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None)
        outputs.append(c)
    return dataclasses.replace(last, outputs=outputs, finished=True)


def _implements_engine_client(fleet: AsyncFleet, engine: AsyncLLMEngine) -> tuple[EngineClient, EngineClient]:
    """Never called: mypy checks here that both front ends implement `EngineClient`."""
    return fleet, engine
