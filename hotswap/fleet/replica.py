"""One replica of a fleet: the body of its Ray actor.

The actor is asynchronous: its event loop runs an `AsyncLLMEngine` (whose steps and weight transfers run in
threads), so `status()` answers while a step or an update is under way. The fleet calls only the methods below;
each weight method is one phase of a fleet-wide change (see `hotswap.fleet.fleet`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any, cast

from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams


class ReplicaServer:
    """An engine replica. Constructed inside its actor, it loads the model from `model` with `engine_kwargs`
    (the `LLM` keyword arguments, tensor_parallel_size included: worker processes are this actor's children, in
    its placement group's resources)."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any], index: int) -> None:
        self.index = index
        self.engine = AsyncLLMEngine.from_kwargs(model, **engine_kwargs)
        self.served = 0

    async def status(self) -> dict[str, Any]:
        """What the fleet routes and reports by; answers at once (no engine lock)."""
        e = self.engine.engine
        return {
            "index": self.index,
            "pid": os.getpid(),
            "weight_version": e.weight_version,
            "weight_version_label": e.weight_version_label,
            "draft_weight_version": e.draft_weight_version,
            "draft_stale": e.draft_stale,
            "state": e.state.value,
            "paused": e.is_paused(),
            "asleep": e.is_asleep(),
            "refusing": e.refusing_new_requests(),
            "pause_mode": e.pause_mode,
            "requests": len(e.requests),
            "health_problem": e.health_problem(),
            "workers_problem": e.executor.health_problem(),  # a dead worker process
            "stats": e.stats(),
            "served": self.served,
        }

    # ---- requests -----------------------------------------------------------------------------------------

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs (called with num_returns="streaming"; cancelling the call aborts it)."""
        self.served += 1
        async for out in self.engine.generate(prompt, params, request_id):
            yield out

    async def generate_batch(self, prompts: list[Any], params: list[SamplingParams], request_ids: list[str]
                             ) -> list[RequestOutput]:
        """Generates every prompt concurrently and returns their final outputs, in order."""

        async def one(prompt: Any, sp: SamplingParams, request_id: str) -> RequestOutput:
            last = None
            async for out in self.engine.generate(prompt, dataclasses.replace(sp, output_kind="final_only"),
                                                  request_id):
                last = out
            assert last is not None and last.finished
            return last

        self.served += len(prompts)
        return list(await asyncio.gather(*(one(*args) for args in zip(prompts, params, request_ids, strict=True))))

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    # ---- pause, memory, config ------------------------------------------------------------------------------

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        await self.engine.pause_generation(mode, clear_cache)

    async def resume_generation(self) -> None:
        await self.engine.resume_generation()

    async def sleep(self, level: int) -> None:
        await self.engine.sleep(level)

    async def wake_up(self, tags: list[str] | None) -> None:
        await self.engine.wake_up(tags)

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def update_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        await self.engine.update_config(overrides)

    async def collective_rpc(self, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[Any]:
        return await self.engine.collective_rpc(method, args, kwargs)

    # ---- the phases of a fleet-wide weight change -------------------------------------------------------------

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self.engine.init_weight_transfer_engine(init_info)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.engine.shutdown_weight_transfer_engine()

    async def start_weight_update(self, target: str) -> str:
        return await self.engine.start_weight_update(target)

    async def update_weights(self, update_info: Any) -> None:
        await self.engine.update_weights(update_info)

    async def prepare_weight_update(self) -> None:
        await self.engine.prepare_weight_update()

    async def prepare_reload(self, weights_path: str | None, weights_iterator: Any) -> None:
        await self.engine.prepare_reload(weights_path, weights_iterator)

    async def commit_weight_update(self, weight_version: int, label: str | None = None) -> tuple[int, int]:
        """Commits the prepared change as `weight_version` (labelled `label`); returns the (model, draft) versions
        it left (a draft-only session leaves the model's)."""
        await self.engine.commit_weight_update(weight_version, label)
        return self.engine.engine.weight_version, self.engine.engine.draft_weight_version

    async def abort_weight_update(self) -> None:
        await self.engine.abort_weight_update()

    async def interrupt_transfer(self) -> None:
        """Makes a transport wait (for a trainer that stopped sending) give up now; answers at once."""
        self.engine.engine.executor.interrupt_waits()

    async def set_weight_version(self, weight_version: int, draft_weight_version: int,
                                 labels: dict[int, str] | None = None) -> None:
        """Numbers the served weights (a restarted replica that loaded the folder holding the fleet's version),
        with the fleet's version labels."""
        self.engine.engine.weights.set_versions(weight_version, draft_weight_version, labels or {})

    async def update_weight_version(self, new_version: int | str, abort_all_requests: bool) -> str:
        return await self.engine.update_weight_version(new_version, abort_all_requests)

    async def export_weights(self) -> list[dict[str, Any]]:
        return await self.engine.export_weights()

    async def adopt_weights(self, states: list[dict[str, Any]], weight_version: int, draft_weight_version: int,
                            labels: dict[int, str] | None = None) -> None:
        await self.engine.adopt_weights(states, weight_version, draft_weight_version)
        self.engine.engine.weights.labels.update(labels or {})

    async def weight_checksums(self, target: str) -> dict[str, str]:
        return cast("dict[str, str]", (await self.engine.collective_rpc("weight_checksums", (target,)))[0])

    async def shutdown(self) -> None:
        await self.engine.shutdown()
        self.engine.engine.shutdown()
