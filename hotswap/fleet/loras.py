"""A fleet's LoRA adapters: loaded, reloaded and unloaded on every replica that holds the fleet's version or on
none, without pausing. A load prepares the new version on each replica (`prepare_lora_adapter`), then commits it
on all (`commit_lora_adapter`), else drops it where it was prepared (`abort_lora_adapter`); a reload
(`reload_weights(target="lora:<name>")`) and a session with target "lora:<name>" go two-phase as the model's
do (hotswap/fleet/changes.py). An adapter a request names for the first time is loaded on every replica before
the request is routed; the fleet's records of where each came from let a restarted replica have them back."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch

from hotswap.errors import EngineUnavailable
from hotswap.fleet.changes import FleetChanges
from hotswap.fleet.replica import ReplicaServer as Replica
from hotswap.fleet.replicas import (
    FleetUpdateFailed,
    ReplicaDown,
    Verb,
    _first_line,
    _Member,
    _ray,
    _with_replica,
)
from hotswap.lora.request import LoRARequest
from hotswap.weights.version import VersionArg


class FleetLoRAs(FleetChanges):
    """The LoRA verbs of `Fleet` (its base class)."""

    def resolve_loras(self, loras: Sequence[LoRARequest | None]) -> list[LoRARequest | None]:
        """The adapters requests name, had on every replica before any of them is routed: one the fleet has not
        loaded is loaded (from its lora_path) on every replica, two-phase, once; a request with load_inplace
        reloads its folder on every replica, as one engine does. Returns the requests as the replicas take them
        (load_inplace cleared: it was done here). Raises ValueError for a request another adapter's id or name
        contradicts, or for a load that fails (nothing is loaded then); a request naming an adapter that is not
        loaded and gives no lora_path is left to the replica, which refuses it."""
        for request in loras:
            if request is not None and not isinstance(request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        wanted = {r for r in loras if r is not None}
        for request in wanted:
            self._check_lora()
            self._check_lora_id(request)
            with self._lock:
                known = request.lora_name in self._loras
            if request.lora_path and (request.load_inplace or not known):
                with self._change:
                    self._check_lora_id(request)  # as it is now that no change runs
                    if request.load_inplace or request.lora_name not in self._loras:
                        self._load_lora(
                            request.lora_name,
                            request.lora_path,
                            request.load_inplace,
                            None,
                            None,
                            request.lora_int_id,
                            False,
                        )
        return [r if r is None or not r.load_inplace else dataclasses.replace(r, load_inplace=False) for r in loras]

    def _check_lora_id(self, request: LoRARequest) -> None:
        with self._lock:
            known = self._loras.get(request.lora_name)
            other = next(
                (
                    n
                    for n, r in self._loras.items()
                    if r["lora_int_id"] == request.lora_int_id and n != request.lora_name
                ),
                None,
            )
        if known is not None and known["lora_int_id"] != request.lora_int_id:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} has lora_int_id {known['lora_int_id']}, not {request.lora_int_id}"
            )
        if other is not None:
            raise ValueError(f"lora_int_id {request.lora_int_id} belongs to adapter {other!r}")

    def _check_lora(self) -> None:
        if not self.config.lora_config.enable_lora:
            raise ValueError("this fleet serves no LoRA adapters; start it with enable_lora=True")

    def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        load_inplace: bool = False,
        tensors: dict[str, torch.Tensor] | None = None,
        peft_config: dict[str, Any] | None = None,
        lora_int_id: int | None = None,
        pinned: bool = False,
    ) -> dict[str, Any]:
        """As `LLM.load_lora_adapter`, on every replica that holds the fleet's version or on none: each prepares
        the new version (loaded on its workers, nothing served changes), then, only if every one did, all commit
        it; if any fails or dies first, those that prepared drop it and the first failure is raised (ValueError
        as the replica raised it: a bad folder, rank or name; else FleetUpdateFailed). Nothing pauses. Returns
        the adapter's description (a replica's). Restarted replicas get the fleet's adapters back."""
        self._check_lora()
        with self._change:
            return self._load_lora(lora_name, lora_path, load_inplace, tensors, peft_config, lora_int_id, pinned)

    def _load_lora(
        self,
        lora_name: str,
        lora_path: str | None,
        load_inplace: bool,
        tensors: dict[str, torch.Tensor] | None,
        peft_config: dict[str, Any] | None,
        lora_int_id: int | None,
        pinned: bool,
    ) -> dict[str, Any]:
        """`load_lora_adapter` under the change lock."""
        ray = _ray()
        members = self._current()
        ref = None if tensors is None else ray.put(tensors)  # sent once, kept for restarts
        description = self._lora_two_phase(
            members,
            Replica.prepare_lora_adapter,
            lora_name,
            lora_path,
            load_inplace,
            ref,
            peft_config,
            lora_int_id,
            pinned,
        )
        self._record_lora(description, {"tensors": ref, "peft_config": peft_config, "current": True})
        return description

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Forgets adapter `lora_name` on every replica (requests running on it finish on their version). Raises
        ValueError when no replica has it. A replica that fails otherwise is replaced (a restart copies the
        adapters of a live replica)."""
        self._check_lora()
        with self._change:
            members = self._up()
            results, errors = self._call(members, Replica.unload_lora_adapter, lora_name, timeout=self._rpc_timeout)
            unloaded = bool(results)
            with self._lock:
                unloaded = self._loras.pop(lora_name, None) is not None or unloaded
            for index, err in errors.items():
                if not isinstance(err, (ValueError, ReplicaDown)):  # its adapters are unknown now
                    self._failed(
                        self.members[index],
                        f"it failed to unload LoRA adapter {lora_name!r} ({type(err).__name__}: {_first_line(err)})",
                    )
            if not unloaded and errors:
                index, err = next(iter(errors.items()))
                raise _with_replica(err, index, "unload_lora_adapter")

    def list_loras(self) -> list[dict[str, Any]]:
        """Per loaded adapter: lora_name, lora_int_id, version, rank, lora_path, pinned (every routable replica
        holds the same adapters; the first answers)."""
        self._check_lora()
        members = self._current(required=False)
        if not members:
            raise EngineUnavailable(self.health_problem() or "no replica is routable")
        return cast(
            "list[dict[str, Any]]",
            self._all(members[:1], Replica.list_loras, timeout=self._rpc_timeout)[members[0].index],
        )

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's `add_lora`: loads the adapter a LoRARequest names (from its path) on every replica unless the
        fleet has it."""
        self._check_lora()
        self.resolve_loras([lora_request])
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's `remove_lora`: unloads the adapter with integer id `lora_id`; False if none has it."""
        with self._lock:
            name = next((n for n, r in self._loras.items() if r["lora_int_id"] == lora_id), None)
        if name is None:
            return False
        self.unload_lora_adapter(name)
        return True

    def _record_lora(self, description: dict[str, Any], source: dict[str, Any]) -> None:
        """Records a committed adapter version: its description, and `source` (tensors, peft_config, current)."""
        with self._lock:
            self._loras[description["lora_name"]] = {
                "lora_int_id": description["lora_int_id"],
                "version": description["version"],
                "lora_path": description["lora_path"],
                "pinned": description["pinned"],
                **source,
            }

    def _description(self, lora_name: str) -> dict[str, Any]:
        """Adapter `lora_name`'s description, as the first routable replica reports it."""
        return next(d for d in self.list_loras() if d["lora_name"] == lora_name)

    def _lora_two_phase(self, members: list[_Member], prepare: Verb, lora_name: str, *args: Any) -> dict[str, Any]:
        """`prepare` (prepare_lora_adapter) of adapter `lora_name` on every member, then
        commit_lora_adapter on all; if any member fails (or the members disagree on its integer id), those that
        prepared abort and the failure is raised. Returns the committed description (the lowest replica's)."""
        try:
            prepared, errors = self._call(members, prepare, lora_name, *args, timeout=self._rpc_timeout)
        except BaseException:
            self._lora_abort(members, lora_name)
            raise
        if not errors and len(set(prepared.values())) > 1:  # their adapters differ: never commit that
            errors = {
                min(prepared): RuntimeError(
                    f"the replicas gave LoRA adapter {lora_name!r} different integer ids {prepared}"
                )
            }
        if errors:
            self._lora_abort([m for m in members if m.index in prepared], lora_name)
            index, err = min(errors.items(), key=lambda e: (isinstance(e[1], ReplicaDown), e[0]))  # a user error
            if isinstance(err, (ValueError, TypeError)):
                raise _with_replica(err, index, prepare.__name__)
            raise FleetUpdateFailed(
                f"replica {index} failed in {prepare.__name__}() ({type(err).__name__}: {_first_line(err)}); every "
                f"replica dropped the new version: LoRA adapter {lora_name!r} is unchanged"
            ) from err
        results, errors = self._call(members, Replica.commit_lora_adapter, lora_name, timeout=self._rpc_timeout)
        for index, err in errors.items():  # the decision is made: a replica that cannot commit is replaced
            self._failed(self.members[index], f"its LoRA commit failed ({type(err).__name__}: {_first_line(err)})")
        if not results:
            raise ReplicaDown(
                f"every replica failed while committing LoRA adapter {lora_name!r}; restarted "
                "replicas come back with the adapters the fleet had before"
            )
        return cast("dict[str, Any]", results[min(results)])

    def _lora_abort(self, members: Sequence[_Member], lora_name: str) -> None:
        """Drops a prepared load of `lora_name` on `members`; one that cannot is replaced."""
        live = [m for m in members if m.state == "up"]
        _, errors = self._call(live, Replica.abort_lora_adapter, lora_name, timeout=self._rpc_timeout)
        for index, err in errors.items():
            self._failed(self.members[index], f"its LoRA rollback failed ({type(err).__name__}: {_first_line(err)})")

    def _reload_adapter(
        self,
        lora_name: str,
        weights_path: str | None,
        weights_iterator: Iterable[tuple[str, Any]] | None,
        weight_version: VersionArg,
        encoding: str | None,
        base_version: VersionArg,
        checksums: dict[str, str] | None,
    ) -> None:
        """`reload_weights(target="lora:<name>")`: prepare_reload of the adapter on every replica, then commit (or
        abort), as the model's; nothing pauses."""
        self._check_lora()
        if weight_version is not None:
            raise ValueError("weight_version names a version of the model; a LoRA adapter numbers its own")
        if weights_path is not None and weights_iterator is not None:
            raise ValueError("give weights_path or weights_iterator, not both")
        if weights_path is None and weights_iterator is None:
            raise ValueError("a LoRA reload needs weights_path (a PEFT folder) or weights_iterator")
        ray = _ray()
        with self._change:
            self._check_no_session("reload_weights")
            members = self._current()
            weights = None if weights_iterator is None else ray.put(list(weights_iterator))
            confirmed = self._two_phase(
                members,
                Replica.prepare_reload,
                weights_path,
                weights,
                encoding,
                base_version,
                checksums,
                f"lora:{lora_name}",
                adapter=lora_name,
            )
            if not confirmed:
                raise ReplicaDown(
                    f"every replica failed while committing LoRA adapter {lora_name!r}; restarted "
                    "replicas come back with the adapters the fleet had before"
                )
            description = self._description(lora_name)
            if weights_path is not None:  # the folder holds this version whole
                self._record_lora(description, {"tensors": None, "peft_config": None, "current": True})
            else:
                with self._lock:
                    record = self._loras.get(lora_name)
                if record is not None:
                    self._record_lora(
                        description, {**{k: record[k] for k in ("tensors", "peft_config")}, "current": False}
                    )
