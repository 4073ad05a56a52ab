"""One replica of a fleet: the body of its Ray actor.

The actor is an `AsyncLLMEngine` (its event loop steps the engine and runs weight transfers in threads, so
`status()` answers while a step or an update is under way): the fleet calls the engine's own verbs on it
(pause/resume, sleep/wake, config, the transfer session, prepare/abort of a two-phase change, collective_rpc) and
the few methods below, which only a replica has. Each weight method is one phase of a fleet-wide change (see
`hotswap.fleet.fleet`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any, cast

from hotswap.config import EngineConfig
from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams


class ReplicaServer(AsyncLLMEngine):
    """An engine replica. Constructed inside its actor, it loads the model from `model` with `engine_kwargs`
    (the `LLM` keyword arguments, tensor_parallel_size included: worker processes are this actor's children, in
    its placement group's resources)."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any], index: int) -> None:
        super().__init__(EngineConfig.from_kwargs(model, **engine_kwargs))
        self.index = index
        self.served = 0

    async def status(self) -> dict[str, Any]:
        """What the fleet routes and reports by; answers at once (no engine lock)."""
        e = self.engine
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

    async def stream(self, prompt: Any, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs (called with num_returns="streaming"; cancelling the call aborts it)."""
        self.served += 1
        async for out in self.generate(prompt, params, request_id):
            yield out

    async def generate_batch(self, prompts: list[Any], params: list[SamplingParams], request_ids: list[str]
                             ) -> list[RequestOutput]:
        """Generates every prompt concurrently and returns their final outputs, in order."""

        async def one(prompt: Any, sp: SamplingParams, request_id: str) -> RequestOutput:
            last = None
            async for out in self.generate(prompt, dataclasses.replace(sp, output_kind="final_only"), request_id):
                last = out
            assert last is not None and last.finished
            return last

        self.served += len(prompts)
        return list(await asyncio.gather(*(one(*args) for args in zip(prompts, params, request_ids, strict=True))))

    # ---- what only a replica of a fleet does ----------------------------------------------------------------

    async def commit(self, weight_version: int, label: str | None = None) -> tuple[int, int, str]:
        """Commits the prepared change as `weight_version` (labelled `label`); returns the (model, draft) versions
        it left (a draft-only session leaves the model's) and the model version's label."""
        await self.commit_weight_update(weight_version, label)
        return self.engine.weight_version, self.engine.draft_weight_version, self.engine.weight_version_label

    async def interrupt_transfer(self) -> None:
        """Makes a transport wait (for a trainer that stopped sending) give up now; answers at once."""
        self.engine.executor.interrupt_waits()

    async def set_weight_version(self, weight_version: int, draft_weight_version: int,
                                 labels: dict[int, str] | None = None) -> None:
        """Numbers the served weights (a restarted replica that loaded the folder holding the fleet's version),
        with the fleet's version labels."""
        self.engine.weights.set_versions(weight_version, draft_weight_version, labels or {})

    async def adopt_weights(self, states: list[dict[str, Any]], weight_version: int,
                            draft_weight_version: int | None = None, labels: dict[int, str] | None = None) -> None:
        """As `AsyncLLMEngine.adopt_weights`, with the fleet's version labels."""
        await super().adopt_weights(states, weight_version, draft_weight_version)
        self.engine.weights.labels.update(labels or {})

    async def weight_checksums(self, target: str) -> dict[str, str]:
        return cast("dict[str, str]", (await self.collective_rpc("weight_checksums", (target,)))[0])

    async def shutdown(self) -> None:
        """Ends the requests in flight, then stops the workers."""
        await super().shutdown()
        self.engine.shutdown()
