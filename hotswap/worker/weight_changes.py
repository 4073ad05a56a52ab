"""A worker's weight changes: reloads, the transfer session and adapter versions, all through its `WeightSession`.

The engine sends them as commands (hotswap/worker/commands.py) that `apply` dispatches; the same verbs stay
Worker methods for `collective_rpc` by name. What a change writes is its `Part` (the model, the draft, both, or
an adapter's next version), kept by the session while the change is open: the verbs below never ask which kind
of part it is; the helpers beside them (`_index_of`, `_rename_of`, `_config_of`, `_transfer_config`,
`_opened_sliced`, `_committed`, `_ended`) do.
- `reload_weights(...)` and the transfer session update parameters in place (storage never rebound), validate
  before they mutate, and in atomic mode roll back bit for bit on any failure. With atomic off, a failed update
  leaves the worker refusing to execute until a successful full reload.
- An adapter's next version is a copy of its current one, written by the change and served only once the engine
  commits it everywhere: always atomic, and a failure or an abort drops it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hotswap.config import EngineConfig, WeightTransferConfig, live_overrides
from hotswap.distributed import ParallelContext
from hotswap.lora.manager import LoRAManager
from hotswap.lora.peft_format import canonical_name
from hotswap.weights.checksum import tensor_sha256
from hotswap.weights.delta import is_delta
from hotswap.weights.index import WeightIndex
from hotswap.weights.target import WeightTarget, check_target
from hotswap.weights.update import RankSelection, chunked_copies, folder_source, pairs_source, prefixer
from hotswap.worker.commands import (
    Abort,
    AdapterPart,
    AddAdapter,
    Advance,
    Command,
    Commit,
    InitTransport,
    Load,
    ModelPart,
    Part,
    ReadState,
    Receive,
    RecordFolder,
    RemoveAdapter,
    ShutdownTransport,
    StartUpdate,
    TransportReady,
    ViewStaged,
)
from hotswap.worker.offload import Offloaded
from hotswap.worker.scope import in_config_scope
from hotswap.worker.session import Rename, SessionState, WeightSession

DRAFT_PREFIX = "draft."  # the draft model's checkpoint names, where one update carries both models


@dataclasses.dataclass(frozen=True)
class WeightState:
    """What the engine asks a worker after a weight change."""

    valid: bool  # False after a failed non-atomic update or sleep(2), until a full update or reload
    updated_parts: list[str]  # "model" / "draft" / "lora": what the last committed update wrote


class WeightChanges:
    """The weight-change half of `Worker` (a base class of it): what it reads of the worker is declared here."""

    config: EngineConfig
    parallel: ParallelContext
    session: WeightSession
    model: nn.Module | None
    draft_model: nn.Module | None
    draft_config: EngineConfig | None
    loras: LoRAManager | None
    offloaded: Offloaded | None
    last_update_parts: list[str]
    _draft_scope: Callable[[], contextlib.AbstractContextManager[None]]

    @in_config_scope
    def apply(self, command: Command) -> object:
        """Runs one weight-change command (hotswap/worker/commands.py): the engine's one door to a worker's
        weights. Returns what the verb it stands for returns."""
        match command:
            case InitTransport(init_info):
                self.init_weight_transfer_engine(init_info)
                return None
            case TransportReady():
                return self.weight_transfer_ready()
            case ShutdownTransport():
                self.shutdown_weight_transfer_engine()
                return None
            case StartUpdate(part):
                self._start(part)
                return None
            case Receive(update_info, sliced):
                return self.update_weights(update_info, sliced)
            case Load():
                return self._load(command)
            case Advance(budget_s):
                return self.advance_weight_update(budget_s)
            case ViewStaged(on):
                self.view_staged(on)
                return None
            case Commit(prepare_only):
                return self.finish_weight_update(commit=not prepare_only)
            case Abort():
                return self.abort_weight_update()
            case AddAdapter(uid, spec, tensors):
                self.add_lora(uid, spec, tensors)
                return None
            case RemoveAdapter(uid):
                return self.remove_lora(uid)
            case RecordFolder(folder, target):
                self.record_folder(folder, target)
                return None
            case ReadState():
                return self.weight_state()
        raise TypeError(f"not a worker command: {command!r}")

    # ---- reloads --------------------------------------------------------------------------------------------

    @in_config_scope
    def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        commit: bool = True,
        target: str = "model",
        encoding: str | None = None,
        checksums: dict[str, str] | None = None,
        sliced: bool = False,
    ) -> int:
        """Updates the weights in place from a checkpoint folder (`weights_path`, recorded as the model folder on
        success), from (name, tensor) pairs (`weights_iterator`, may be partial), or with neither from the
        current folder. Returns the number of tensors loaded. Validates before mutating; see the module doc for
        failure behaviour. `commit` False keeps the update open with its rollback copies until
        `finish_weight_update()` or `abort_weight_update()` (how the engine makes worker processes change
        together), and leaves recording a new folder to the caller. `target` "draft" reloads the speculative draft
        model instead (its own checkpoint names, in its config scope). `encoding` / `checksums`: the tensors are a
        delta, and the trainer's digests of the results (hotswap/weights/delta.py). `sliced` (a staged engine,
        `commit` False): the reload is only opened; `advance_weight_update` receives it."""
        part = ModelPart(check_target(target, ("model", "draft"), "reload_weights target"))
        pairs = None if weights_iterator is None else list(weights_iterator)
        return self._load(Load(part, weights_path, pairs, encoding, checksums, commit, sliced))

    def _load(self, load: Load) -> int:
        """A reload of `load.part` (see `reload_weights`; an adapter's next version from pairs)."""
        self.session.expect(SessionState.NO_ENGINE, SessionState.READY, call="reload_weights")
        part = load.part
        if isinstance(part, ModelPart):  # an adapter stays on the device while the model sleeps
            self._check_awake("reload_weights")
        if load.weights_path is not None and load.weights_iterator is not None:
            raise ValueError("give weights_path or weights_iterator, not both")
        delta = is_delta(load.encoding)
        if load.weights_iterator is not None:
            source = pairs_source(load.weights_iterator)
        elif delta:  # a folder of delta tensors: no config of its own, never the model's folder
            if load.weights_path is None:
                raise ValueError(
                    f"encoding {load.encoding!r} needs the delta's tensors (weights_path or weights_iterator)"
                )
            source = folder_source(str(load.weights_path), complete=False)
        else:
            config = self._config_of(part)
            if load.weights_path is not None:
                live_overrides(config, {"model_config": {"model": str(load.weights_path)}})  # same model shape
            source = folder_source(str(load.weights_path or config.model_config.model))
        wt = self._transfer_config(part)
        try:
            update = self.session.load(
                self._index_of(part, fill=not load.sliced),  # sliced: an adapter's copy is the first slices
                source,
                wt.atomic,
                wt.check_finite,
                commit=load.commit,
                encoding={"encoding": load.encoding, "checksums": load.checksums},
                rename=self._rename_of(part),
                staged=wt.update_staging == "shadow" and isinstance(part, ModelPart),
                sliced=load.sliced,
                backup_device=wt.backup_device if isinstance(part, ModelPart) else "cpu",
                part=part,
            )
            if load.sliced:
                self._opened_sliced(part)
            if load.commit:
                self._committed(part, True)
        finally:
            self._ended()
        folder = load.weights_path
        if folder is not None and load.commit and not delta and isinstance(part, ModelPart):
            self._record_folder(str(folder), part.name)  # uncommitted: the engine records it once committed
        return len(update.loaded_names)

    def _record_folder(self, folder: str, target: str = "model") -> None:
        """Records `folder` as the checkpoint of the target model or the draft (after a committed reload)."""
        if target == "draft":
            assert self.draft_config is not None
            self.draft_config.model_config.model = folder
            self.config.speculative_config.model = folder
        else:
            self.config.model_config.model = folder

    @in_config_scope
    def record_folder(self, folder: str, target: str = "model") -> None:
        """Records `folder` as the checkpoint of the model or (target "draft") the draft, once every rank
        committed a reload from it."""
        self._record_folder(folder, target)

    # ---- the weight-transfer session --------------------------------------------------------------------------

    @in_config_scope
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Creates the receiving engine of `init_info["backend"]` (tensors, shm, torch_dist, disk). Returns without
        waiting for a trainer to connect: poll `weight_transfer_ready()`."""
        self.session.init_engine(init_info, self.config.weight_transfer_config)

    @in_config_scope
    def weight_transfer_ready(self) -> bool:
        """Whether the transfer engine has connected to its trainer; raises (and drops the engine) if connecting
        failed or timed out."""
        return self.session.engine_ready()

    @in_config_scope
    def start_weight_update(self, target: str = "model") -> None:
        """Opens an update session; in atomic mode, everything overwritten until finish is kept for rollback.
        `target`: "model" (the served model), "draft" (the speculative draft) or "all" (both, committed or rolled
        back together; draft tensors are named "draft.<name>" or sent in update calls with "target": "draft")."""
        self._start(ModelPart(check_target(target)))

    def _start(self, part: Part) -> None:
        if isinstance(part, ModelPart):  # an adapter stays on the device while the model sleeps
            self._check_awake("start_weight_update")
        self.session.expect(SessionState.READY, call="start_weight_update")  # before anything changes here
        try:
            self.session.start(self._index_of(part), self._transfer_config(part), part)
        finally:
            self._ended()

    @in_config_scope
    def update_weights(self, update_info: dict[str, Any], sliced: bool = False) -> int:
        """Receives one update of the session: declaration validated first, then data copied in place (staged:
        into the staging copies). Any failure ends the session (rolled back in atomic mode) and re-raises. Returns
        tensors loaded. `sliced` (a staged session): only opens the receive; `advance_weight_update` runs it."""
        selection = RankSelection.from_update_info(update_info, self.parallel.rank, self.parallel.size)
        sent = update_info.get("target") if isinstance(update_info, dict) else None
        part = self.session.open_part()
        problem = None if part is None else _refused(part, sent)
        if problem is not None:
            self.session.abort()  # like any failed update, it ends the session (rolled back)
            self._ended()
            raise ValueError(f"{problem} (the session was rolled back)")
        try:
            with torch.no_grad():
                return self.session.receive(update_info, selection, self._rename_of(part or ModelPart(), sent), sliced)
        finally:
            self._ended()

    @in_config_scope
    def advance_weight_update(self, budget_s: float | None = None) -> int | None:
        """Receives the staged update opened with `sliced` for about `budget_s` seconds (None: to its end).
        Returns the tensors loaded once it ended, None while more remain. A failure ends the session (the served
        weights were never written) and re-raises."""
        try:
            with torch.no_grad():
                return self.session.advance(budget_s)
        finally:
            self._ended()

    @in_config_scope
    def view_staged(self, on: bool) -> None:
        """Serves the open staged update's weights (`on`), as a canary's probes must see them, or the committed
        ones again. No-op without a staged update."""
        update = self.session.update
        if update is None or update.shadow is None:
            return
        if on and not update.shadow.inside:
            update.shadow.swap_in()
        elif not on and update.shadow.inside:
            update.shadow.swap_out()

    @in_config_scope
    def finish_weight_update(self, commit: bool = True) -> int:
        """Completes post-processing of partially updated layers and closes the session; returns the number of
        tensor names updated in it. `commit` False post-processes but keeps the update open with its rollback
        copies, for a second call (commit) or `abort_weight_update()`."""
        part = self.session.part
        try:
            update = self.session.finish(commit)
            self._committed(part, commit)
        finally:
            self._ended()
        self.last_update_parts = _written(part, update.loaded_names)
        return len(update.loaded_names)

    @in_config_scope
    def abort_weight_update(self) -> bool:
        """Ends the open update, restoring the weights it changed (atomic mode; otherwise they become invalid).
        Returns False when no update was open (nothing to do)."""
        try:
            return self.session.abort()
        finally:
            self._ended()

    @in_config_scope
    def shutdown_weight_transfer_engine(self) -> None:
        """Aborts an active session, then releases the transfer engine (connections, shared buffers) and the
        rollback buffers."""
        try:
            self.session.shutdown_engine()
        finally:
            self._ended()
        self.session.release_backups()

    @in_config_scope
    def weight_state(self) -> WeightState:
        """Whether this rank's weights are valid, and which models the last committed update wrote."""
        return WeightState(self.session.is_valid(), list(self.last_update_parts))

    @in_config_scope
    def weight_checksums(self, target: str = "model") -> dict[str, str]:
        """SHA-256 per checkpoint tensor name, over the bytes the engine holds for it (a fused layer's slice),
        so a trainer can compare with `tensor_sha256` of what it sent, cast to the engine's dtype. fp8 layers
        report their quantized bytes. `target` "draft" / "all": the draft's tensors, named "draft.<name>"."""
        self._check_awake("weight_checksums")
        index = self._weight_index(check_target(target))
        return {name: tensor_sha256(index.targets[name].local_view()) for name in sorted(index.required)}

    # ---- LoRA adapters (hotswap/lora) --------------------------------------------------------------------------

    @in_config_scope
    def add_lora(self, uid: int, spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Loads adapter version `uid` of `spec` (LoRASpec.as_dict) from its full tensors by PEFT name. Raises
        ValueError naming a missing, unknown, mis-shaped or non-finite tensor (nothing is loaded then)."""
        source = pairs_source(((canonical_name(n), t) for n, t in tensors.items()), "LoRA adapter")
        self._loras().add(uid, spec, source, self.config.weight_transfer_config.check_finite)

    @in_config_scope
    def remove_lora(self, uid: int) -> bool:
        """Forgets adapter version `uid`; False if it was not loaded."""
        return self._loras().remove(uid)

    # ---- what a part means on this worker (the only places that tell the kinds apart) ------------------------

    def _index_of(self, part: Part, fill: bool = True) -> WeightIndex:
        """The index a change of `part` writes through. An adapter's next version is made first (pending until
        committed; `fill` False: not yet a copy of the current one, which the first slices make)."""
        if isinstance(part, AdapterPart):
            return self._loras().begin(part.old, part.new, fill=fill).weight_index()
        return self._weight_index(part.name)

    def _rename_of(self, part: Part, sent: object = None) -> Rename:
        """How the names a change of `part` receives map to its index's (`sent`: an update's own "target")."""
        if isinstance(part, AdapterPart):
            return canonical_name
        return prefixer(DRAFT_PREFIX) if part.name == "draft" or sent == "draft" else None

    def _transfer_config(self, part: Part) -> WeightTransferConfig:
        """An adapter's next version is written atomically whatever the config says (a failure drops it)."""
        wt = self.config.weight_transfer_config
        return dataclasses.replace(wt, atomic=True) if isinstance(part, AdapterPart) else wt

    def _config_of(self, part: Part) -> EngineConfig:
        if isinstance(part, ModelPart) and part.name == "draft":
            self._weight_index("draft")  # raises without a draft
            assert self.draft_config is not None
            return self.draft_config
        return self.config

    def _opened_sliced(self, part: Part) -> None:
        """A sliced load of an adapter's next version copies the current one in its first slices and builds its
        packs in its last ones, so that no slice between two steps holds a whole adapter's packs."""
        if isinstance(part, AdapterPart):
            loras = self._loras()
            self.session.chain_job(chunked_copies(loras.fill_pairs(part.old)), loras.pack_steps())

    def _committed(self, part: Part, commit: bool) -> None:
        """After `part`'s change committed (or, not `commit`, was prepared): an adapter's next version is
        registered (or has its packs built, so that the commit only registers it)."""
        if isinstance(part, AdapterPart) and self.loras is not None:
            if commit:
                self.loras.commit_pending()
            else:
                self.loras.prepare_pending()

    def _ended(self) -> None:
        """After any weight-change call: an adapter's next version whose change is no longer open is dropped (a
        failure, an abort; a commit registered it first)."""
        if self.loras is not None and not isinstance(self.session.open_part(), AdapterPart):
            self.loras.drop_pending()

    def _loras(self) -> LoRAManager:
        if self.loras is None:
            raise ValueError("LoRA adapters are not enabled; start the engine with enable_lora=True")
        return self.loras

    def _check_awake(self, call: str) -> None:
        """Raises RuntimeError while sleep took the weights' device memory (a GPU): nothing may read or write
        them until wake_up(["weights"])."""
        if self.offloaded is not None:
            raise RuntimeError(
                f"{call}() while asleep: the weights' device memory was released; call wake_up(['weights']) first"
            )

    def _model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("the model is not loaded; call load_model() first")
        return self.model

    def _index(self) -> WeightIndex:
        return WeightIndex.of(self._model())

    def _weight_index(self, target: WeightTarget) -> WeightIndex:
        """The index an update of `target` goes through: the model's own, or a union naming the draft's tensors
        "draft.<name>", whose post-processing runs in the draft's scope."""
        if target == "model":
            return self._index()
        if self.draft_model is None:
            raise ValueError(f"target {target!r} needs a draft model (speculative_config method 'draft_model')")
        draft = (WeightIndex.of(self.draft_model), self._draft_scope)
        if target == "draft":
            return WeightIndex.union({DRAFT_PREFIX: draft})
        return WeightIndex.union({"": (self._index(), None), DRAFT_PREFIX: draft})


def _written(part: Part, names: Iterable[str]) -> list[str]:
    """What a committed change of `part` that loaded `names` wrote: "lora", or "model" and/or "draft"."""
    if isinstance(part, AdapterPart):
        return ["lora"]
    return sorted({"draft" if n.startswith(DRAFT_PREFIX) else "model" for n in names})


def _refused(part: Part, sent: object) -> str | None:
    """Why an update whose declaration names target `sent` does not belong in a session writing `part`."""
    if isinstance(part, AdapterPart):
        if sent in (None, "lora"):
            return None
        return f"update_info target {sent!r} in a session started for a LoRA adapter"
    if sent not in (None, "model", "draft"):
        return f"update_info target must be 'model' or 'draft', got {sent!r}"
    if sent is not None and part.name not in (sent, "all"):
        return (
            f"this update carries {sent!r} weights, but the session was started for {part.name!r}; start it "
            f"with target={sent!r} or 'all'"
        )
    return None
