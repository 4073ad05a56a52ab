"""The fleet's replicas: starting them in their placement groups, calling them with bounded waits, watching their
health and restarting the dead ones at the fleet's version (from the checkpoint folder that holds it, else copied
from a live replica and checked against its checksums) and with the fleet's LoRA adapters (copied from a live
replica, else loaded from where the fleet loaded them); adding replicas to a running fleet the same way, and
removing them (out of routing at once, drained, then stopped). `Fleet` (fleet.py) builds its verbs on this."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from hotswap.config import EngineConfig
from hotswap.fleet.catch_up import CatchUp
from hotswap.fleet.members import (
    FleetChange,
    FleetUpdateFailed,
    ReplicaDown,
    Verb,
    _cause,
    _check_atomic,
    _first_line,
    _FolderChanged,
    _Member,
    _no_commit,
    _ray,
    _stop,
    _with_replica,
)
from hotswap.fleet.replica import ReplicaServer
from hotswap.fleet.router import Router
from hotswap.inputs import Tokenizer
from hotswap.weights.version import VersionLabels

logger = logging.getLogger(__name__)

LOCAL_RAY_SYSTEM_CONFIG = {"task_events_report_interval_ms": 0}  # see Replicas.__init__
_FORWARDED_ENV = (
    "HOTSWAP_",
    "TORCH_EXTENSIONS_DIR",
    "MKL_ENABLE_INSTRUCTIONS",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
)

__all__ = [
    "FleetChange",
    "FleetReplicas",
    "FleetUpdateFailed",
    "ReplicaDown",
    "Verb",
    "_Member",
    "_cause",
    "_check_atomic",
    "_first_line",
    "_no_commit",
    "_ray",
    "_with_replica",
]


class FleetReplicas(CatchUp):
    """The replicas of a fleet and the state the fleet's verbs share; constructed by `Fleet` (same arguments)."""

    def __init__(
        self,
        model: str,
        num_replicas: int = 1,
        tensor_parallel_size: int = 1,
        *,
        address: str | None = None,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float | None = None,
        placement_strategy: str = "STRICT_PACK",
        health_check_interval_s: float = 1.0,
        health_check_timeout_s: float = 30.0,
        start_timeout_s: float = 600.0,
        request_timeout_s: float = 3600.0,
        restart_replicas: bool = True,
        ray_init_kwargs: dict[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        positive = {
            "health_check_interval_s": health_check_interval_s,
            "health_check_timeout_s": health_check_timeout_s,
            "start_timeout_s": start_timeout_s,
            "request_timeout_s": request_timeout_s,
            "num_cpus_per_worker": num_cpus_per_worker,
        }
        for name, value in positive.items():
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        self.engine_kwargs = {**engine_kwargs, "tensor_parallel_size": tensor_parallel_size}
        self.config = EngineConfig.from_kwargs(model, **self.engine_kwargs)  # raises before anything starts
        _check_atomic(self.config.weight_transfer_config.atomic)
        self.model = str(model)
        self.num_replicas = num_replicas
        self.tensor_parallel_size = tensor_parallel_size
        ray = _ray()
        if not ray.is_initialized():
            defaults: dict[str, Any] = {"include_dashboard": False}
            if address is None and not os.environ.get("RAY_ADDRESS"):  # a local Ray this process starts
                # no task events: every request is a Ray task and the GCS would keep each one's history (3 KB)
                # up to 100,000 of them; with the dashboard off nothing reads them (a soak measured 7 MB/min)
                defaults["_system_config"] = LOCAL_RAY_SYSTEM_CONFIG
            ray.init(address=address, **{**defaults, **(ray_init_kwargs or {})})
        gpus = num_gpus_per_worker
        if gpus is None:
            import torch

            gpus = 1.0 if torch.cuda.is_available() else 0.0
        self._bundle = {"CPU": num_cpus_per_worker * tensor_parallel_size}
        if gpus:
            self._bundle["GPU"] = gpus * tensor_parallel_size
        self._strategy = placement_strategy
        self._health_interval = float(health_check_interval_s)
        self._health_timeout = float(health_check_timeout_s)
        self._start_timeout = float(start_timeout_s)
        self._request_timeout = float(request_timeout_s)
        self._restart = restart_replicas
        self._rpc_timeout = float(self.config.parallel_config.rpc_timeout_s)
        # the environment that selects kernels, caches and the ISA torch's libraries use travels to every replica
        self._env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}

        from hotswap.engine.detokenizer import Detokenizer
        from hotswap.engine.tokenizer import load_tokenizer

        assert self.config.model_config.tokenizer is not None  # EngineConfig defaults it to the model's folder
        self.tokenizer: Tokenizer = load_tokenizer(self.config.model_config.tokenizer)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.router = Router()
        self.version = 0  # orders versions; labels given by clients are kept beside it
        self.labels = VersionLabels()
        self.draft_version = 0
        # the last checkpoint folder the replicas loaded (a restarted replica starts from it), and whether it alone
        # holds the fleet's version (else a restarted replica copies a live one's weights)
        self._folder = self.model
        self._folder_current = True
        self._folder_generation = 0  # advances whenever the replicas load a folder (its path may be reused)
        self._overrides: dict[str, dict[str, Any]] = {}  # the live config changes, merged; replayed on a restart
        # the fleet's LoRA adapters by name: lora_int_id, version, lora_path, pinned, and where the committed version
        # came from ("tensors": an object ref, "peft_config"), "current" while that source still holds it (a
        # session or a reload from pairs changed it since); what a restarted replica loads when no live one holds
        # them to copy
        self._loras: dict[str, dict[str, Any]] = {}
        # Lock order: _change, then _lock. _change: one weight change, pause / resume / sleep, or a replica's
        # catch-up at a time; _lock: the members and the fleet's state, held briefly.
        self._lock = threading.RLock()
        self._change = threading.Lock()
        self._session: FleetChange | None = None  # the open update session
        self._group: list[Any] | None = None  # the actors a group transport (torch_dist) joined, in rank order
        self._transport: dict[str, Any] | None = None  # a non-group transport's init_info (shm, tensors, disk)
        self.paused = False  # once every replica paused ('wait': drained)
        self.pausing = False  # from the start of a pause: new requests are refused ('abort' / 'wait')
        self.pause_mode = "keep"
        self.asleep = False
        self.counters = {
            "updates_committed": 0,
            "updates_failed": 0,
            "replica_restarts": 0,
            "replica_failures": 0,
            "replicas_added": 0,
            "replicas_removed": 0,
        }
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._check_resources(ray, num_replicas)
        self.members: list[_Member] = []
        try:
            for i in range(num_replicas):
                self.members.append(self._spawn(i, self.model))
            for member in self.members:
                member.status = ray.get(member.actor.status.remote(), timeout=self._start_timeout)
                member.state = "up"
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch, name="hotswap-fleet-monitor", daemon=True)
        self._monitor.start()

    # ---- replicas -----------------------------------------------------------------------------------------

    def _check_resources(self, ray: Any, replicas: int) -> None:
        """Raises ValueError when the cluster cannot hold `replicas` placement groups."""
        total = ray.cluster_resources()
        for resource, amount in self._bundle.items():
            if total.get(resource, 0) + 1e-9 < amount * replicas:
                raise ValueError(
                    f"{replicas} replicas x {amount:g} {resource} (tensor_parallel_size "
                    f"{self.tensor_parallel_size} x the per-worker share) exceed the Ray cluster's "
                    f"{total.get(resource, 0):g} {resource}; lower num_replicas, num_cpus_per_worker or "
                    "num_gpus_per_worker"
                )

    def _spawn(self, index: int, folder: str, placement_group: Any = None) -> _Member:
        ray = _ray()
        from ray.util.placement_group import placement_group as new_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if placement_group is None:
            placement_group = new_group([dict(self._bundle)], strategy=self._strategy)
            try:
                ray.get(placement_group.ready(), timeout=self._start_timeout)
            except ray.exceptions.GetTimeoutError:
                _stop(None, placement_group)
                raise TimeoutError(
                    f"replica {index}'s placement group {self._bundle} could not be placed within "
                    f"{self._start_timeout:g} s (start_timeout_s)"
                ) from None
        actor = (
            ray.remote(ReplicaServer)
            .options(
                num_cpus=self._bundle["CPU"],
                num_gpus=self._bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=0),
                runtime_env={"env_vars": self._env} if self._env else None,
                max_restarts=0,
            )
            .remote(folder, self.engine_kwargs, index)
        )
        return _Member(index, actor, placement_group)

    def routable(self) -> list[int]:
        """Replicas that may take requests now: up, holding the fleet's version, and not leaving."""
        with self._lock:
            return [m.index for m in self.members if self._serves(m)]

    def _serves(self, member: _Member) -> bool:
        """Whether `member` is routable, and a member of the weight changes that start now (hold `_lock`)."""
        return member.state == "up" and member.version == self.version and not member.leaving

    def _up(self) -> list[_Member]:
        with self._lock:
            return [m for m in self.members if m.state == "up"]

    def _failed(self, member: _Member, reason: str, actor: Any = None) -> None:
        """Takes a replica out of routing at once (the monitor restarts it). `actor`: the handle that failed; a
        late failure of a replica's previous actor leaves its replacement alone."""
        ray = _ray()
        with self._lock:
            if member.state != "up" or (actor is not None and actor is not member.actor):
                return
            member.state, member.error, member.version = "down", reason, -1
            self.counters["replica_failures"] += 1
            dead = member.actor
        logger.warning("fleet replica %d is down: %s", member.index, reason)
        with contextlib.suppress(Exception):
            ray.kill(dead, no_restart=True)

    def _call(
        self,
        members: Sequence[_Member],
        verb: Verb,
        *args: Any,
        timeout: float | None = None,
        each: Sequence[tuple[Any, ...]] | None = None,
    ) -> tuple[dict[int, Any], dict[int, BaseException]]:
        """Calls `verb` on every member concurrently (with `args`, or member k with `each[k]`): (results,
        errors) by replica index; what the replica's method raised comes back as itself. A replica that died, did
        not answer within `timeout` or failed in Ray itself is marked down and its error is a `ReplicaDown`."""
        ray = _ray()
        method = verb.__name__
        # the actor's method of that name must be `verb` itself (a generated verb carries its source's name)
        assert getattr(ReplicaServer, method, None) is verb, f"{verb!r} is not ReplicaServer.{method}"
        calls = each if each is not None else [args] * len(members)
        actors = {m.index: m.actor for m in members}
        refs = {m.index: getattr(actors[m.index], method).remote(*a) for m, a in zip(members, calls, strict=True)}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        for member in members:
            index = member.index
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                results[index] = ray.get(refs[index], timeout=left)
            except ray.exceptions.GetTimeoutError:
                reason = f"{method}() did not answer within {timeout:g} s"
                self._failed(member, reason, actors[index])
                with contextlib.suppress(Exception):
                    ray.cancel(refs[index], force=True)
                errors[index] = ReplicaDown(f"replica {index}: {reason}")
            except ray.exceptions.RayTaskError as err:
                errors[index] = _cause(err)
            except Exception as err:  # its actor died, or Ray lost the call: either way the replica is replaced
                reason = f"{method}() failed in Ray ({type(err).__name__}: {_first_line(err)})"
                self._failed(member, reason, actors[index])
                errors[index] = ReplicaDown(f"replica {index}: {reason}")
                errors[index].__cause__ = err
        return results, errors

    def _all(
        self, members: Sequence[_Member], verb: Verb, *args: Any, timeout: float | None = None, down_ok: bool = False
    ) -> dict[int, Any]:
        """`_call` that raises the first error (as `_with_replica` names it). `down_ok`: a replica that went down
        is left out instead (its restart re-applies what the fleet state says: pause, config)."""
        results, errors = self._call(members, verb, *args, timeout=timeout)
        if down_ok:
            errors = {i: e for i, e in errors.items() if not isinstance(e, ReplicaDown)}
        if errors:
            index, err = next(iter(errors.items()))
            raise _with_replica(err, index, verb.__name__)
        return results

    # ---- health, restarts ---------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping.wait(self._health_interval):
            try:
                self._check_health()
            except Exception:  # never let one surprise end the monitoring
                logger.exception("fleet health check failed")

    def _check_health(self) -> None:
        ray = _ray()
        for member in list(self.members):
            if member.state != "up":
                continue
            if member.ping is None:
                actor = member.actor
                member.ping, member.ping_actor, member.ping_sent = actor.status.remote(), actor, time.monotonic()
                continue
            ready, _ = ray.wait([member.ping], timeout=0)
            if ready:
                try:
                    status = ray.get(member.ping, timeout=self._health_timeout)  # ready: answers at once
                except Exception as err:
                    self._failed(member, f"its health check failed: {_first_line(err)}", member.ping_actor)
                else:
                    if member.ping_actor is member.actor:
                        member.status = status
                        if status.workers_problem:  # a dead worker process; invalid weights are no reason
                            self._failed(member, f"unhealthy: {status.workers_problem}", member.ping_actor)
                member.ping = None
            elif time.monotonic() - member.ping_sent > self._health_timeout:
                member.ping = None
                self._failed(
                    member, f"no answer to a health check within {self._health_timeout:g} s", member.ping_actor
                )
        if not self._restart or self.asleep:
            return
        for member in list(self.members):
            with self._lock:
                due = member.state == "down" and not member.leaving and time.monotonic() >= member.retry_at
                if due:
                    member.state, member.ping = "starting", None
                    folder, generation = self._folder, self._folder_generation
            if due and not self._stopping.is_set():
                threading.Thread(
                    target=self._replace,
                    args=(member, folder, generation),
                    daemon=True,
                    name=f"hotswap-fleet-restart-{member.index}",
                ).start()

    def _replace(self, member: _Member, folder: str, generation: int) -> None:
        """Starts a new actor for a dead replica (loading `folder`, the fleet's last) and, holding the change lock
        outside any session, brings it to the fleet's state (`_bring_up`). Only then is it routed to. A failure
        leaves it down, retried with a growing delay."""
        ray = _ray()
        actor = None
        try:
            new = self._spawn(member.index, folder, member.placement_group)
            actor = new.actor
            ray.get(actor.status.remote(), timeout=self._start_timeout)
            with self._outside_session():
                if member.leaving or member.state == "removed":
                    raise RuntimeError("it was removed from the fleet while it restarted")
                restored = self._bring_up(actor, generation)
                status = ray.get(actor.status.remote(), timeout=60)
                with self._lock:
                    member.actor, member.version, member.error, member.status = actor, self.version, None, status
                    member.state, member.backoff, member.restored_from = "up", 0.0, restored
                    member.restarts += 1
                    self.counters["replica_restarts"] += 1
            logger.warning("fleet replica %d is back at version %d (%s)", member.index, self.version, restored)
        except Exception as err:
            with self._lock:
                if member.state != "removed":
                    member.state = "down"
                member.error = f"restart failed: {_first_line(err)}"
                if isinstance(err, _FolderChanged):  # no fault of the replica: it starts again, from the new folder
                    member.retry_at = time.monotonic()
                else:
                    member.backoff = min(60.0, max(1.0, 2 * member.backoff))
                    member.retry_at = time.monotonic() + member.backoff
            logger.warning("fleet replica %d did not come back: %s", member.index, _first_line(err))
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)

    @contextlib.contextmanager
    def _outside_session(self) -> Iterator[None]:
        """Holds the change lock at a moment no update session is open: a session holds no lock between its calls,
        so this waits for its end (an update in flight completes first)."""
        with self._change:
            while self._session is not None:
                self._change.release()
                try:
                    if self._stopping.wait(0.05):
                        raise RuntimeError("the fleet is shutting down")
                finally:
                    self._change.acquire()
            yield

    # ---- replicas joining and leaving ---------------------------------------------------------------------

    def add_replicas(self, n: int = 1) -> list[int]:
        """Starts `n` new replicas (each in a placement group of its own, loading the fleet's last folder) and
        brings them to the fleet's state as a restart does (`_bring_up`): config changes, version and label,
        LoRA adapters, transport, pause; their weights are checked against a live replica's checksums (a folder's
        too) before any of them is routable. They join between weight changes: an update session in flight
        completes first; one started after they joined includes them (a group transport, torch_dist, must be
        joined again: `init_weight_transfer_engine`). All or nothing: if one fails to start or to catch up,
        every new one is stopped and the error raised. Returns the new replicas' indices (never reused)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        ray = _ray()
        self._check_resources(ray, sum(m.state != "removed" for m in self.members) + n)
        with self._lock:
            if self.asleep:
                raise RuntimeError("the fleet is asleep; wake it up before adding replicas")
            new = [_Member(len(self.members) + k, None, None, state="joining") for k in range(n)]
            self.members.extend(new)  # listed (joining) from now on, never routed to until up
            folder, generation = self._folder, self._folder_generation
        started = time.monotonic()
        try:
            for member in new:
                spawned = self._spawn(member.index, folder)
                member.actor, member.placement_group = spawned.actor, spawned.placement_group
            ray.get([m.actor.status.remote() for m in new], timeout=self._start_timeout)
            with self._outside_session():
                restored = [self._bring_up(m.actor, generation, verify=True) for m in new]
                statuses = ray.get([m.actor.status.remote() for m in new], timeout=60)
                with self._lock:
                    for member, how, status in zip(new, restored, statuses, strict=True):
                        member.version, member.status, member.restored_from = self.version, status, how
                        member.state = "up"
                    self.num_replicas = self._present()
                    self.counters["replicas_added"] += n
        except BaseException as err:
            for member in new:
                with self._lock:
                    member.state, member.error = "removed", f"could not join: {_first_line(err)}"
                _stop(member.actor, member.placement_group)
            raise
        logger.warning(
            "fleet replicas %s joined at version %d in %.1f s (%s)",
            [m.index for m in new],
            self.version,
            time.monotonic() - started,
            ", ".join(restored),
        )
        return [m.index for m in new]

    def remove_replicas(
        self, n: int | None = None, indices: Sequence[int] | None = None, drain_timeout_s: float = 120.0
    ) -> list[int]:
        """Takes replicas out of the fleet: `n` of them (those down or restarting first, then the newest), or the
        ones `indices` names. They leave routing and new weight changes at once; their requests in flight finish
        (for up to `drain_timeout_s`, then they are ended); then, once no update session is open (one that
        included them completes first), their actors are stopped and their placement groups released. Raises
        ValueError for a removal that would leave the fleet without a replica, or for unknown indices. Returns
        the removed indices."""
        if (n is None) == (indices is None):
            raise ValueError("give n (how many replicas) or indices (which), not both")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if not isinstance(drain_timeout_s, (int, float)) or drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be a number >= 0, got {drain_timeout_s!r}")
        with self._lock:
            present = [m for m in self.members if m.state not in ("removed", "joining") and not m.leaving]
            if indices is not None:
                wanted = list(dict.fromkeys(indices))
                unknown = [i for i in wanted if i not in {m.index for m in present}]
                if unknown:
                    raise ValueError(f"no replica {unknown} to remove (present: {sorted(m.index for m in present)})")
                chosen = [self.members[i] for i in wanted]
            else:
                chosen = sorted(present, key=lambda m: (m.state == "up", -m.index))[:n]
            if len(chosen) >= len(present):
                raise ValueError(
                    f"removing {len(chosen)} of the fleet's {len(present)} replicas would leave none; "
                    "a fleet keeps at least one (shut it down instead)"
                )
            for member in chosen:
                member.leaving = True
            self.num_replicas = self._present()
        deadline = time.monotonic() + drain_timeout_s
        while any(self.router.requests_on(m.index) for m in chosen) and time.monotonic() < deadline:
            time.sleep(0.05)
        cut = {m.index: self.router.requests_on(m.index) for m in chosen}
        with self._outside_session(), self._lock:  # a session that included them has ended
            for member in chosen:
                member.state, member.leaving, member.version = "removed", False, -1
            self.counters["replicas_removed"] += len(chosen)
        for member in chosen:
            _stop(member.actor, member.placement_group)
        logger.warning(
            "fleet replicas %s removed (requests cut after drain_timeout_s: %s)",
            [m.index for m in chosen],
            {i: c for i, c in cut.items() if c} or "none",
        )
        return [m.index for m in chosen]

    def _present(self) -> int:
        """Replicas that belong to the fleet: not removed, not leaving, not still joining (hold `_lock`)."""
        return sum(m.state not in ("removed", "joining") and not m.leaving for m in self.members)

    def health_problem(self) -> str | None:
        """Why the fleet cannot serve (no routable replica), or None; answers at once."""
        if self.routable():
            return None
        with self._lock:
            reasons = "; ".join(
                f"replica {m.index} {'leaving' if m.leaving else m.state}" + (f" ({m.error})" if m.error else "")
                for m in self.members
                if m.state != "removed"
            )
        return f"no replica can serve: {reasons}"

    def replica_status(self) -> list[dict[str, Any]]:
        """Per replica (removed ones included, state "removed"): index, state, whether it is leaving, version,
        routable, restarts, error, and its last health report."""
        with self._lock:
            return [
                {
                    "index": m.index,
                    "state": m.state,
                    "leaving": m.leaving,
                    "weight_version": self.labels.label(m.version),
                    "version_id": m.version,
                    "routable": self._serves(m),
                    "restarts": m.restarts,
                    "restored_from": m.restored_from,
                    "error": m.error,
                    "routed": self.router.routed.get(m.index, 0),
                    "outstanding_tokens": self.router.outstanding(m.index),
                    "status": {} if m.status is None else m.status.report(),
                }
                for m in self.members
            ]

    def stats(self) -> dict[str, Any]:
        """The replicas' engine statistics summed, with the fleet's own."""
        totals: dict[str, Any] = {}
        with self._lock:
            members = list(self.members)
        for m in members:
            if m.state != "up":
                continue
            for key, value in (m.status.stats if m.status is not None else {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key.startswith("num_"):
                    totals[key] = totals.get(key, 0) + value
        fleet = {
            "replicas": self.num_replicas,
            "replicas_up": len(self.routable()),
            "weight_version": self.version,
            **self.counters,
        }
        return {**totals, **{f"fleet_{k}": v for k, v in fleet.items()}}

    def shutdown(self) -> None:
        """Stops the monitor and every replica, and releases their placement groups."""
        self._stopping.set()
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=5)
        for member in getattr(self, "members", []):
            if member.state != "removed":
                _stop(member.actor, member.placement_group)

    def __enter__(self) -> FleetReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
