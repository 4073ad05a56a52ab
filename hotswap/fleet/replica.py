"""One replica of a fleet: the body of its Ray actor.

The actor is an `AsyncLLMEngine` (its event loop steps the engine and runs weight transfers in threads, so
`status()` answers while a step or an update is under way): the fleet calls the engine's own verbs on it
(pause/resume, sleep/wake, config, the transfer session, prepare/abort of a two-phase change, collective_rpc) and
the few methods below, which only a replica has. Each weight method is one phase of a fleet-wide change (see
`hotswap.fleet.changes`; an adapter's reload is a `prepare_reload` with target "lora:<name>", as the model's); a
LoRA adapter is loaded the same way (prepare on every replica, then commit or abort; the engine's registry holds
the prepared load),
and a restarted replica copies a live one's adapters (`export_loras` / `adopt_loras`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any, cast

import torch

from hotswap.config import EngineConfig
from hotswap.engine.async_llm_engine import AsyncLLMEngine, engine_status
from hotswap.engine.client import EngineStatus
from hotswap.engine.llm_engine import LLMEngine
from hotswap.inputs import PromptType
from hotswap.lora.adapter import LoRAFactor
from hotswap.lora.peft_format import LoRASpec
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ReplicaStatus(EngineStatus):
    """A replica's `EngineStatus` (its open change left out), with what the fleet tracks it by: its index, its
    process, its engine state, a dead worker process (`workers_problem`; invalid weights are no reason to restart
    it) and the requests it was given."""

    index: int = 0
    pid: int = 0
    state: str = ""
    workers_problem: str | None = None
    served: int = 0

    def report(self) -> dict[str, object]:
        """The replica's last health report as `/fleet_status` answers it."""
        return {
            "index": self.index,
            "pid": self.pid,
            "weight_version": self.weight_version,
            "weight_version_label": self.weight_version_label,
            "draft_weight_version": self.draft_weight_version,
            "draft_stale": self.draft_stale,
            "state": self.state,
            "paused": self.paused,
            "asleep": self.asleep,
            "refusing": self.refusing_new_requests,
            "pause_mode": self.pause_mode,
            "requests": self.requests,
            "health_problem": self.health_problem,
            "workers_problem": self.workers_problem,
            "stats": dict(self.stats),
            "served": self.served,
        }


class ReplicaServer(AsyncLLMEngine):
    """An engine replica. Constructed inside its actor, it loads the model from `model` with `engine_kwargs`
    (the `LLM` keyword arguments, tensor_parallel_size included: worker processes are this actor's children, in
    its placement group's resources)."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any], index: int) -> None:
        super().__init__(EngineConfig.from_kwargs(model, **engine_kwargs))
        self.index = index
        self.served = 0

    def status(self) -> ReplicaStatus:
        """What the fleet routes and reports by; answers at once (no engine lock). The open change stays here
        (the fleet keeps its own)."""
        e = self.engine
        now = engine_status(e)
        return ReplicaStatus(
            **{f.name: getattr(now, f.name) for f in dataclasses.fields(EngineStatus) if f.name != "change"},
            index=self.index,
            pid=os.getpid(),
            state=e.state.value,
            workers_problem=e.executor.health_problem(),
            served=self.served,
        )

    # ---- requests -----------------------------------------------------------------------------------------

    async def stream(
        self, prompt: PromptType, params: SamplingParams, request_id: str, lora_request: LoRARequest | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs (called with num_returns="streaming"; cancelling the call aborts it)."""
        self.served += 1
        async for out in self.generate(prompt, params, request_id, lora_request=lora_request):
            yield out

    async def generate_batch(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        request_ids: list[str],
        lora_requests: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates every prompt concurrently (prompt k with adapter `lora_requests[k]`, if given) and returns
        their final outputs, in order."""

        async def one(
            prompt: PromptType, sp: SamplingParams, request_id: str, lora: LoRARequest | None
        ) -> RequestOutput:
            last = None
            async for out in self.generate(
                prompt, dataclasses.replace(sp, output_kind="final_only"), request_id, lora_request=lora
            ):
                last = out
            assert last is not None and last.finished
            return last

        loras = lora_requests if lora_requests is not None else [None] * len(prompts)
        self.served += len(prompts)
        return list(
            await asyncio.gather(*(one(*args) for args in zip(prompts, params, request_ids, loras, strict=True)))
        )

    # ---- what only a replica of a fleet does ----------------------------------------------------------------

    async def commit(self, weight_version: int | None, label: str | None = None) -> tuple[int, int, str]:
        """Commits the prepared change as `weight_version` (labelled `label`; None: an adapter's change, which
        takes no version); returns the (model, draft) versions it left (a draft-only session leaves the model's)
        and the model version's label."""
        await self.commit_weight_update(weight_version, label)
        return self.engine.weight_version, self.engine.draft_weight_version, self.engine.weight_version_label

    async def interrupt_transfer(self) -> None:
        """Makes a transport wait (for a trainer that stopped sending) give up now; answers at once."""
        self.engine.executor.interrupt_waits()

    async def set_weight_version(
        self, weight_version: int, draft_weight_version: int, labels: dict[int, str] | None = None
    ) -> None:
        """Numbers the served weights (a restarted replica that loaded the folder holding the fleet's version),
        with the fleet's version labels."""
        self.engine.weights.set_versions(weight_version, draft_weight_version, labels or {})

    async def adopt_weights(
        self,
        states: list[dict[str, torch.Tensor]],
        weight_version: int,
        draft_weight_version: int | None = None,
        labels: dict[int, str] | None = None,
    ) -> None:
        """As `AsyncLLMEngine.adopt_weights`, with the fleet's version labels."""
        await super().adopt_weights(states, weight_version, draft_weight_version)
        self.engine.weights.labels.update(labels or {})

    # ---- LoRA adapters: two-phase loads, copies for a restarted replica ----------------------------------------

    async def prepare_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        load_inplace: bool = False,
        tensors: dict[str, torch.Tensor] | None = None,
        peft_config: dict[str, Any] | None = None,
        lora_int_id: int | None = None,
        pinned: bool = False,
    ) -> int:
        """Phase one of a fleet-wide `load_lora_adapter` (as `LLM.prepare_lora_adapter`): the new version is on
        every worker, nothing served changes until `commit_lora_adapter` (or `abort_lora_adapter`). Returns the
        adapter's integer id. Raises ValueError as a load does; nothing is held then."""
        registry = self._registry()

        def prepare() -> int:
            return registry.hold(
                registry.prepare(lora_name, lora_path, tensors, peft_config, lora_int_id, load_inplace, pinned)
            ).int_id

        return await self._locked(prepare)

    async def commit_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Phase two: the prepared version of `lora_name` is served from now on; returns its description."""
        registry = self._registry()
        return await self._locked(lambda: registry.description(registry.commit_held(lora_name).name))

    async def abort_lora_adapter(self, lora_name: str) -> bool:
        """Drops a prepared load of `lora_name` from every worker; False if none was prepared."""
        registry = self._registry()
        return await self._locked(registry.abort_held, lora_name)

    async def export_loras(self) -> list[dict[str, Any]]:
        """Every adapter this replica serves, whole (`lora_exports`)."""
        return await self._locked(lora_exports, self.engine)

    async def adopt_loras(self, adapters: list[dict[str, Any]]) -> None:
        """Loads adapters as `export_loras` describes them (`adopt_lora_exports`): a restarted replica takes the
        fleet's adapters before it is routed to. Raises ValueError for one it cannot load."""
        self._registry()  # raises without LoRA
        await self._locked(adopt_lora_exports, self.engine, adapters)

    async def weight_checksums(self, target: str) -> dict[str, str]:
        return cast("dict[str, str]", (await self.collective_rpc("weight_checksums", (target,)))[0])

    async def shutdown(self) -> None:
        """Ends the requests in flight, then stops the workers."""
        await super().shutdown()
        self.engine.shutdown()


def lora_exports(engine: LLMEngine) -> list[dict[str, Any]]:
    """Every adapter `engine` serves (its current version), whole: name, int id, version, path, pinned, its config
    and its full tensors by PEFT name (each rank's part put back in place): what `adopt_lora_exports` on an engine
    with the same config takes. Runs between steps (under the engine lock of an `AsyncLLMEngine`)."""
    registry = engine.loras
    if registry is None:
        return []
    out = []
    for adapter in registry.adapters.values():
        ranks = engine.executor.collective_rpc(_lora_state, (adapter.current.uid,))
        out.append(
            {
                "lora_name": adapter.name,
                "lora_int_id": adapter.int_id,
                "version": adapter.current.version,
                "lora_path": adapter.path,
                "pinned": adapter.pinned,
                "peft_config": _peft_config(adapter.spec),
                "tensors": _whole(ranks),
            }
        )
    return out


def adopt_lora_exports(engine: LLMEngine, adapters: list[dict[str, Any]]) -> None:
    """Loads adapters as `lora_exports` describes them (an entry without "tensors" is read from its "lora_path"),
    each at its "version". Runs between steps. Raises ValueError for one it cannot load (or without LoRA)."""
    registry = engine.loras
    if registry is None:
        raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True")
    for entry in adapters:
        tensors = entry.get("tensors")
        path = entry.get("lora_path")
        prepared = registry.prepare(
            entry["lora_name"],
            None if tensors is not None else path,
            tensors,
            entry.get("peft_config"),
            entry["lora_int_id"],
            False,
            bool(entry.get("pinned", False)),
        )
        adapter = registry.commit_prepared(dataclasses.replace(prepared, path=path))
        adapter.current.version = int(entry.get("version", 1))  # its version numbers are the source's


def _lora_state(worker: Any, uid: int) -> dict[str, tuple[torch.Tensor, list[tuple[int, int, int]], tuple[int, ...]]]:
    """Runs on a worker: adapter version `uid`'s factors on this rank, by PEFT name, each with the narrowings that
    cut it out of the full tensor and the full shape (host copies)."""
    adapter = worker.loras.get(uid)
    return {
        f"{name}.weight": (module.weight.detach().to("cpu", copy=True), list(module.plan), tuple(module.full_shape))
        for name, module in adapter.named_modules()
        if isinstance(module, LoRAFactor)
    }


def _whole(
    ranks: list[dict[str, tuple[torch.Tensor, list[tuple[int, int, int]], tuple[int, ...]]]],
) -> dict[str, torch.Tensor]:
    """The full tensors of an adapter from every rank's parts (`_lora_state`, rank order)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, (part, plan, shape) in ranks[0].items():
        if not plan:  # every rank holds it whole
            tensors[name] = part
            continue
        full = torch.zeros(shape, dtype=part.dtype)
        for state in ranks:
            piece, cuts, _ = state[name]
            view = full
            for dim, start, length in cuts:
                view = view.narrow(dim, start, length)
            view.copy_(piece)
        tensors[name] = full
    return tensors


def _peft_config(spec: LoRASpec) -> dict[str, Any]:
    """adapter_config.json's fields for `spec` (its modules follow from the tensors' names)."""
    return {"peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha, "use_rslora": spec.use_rslora}
