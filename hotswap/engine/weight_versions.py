"""The weight versions of an engine and the copies of its weights a fleet's restarted replica takes: the integer
that orders versions, the labels clients gave them, the version the speculative draft was last updated for, and
the checks a delta's base version meets. `WeightsController` (hotswap/engine/weights_controller.py) is one."""

from __future__ import annotations

from typing import Protocol

import torch

from hotswap.config import EngineConfig, apply_overrides, live_overrides
from hotswap.engine.block_manager import BlockManager
from hotswap.engine.change import ModelTarget
from hotswap.engine.lora_updates import LoRAUpdates
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.sequence import Request
from hotswap.engine.state import EngineState
from hotswap.executor.base import Executor
from hotswap.weights.version import VersionArg, VersionLabels, parse_version
from hotswap.worker.commands import ReadState


class EngineHooks(Protocol):
    """What the controller reads and moves of its engine (`LLMEngine` has it): the workers, the config, the
    scheduler and KV cache it must leave consistent, and the engine state machine."""

    executor: Executor
    config: EngineConfig
    scheduler: Scheduler
    block_manager: BlockManager
    requests: dict[str, Request]
    lora_updates: LoRAUpdates | None  # the adapters' changes (None without enable_lora)

    @property
    def released(self) -> set[str]: ...  # while ASLEEP: what sleep() released; read only (the lifecycle moves it)

    @property
    def state(self) -> EngineState: ...  # read only: moved by enter_state / leave_state

    def reset_prefix_cache(self, force: bool = False) -> None: ...

    def serving_state(self) -> EngineState: ...

    def enter_state(self, state: EngineState) -> None: ...

    def leave_state(self, state: EngineState) -> None: ...

    def is_asleep(self) -> bool: ...

    def score_probes(self, probes: list[list[int]]) -> list[list[float]]: ...


class WeightVersions:
    """The versions half of `WeightsController` (its base class): what it reads of the controller is declared."""

    engine: EngineHooks
    executor: Executor
    config: EngineConfig
    version: int
    labels: VersionLabels
    draft_version: int
    valid: bool

    @property
    def draft_stale(self) -> bool:
        """Whether the target was updated after the draft model (never, without one)."""
        return self.config.speculative_config.uses_draft and self.draft_version != self.version

    def _versions_after_commit(self, target: ModelTarget, weight_version: VersionArg, label: str | None) -> None:
        """Advances the versions of what the committed session wrote (the model's, and the draft's)."""
        parts = (
            {target.name}
            if target.name != "all"
            else (set(self.executor.send(ReadState())[0].updated_parts) or {"model"})
        )
        if "model" in parts:
            self._advance_version(weight_version, label)
        if "draft" in parts:
            self.draft_version = self.version

    def check_can_change(self, method: str) -> None:
        raise NotImplementedError

    def weights_changed(self, failed: bool = False) -> None:
        raise NotImplementedError

    def check_base(self, base_version: VersionArg) -> None:
        """Raises ValueError when a delta declares a base version other than the served one (a delta applies only
        on top of the weights it was computed against). None: no check."""
        if base_version is None:
            return
        number, _ = parse_version(base_version, "base_version")
        current = self.current_label
        if str(base_version) != current and number != self.version:  # the served label, or its integer
            raise ValueError(
                f"this delta applies on top of version {str(base_version)!r}, but the engine serves "
                f"version {current!r} (version id {self.version}); send a full update, or a delta "
                f"against {current!r}"
            )

    def _record_model_folder(self, folder: str) -> None:
        change = {"model_config": {"model": folder}}
        if self.config.parallel_config.tensor_parallel_size > 1:
            self.executor.collective_rpc("update_config", (change,))
        apply_overrides(self.config, live_overrides(self.config, change))

    # ---- copying weights between engines of the same config (a fleet's restarted replica) --------------------

    def export_weights(self) -> list[dict[str, torch.Tensor]]:
        """Copies of every worker's parameters and persistent buffers (the draft's prefixed "draft."), in rank
        order: what `adopt_weights` of an engine with the same config takes. Raises RuntimeError while the weights
        are invalid or released (a failed update, sleep(2))."""
        if not self.valid or "weights" in self.engine.released:
            raise RuntimeError("the weights are invalid or released; there is nothing to export")
        return self.executor.collective_rpc("export_state")

    def adopt_weights(
        self, states: list[dict[str, torch.Tensor]], weight_version: int, draft_weight_version: int | None = None
    ) -> None:
        """Copies weights exported by an engine with the same config into this one's storage (no parameter is
        rebound) and serves them as `weight_version` (the draft's as `draft_weight_version`, default the same).
        Raises ValueError, changing nothing, when the ranks, names, shapes or dtypes differ."""
        self.check_can_change("adopt_weights")
        if not isinstance(weight_version, int) or isinstance(weight_version, bool) or weight_version < 0:
            raise ValueError(f"adopt_weights takes an integer weight_version >= 0, got {weight_version!r}")
        if self.engine.state is EngineState.UPDATING:
            raise RuntimeError("adopt_weights() while a weight update is open; finish or abort it first")
        if len(states) != self.config.parallel_config.tensor_parallel_size:
            raise ValueError(
                f"got the weights of {len(states)} ranks for {self.config.parallel_config.tensor_parallel_size}"
            )
        ok = False
        try:
            self.executor.collective_rpc("import_state", (states,))
            ok = True
        finally:
            self.weights_changed(failed=not ok)
        self.version = weight_version
        self.draft_version = weight_version if draft_weight_version is None else draft_weight_version

    def _advance_version(self, weight_version: VersionArg, label: str | None = None) -> None:
        """The committed change's version: `weight_version`'s integer (else the next), labelled by `label`, else
        by `weight_version`'s label (else unlabelled)."""
        number, given = parse_version(weight_version)
        self.version = self.version + 1 if number is None else number
        self.labels.set(self.version, label if label is not None else given)

    @property
    def current_label(self) -> str:
        """The served version as clients see it: the label given to it, or its integer as a string."""
        return self.labels.label(self.version)

    def rename(self, label: VersionArg) -> str:
        """Renames the served version (weights, requests and the integer untouched): `label` is a string label,
        or an integer shown as itself. Returns the new label. Raises ValueError for an invalid label."""
        if label is None:
            raise ValueError("new_version must be a non-empty label")
        parse_version(label, "new_version")
        self.labels.set(self.version, str(label))
        return self.current_label

    def set_versions(self, version: int, draft_version: int, labels: dict[int, str]) -> None:
        """Numbers the served weights as another engine's (a fleet's restarted replica that loaded the folder
        holding the fleet's version), with that fleet's labels."""
        self.version, self.draft_version = version, draft_version
        self.labels.update(labels)
