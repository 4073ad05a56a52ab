"""How a replica that starts (a restart, or one joining) is brought to the fleet's state before it is routed to:
its config, its weights (from the folder that holds the fleet's version, else copied from a live replica and
checked against its checksums), its LoRA adapters, its transport and its pause."""

from __future__ import annotations

import logging
import threading
from typing import Any

from hotswap.config import EngineConfig
from hotswap.fleet.members import _cause, _first_line, _FolderChanged, _Member, _ray
from hotswap.weights.version import VersionLabels

logger = logging.getLogger(__name__)


class CatchUp:
    """The catch-up half of `FleetReplicas` (its base class): what it reads of the fleet is declared here."""

    config: EngineConfig
    members: list[_Member]
    version: int
    draft_version: int
    labels: VersionLabels
    asleep: bool
    paused: bool
    pause_mode: str
    _lock: threading.RLock
    _overrides: dict[str, dict[str, Any]]
    _folder: str
    _folder_current: bool
    _folder_generation: int
    _loras: dict[str, dict[str, Any]]
    _transport: dict[str, Any] | None
    _rpc_timeout: float
    _start_timeout: float

    def _bring_up(self, actor: Any, generation: int, verify: bool = False) -> str:
        """Brings a new actor (started from the folder of `generation`) to the fleet's state, the caller holding
        the change lock outside any session: it replays the config changes; takes the fleet's version from that
        folder when it alone holds it, else adopts a copy of a live replica's weights checked against its
        checksums; gets the fleet's LoRA adapters, its transport (not a group's) and its pause. With `verify`
        (a replica joining), a folder's weights are checked against a live replica's checksums too, and copied
        from it where they differ (a trainer rewrote the folder) or where the fleet moved to another folder
        meanwhile. Returns how its weights were restored: "folder" or "copy"."""
        ray = _ray()
        if self.asleep:  # it would hold the memory a sleep released; it comes back once the fleet wakes
            raise RuntimeError("the fleet fell asleep while this replica started")
        if self._overrides:
            ray.get(actor.update_config.remote(self._overrides), timeout=self._rpc_timeout)
        restored = "copy"
        if self._folder_current and self._folder_generation == generation:
            ray.get(
                actor.set_weight_version.remote(self.version, self.draft_version, self.labels.snapshot()), timeout=60
            )
            source = self._source() if verify else None
            if source is None or self._same_weights(actor, source):
                restored = "folder"
            else:
                logger.warning(
                    "a joining replica's weights from %s differ from the live replicas': copying theirs", self._folder
                )
        elif self._folder_current and not verify:  # a reload from a folder landed while this actor loaded the last
            raise _FolderChanged("the fleet loaded another folder while this replica started from the last")
        if restored == "copy":
            self._copy_weights(actor)
        self._restore_loras(actor)
        if self._transport is not None:
            ray.get(actor.init_weight_transfer_engine.remote(self._transport), timeout=self._rpc_timeout)
        if self.paused:
            ray.get(actor.pause_generation.remote(self.pause_mode, True), timeout=self._rpc_timeout)
        return restored

    def _source(self) -> _Member | None:
        """A live replica at the fleet's version to copy from (none while the fleet sleeps)."""
        return (
            None
            if self.asleep
            else next((m for m in self.members if m.state == "up" and m.version == self.version), None)
        )

    def _same_weights(self, actor: Any, source: _Member) -> bool:
        """Whether `actor`'s weights (the draft's too) have `source`'s checksums."""
        ray = _ray()
        which = "all" if self.config.draft_model_config is not None else "model"
        theirs, mine = ray.get(
            [source.actor.weight_checksums.remote(which), actor.weight_checksums.remote(which)],
            timeout=self._start_timeout,
        )
        return bool(theirs == mine)

    def _copy_weights(self, actor: Any) -> None:
        """Copies a live replica's weights (at the fleet's version) into `actor` and checks their checksums."""
        ray = _ray()
        source = self._source()
        if source is None:
            raise RuntimeError(
                f"no live replica holds version {self.version} and no checkpoint folder does; "
                "reload the fleet from a folder to bring replicas back"
            )
        states = source.actor.export_weights.remote()
        ray.get(
            actor.adopt_weights.remote(states, self.version, self.draft_version, self.labels.snapshot()),
            timeout=self._start_timeout,
        )
        if not self._same_weights(actor, source):
            raise RuntimeError("the copied weights' checksums differ from the source replica's")

    def _restore_loras(self, actor: Any) -> None:
        """Gives a restarted replica the fleet's LoRA adapters, each at its version: copied whole from a live
        replica (what it serves, however it got there: a load, a reload, a session), checked by their
        descriptions; with no live replica, loaded from where the fleet loaded each (its folder, or its tensors).
        An adapter that cannot be had then (a session or a reload from pairs changed it since, or its folder is
        no longer readable) is dropped from the fleet, logged."""
        if not self.config.lora_config.enable_lora:
            return
        ray = _ray()
        source = self._source()
        if source is not None:
            exports = source.actor.export_loras.remote()
            ray.get(actor.adopt_loras.remote(exports), timeout=self._start_timeout)
            theirs, mine = ray.get(
                [source.actor.list_loras.remote(), actor.list_loras.remote()], timeout=self._start_timeout
            )
            if theirs != mine:
                raise RuntimeError(f"the copied LoRA adapters {mine} differ from the source replica's {theirs}")
            return
        entries = []
        with self._lock:
            for name, record in list(self._loras.items()):
                if not record["current"]:
                    del self._loras[name]
                    logger.warning(
                        "LoRA adapter %r is dropped: no live replica holds it and a weight update "
                        "changed it since it was loaded; load it again",
                        name,
                    )
                    continue
                entries.append(
                    {k: record[k] for k in ("lora_int_id", "version", "lora_path", "pinned", "tensors", "peft_config")}
                    | {"lora_name": name}
                )
        for entry in entries:
            if entry["tensors"] is not None:
                entry["tensors"] = ray.get(entry["tensors"], timeout=self._start_timeout)
            try:
                ray.get(actor.adopt_loras.remote([entry]), timeout=self._start_timeout)
            except ray.exceptions.RayTaskError as err:
                if not isinstance(_cause(err), ValueError):
                    raise
                with self._lock:  # e.g. its folder is gone: the replica comes back without it
                    self._loras.pop(entry["lora_name"], None)
                logger.warning(
                    "LoRA adapter %r is dropped: no live replica holds it and it cannot be loaded "
                    "again from where the fleet loaded it (%s)",
                    entry["lora_name"],
                    _first_line(_cause(err)),
                )
