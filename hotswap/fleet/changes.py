"""A fleet's weight changes: reloads, the transfer session and its transport, each two-phase over the replicas.

A change is first prepared on every replica that holds the fleet's version (received, validated,
post-processed, rollback copies kept, nothing served from it); only if every one prepared is it committed
everywhere, with one version. If any replica fails, times out or dies before that, every replica rolls back and
the fleet goes on serving the previous version. The open session is one `FleetChange` record; each replica's own
change is its engine's `OpenChange` (hotswap/engine/change.py), driven through the replica's verbs.

    IDLE --start_weight_update()--> SESSION --update_weights()*--> SESSION --finish_weight_update()-->
         PREPARE (all replicas) --all prepared--> COMMIT (all, one version) --> IDLE
         any failure before COMMIT --> every replica aborts (rolled back) --> IDLE
    IDLE --reload_weights()--> PREPARE --> COMMIT | roll back everywhere --> IDLE
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any

from hotswap.config import apply_overrides, live_overrides
from hotswap.engine.lora_updates import lora_target
from hotswap.errors import EngineUnavailable
from hotswap.fleet.replica import ReplicaServer as Replica
from hotswap.fleet.replicas import (
    FleetChange,
    FleetReplicas,
    FleetUpdateFailed,
    ReplicaDown,
    Verb,
    _first_line,
    _Member,
    _no_commit,
    _ray,
    _with_replica,
)
from hotswap.weights.delta import is_delta
from hotswap.weights.version import VersionArg, parse_version

logger = logging.getLogger(__name__)


class FleetChanges(FleetReplicas):
    """The weight-change verbs of `Fleet` (its base class)."""

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
        raise NotImplementedError  # `FleetLoRAs`

    def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Iterable[tuple[str, Any]] | None = None,
        target: str = "model",
        weight_version: VersionArg = None,
        encoding: str | None = None,
        base_version: VersionArg = None,
        checksums: dict[str, str] | None = None,
    ) -> None:
        """Reloads every replica in place, two-phase: all of them commit one new version (the next, or
        `weight_version`: an integer or a label), or none changes. As for one engine, requests in flight refuse
        it: pause first. With a folder, this also brings the fleet back when no replica holds its version any
        more: the replicas restart from the folder. `encoding` / `base_version` / `checksums`: a delta, as for
        one engine (every replica holds the same weights, so one delta fits them all). `target` "lora:<name>":
        the adapter's next version on every replica or on none (a PEFT folder, or pairs; nothing pauses)."""
        parse_version(weight_version)
        lora = lora_target(target)
        if lora is not None:
            self._reload_adapter(
                lora, weights_path, weights_iterator, weight_version, encoding, base_version, checksums
            )
            return
        if target != "model":
            raise ValueError(
                "a fleet reloads the served model's weights (target 'model'); a draft model is "
                "updated through a session with target 'all'"
            )
        if weights_path is not None and weights_iterator is not None:
            raise ValueError("give weights_path or weights_iterator, not both")
        new_folder = None
        delta = is_delta(encoding)
        if weights_path is not None and not delta:  # a folder of this model, checked before any replica is asked
            new_folder = live_overrides(self.config, {"model_config": {"model": str(weights_path)}})
        ray = _ray()
        with self._change:
            self._check_no_session("reload_weights")
            members = self._current(required=weights_path is None or delta)
            confirmed = True
            if members:
                weights = None if weights_iterator is None else ray.put(list(weights_iterator))
                confirmed = self._two_phase(
                    members,
                    Replica.prepare_reload,
                    weights_path,
                    weights,
                    encoding,
                    base_version,
                    checksums,
                    version=weight_version,
                )
            elif not self._restart:
                raise EngineUnavailable("no replica holds the fleet's weights and restart_replicas is off")
            with self._lock:  # before a restart is scheduled from it
                if new_folder is not None:
                    self._folder, self._folder_current = str(weights_path), True
                    self._folder_generation += 1
                    apply_overrides(self.config, new_folder)
                else:
                    self._folder_current = False
            if not members:
                self._reseed(weight_version)
            if not confirmed:
                raise _no_commit(self.version)
        if not members:  # the replicas come back from the folder: wait for the first
            deadline = time.monotonic() + self._start_timeout
            while not self.routable():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no replica came back from {weights_path} within {self._start_timeout:g} s")
                time.sleep(0.1)

    def _reseed(self, weight_version: VersionArg = None) -> None:
        """No replica holds the fleet's version: at a new version (the next, or `weight_version`), every replica
        is restarted (from the folder the caller records before releasing the change lock)."""
        number, label = parse_version(weight_version)
        with self._lock:
            self.version = self.version + 1 if number is None else number
            self.labels.set(self.version, label)
            stale = [m for m in self.members if m.state == "up"]
            for m in self.members:
                m.retry_at = m.backoff = 0.0
        for member in stale:
            self._failed(member, "restarted from a new folder, since no live replica held the fleet's version")
        logger.warning("no replica held the fleet's weights: every replica restarts (version %d)", self.version)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Creates every replica's receiving side. A group transport (init_info with master_address: torch_dist,
        sglang_dist) gets one group spanning the trainer and every replica's workers, so the trainer sends each
        byte once: replica r's workers join at rank_offset + r * tensor_parallel_size, and the group's world_size
        is rank_offset + replicas * tensor_parallel_size (`get_world_size()` without the trainer). Other
        transports are created on restarted replicas too."""
        if not isinstance(init_info, dict):
            raise ValueError("init_info must be a JSON object")
        with self._change:
            self._check_no_session("init_weight_transfer_engine")
            members = self._current()
            group = "master_address" in init_info
            infos = [init_info] * len(members)
            if group:
                offset = init_info.get("rank_offset", 1)
                if not isinstance(offset, int) or isinstance(offset, bool) or offset < 1:
                    raise ValueError(f"rank_offset must be an integer >= 1 (the trainer is rank 0), got {offset!r}")
                world = offset + len(members) * self.tensor_parallel_size
                if init_info.get("world_size", world) != world:
                    raise ValueError(
                        f"world_size must be {world}: the trainer's rank(s) before rank_offset={offset} "
                        f"and {len(members)} replicas x {self.tensor_parallel_size} workers, got "
                        f"{init_info['world_size']!r}"
                    )
                infos = [
                    {**init_info, "rank_offset": offset + k * self.tensor_parallel_size, "world_size": world}
                    for k in range(len(members))
                ]
            connect = 2 * self.config.weight_transfer_config.timeout_s + 30  # the engine's own connect deadline
            _, errors = self._call(
                members, Replica.init_weight_transfer_engine, timeout=connect, each=[(info,) for info in infos]
            )
            if errors:
                self._call(self._up(), Replica.shutdown_weight_transfer_engine, timeout=self._rpc_timeout)
                self._group = self._transport = None
                index, err = next(iter(errors.items()))
                raise _with_replica(err, index, "init_weight_transfer_engine")
            self._group = [m.actor for m in members] if group else None
            self._transport = None if group else dict(init_info)

    def get_world_size(self) -> int:
        """Workers a group transport's trainer broadcasts to: every replica's that holds the fleet's version (the
        trainer not counted)."""
        return len(self.routable()) * self.tensor_parallel_size

    def shutdown_weight_transfer_engine(self) -> None:
        with self._change:
            self._check_no_session("shutdown_weight_transfer_engine")
            self._group = self._transport = None
            self._all(self._up(), Replica.shutdown_weight_transfer_engine, timeout=self._rpc_timeout, down_ok=True)

    def start_weight_update(self, target: str = "model") -> str:
        """Opens a session on every replica that holds the fleet's version; returns the fleet's session token.
        With a group transport, those must be the replicas (the same actors) that joined the group."""
        with self._change:
            self._check_no_session("start_weight_update")
            members = self._current()
            if self._group is not None and [m.actor for m in members] != self._group:
                raise FleetUpdateFailed(
                    "a replica restarted (or left) since the transfer group was joined, so the group's ranks no "
                    "longer match the live replicas; call init_weight_transfer_engine() again"
                )
            results, errors = self._call(members, Replica.start_weight_update, target, timeout=self._rpc_timeout)
            if errors:
                self._abort([m for m in members if m.index in results])
                index, err = next(iter(errors.items()))
                raise _with_replica(err, index, "start_weight_update")
            token = secrets.token_hex(16)
            self._session = FleetChange(members, token, target)
            return token

    def update_weights(self, update_info: Any, session_token: str | None = None) -> None:
        """One update of the open session on every replica at once; a failure anywhere rolls every replica back
        and ends the session."""
        with self._change:
            members = self._session_members(session_token, "update_weights")
            _, errors = self._call(members, Replica.update_weights, update_info, timeout=self._rpc_timeout)
            if errors:
                self._roll_back(members, errors, Replica.update_weights)

    def finish_weight_update(
        self, weight_version: VersionArg = None, session_token: str | None = None, canary: Any = None
    ) -> None:
        """Prepares the session's update on every replica, then commits it on all with one version (the fleet's
        next, or `weight_version`: an integer or a label); if any replica fails to prepare, all roll back.
        `canary`: probes every replica scores on its prepared weights (hotswap/engine/canary.py); one that fails
        anywhere rolls every replica back."""
        parse_version(weight_version)
        with self._change:
            members = self._session_members(session_token, "finish_weight_update")
            assert self._session is not None
            lora = lora_target(self._session.target)
            if lora is not None and (weight_version is not None or canary is not None):
                raise ValueError("weight_version and canary apply to the model; a LoRA update takes neither")
            self._session = None
            confirmed = self._two_phase(
                members, Replica.prepare_weight_update, None, canary, version=weight_version, adapter=lora
            )
            if lora is None:
                self._folder_current = False
            else:  # the adapter's committed version is no longer what the fleet loaded it from
                with self._lock:
                    if lora in self._loras:
                        self._loras[lora]["current"] = False
            if not confirmed:
                raise _no_commit(self.version)

    def abort_weight_update(self, session_token: str | None = None) -> None:
        """Ends the open session on every replica, restoring their weights. An update blocked waiting for its
        trainer is interrupted first, so the abort does not wait for the transport's timeout."""
        session = self._session
        if session is not None and (session_token is None or session_token == session.token):
            for member in session.members:
                with contextlib.suppress(Exception):
                    member.actor.interrupt_transfer.remote()
        with self._change:
            if self._session is None:
                return
            if session_token is not None and session_token != self._session.token:
                raise RuntimeError("this weight-update session belongs to another caller (its session_token differs)")
            members = self._session.members
            self._session = None
            self._abort(members)

    def set_change_version(self, weight_version: VersionArg, session_token: str | None = None) -> None:
        """Records on the open session the version it is to commit as (`FleetChange.version`; see
        `AsyncLLMEngine.set_change_version`)."""
        parse_version(weight_version)
        with self._lock:
            session = self._session
            if session is None:
                raise RuntimeError("no weight-update session is open; call start_weight_update() first")
            if session_token is not None and session_token != session.token:
                raise RuntimeError("this weight-update session belongs to another caller (its session_token differs)")
            session.version = weight_version

    def _check_no_session(self, method: str) -> None:
        if self._session is not None:
            raise RuntimeError(f"{method}() while a fleet weight-update session is open; finish or abort it first")

    def _current(self, required: bool = True) -> list[_Member]:
        """The replicas a weight change runs on: up, holding the fleet's version and not leaving. With `required`,
        raises EngineUnavailable when there is none."""
        with self._lock:
            members = [m for m in self.members if self._serves(m)]
        if not members and required:
            raise EngineUnavailable(
                "no replica holds the fleet's weights now (all are down or restarting); a "
                "reload from a checkpoint folder brings the fleet back"
            )
        return members

    def _session_members(self, session_token: str | None, method: str) -> list[_Member]:
        if self._session is None:
            raise RuntimeError(f"{method}() without an open session; call start_weight_update() first")
        if session_token is not None and session_token != self._session.token:
            raise RuntimeError("this weight-update session belongs to another caller (its session_token differs)")
        return self._session.members

    def _abort(self, members: Sequence[_Member]) -> None:
        """Rolls back the open change on `members`; one that cannot is replaced (its weights are unknown)."""
        live = [m for m in members if m.state == "up"]
        _, errors = self._call(live, Replica.abort_weight_update, timeout=self._rpc_timeout)
        for index, err in errors.items():
            self._failed(self.members[index], f"its rollback failed ({type(err).__name__}: {_first_line(err)})")

    def _roll_back(
        self, members: list[_Member], errors: dict[int, BaseException], verb: Verb, adapter: str | None = None
    ) -> None:
        """After `verb` failed on some replicas: every other one aborts (restoring its weights); raises. `adapter`
        (the name of the LoRA adapter whose next version failed): a user error is raised before a replica that
        went down, and the message says the adapter is unchanged."""
        method = verb.__name__
        self._session = None
        self._abort([m for m in members if m.index not in errors])
        with self._lock:
            self.counters["updates_failed"] += 1
        if adapter is None:
            index, err = next(iter(errors.items()))
        else:
            index, err = min(errors.items(), key=lambda e: (isinstance(e[1], ReplicaDown), e[0]))
        if isinstance(err, (ValueError, TypeError)):
            raise _with_replica(err, index, method)
        outcome = (
            f"was rolled back and the fleet serves version {self.version}"
            if adapter is None
            else f"dropped the new version: LoRA adapter {adapter!r} is unchanged"
        )
        message = (
            f"replica {index} failed in {method}() ({type(err).__name__}: {_first_line(err)}); every replica {outcome}"
        )
        if adapter is None and all(
            isinstance(e, TimeoutError) and not isinstance(e, ReplicaDown) for e in errors.values()
        ):
            raise TimeoutError(message) from err  # e.g. a trainer that stopped sending
        raise FleetUpdateFailed(message) from err

    def _two_phase(
        self, members: list[_Member], prepare: Verb, *args: Any, version: VersionArg = None, adapter: str | None = None
    ) -> bool:
        """Prepares on every member, then commits all with one version (with `adapter`, the name of the LoRA
        adapter whose next version this is: no model version, the adapter numbers its own), or rolls all back (and
        raises). Returns whether any replica confirmed its commit (if none did, a model change leaves the fleet at
        the new version with no replica holding it: the caller records where it came from, then raises
        `_no_commit`; an adapter's leaves the fleet's versions as they were)."""
        versioned = adapter is None
        try:
            _, errors = self._call(members, prepare, *args, timeout=self._rpc_timeout)
        except BaseException:
            self._abort(members)
            raise
        if errors:
            self._roll_back(members, errors, prepare, adapter)
        number, label = parse_version(version)
        proposed = self.version + 1 if number is None else number
        results, errors = self._call(
            members, Replica.commit, *((proposed, label) if versioned else (None, None)), timeout=self._rpc_timeout
        )
        for index, err in errors.items():  # the decision is made: a replica that cannot commit is replaced
            self._failed(self.members[index], f"its commit failed ({type(err).__name__}: {_first_line(err)})")
        # (model version, draft version, the model version's label) as the commits left them: the fleet takes the
        # replicas' own (a draft-only session leaves the model's version and label as they were)
        states = [tuple(r) for r in results.values()]
        if not states and not versioned:
            return False
        unconfirmed = (proposed, self.draft_version, label if label is not None else str(proposed))
        agreed = max(set(states), key=states.count) if states else unconfirmed
        odd = []
        with self._lock:
            self.version, self.draft_version = agreed[0], agreed[1]
            self.labels.set(agreed[0], agreed[2])
            for m in members:
                if m.index in results:
                    if tuple(results[m.index]) == agreed:
                        m.version = self.version
                    else:  # cannot happen for replicas of one config; never route to one that disagrees
                        odd.append(m)
            if results:
                self.counters["updates_committed"] += 1
        for m in odd:
            self._failed(m, f"it committed versions {results[m.index]}, the others {agreed}")
        return bool(results)
