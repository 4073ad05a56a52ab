"""A fleet: N engine replicas as Ray actors behind one router, changing weights together.

Each replica is one Ray actor (`ReplicaServer`) in a placement group of its own that reserves its
tensor_parallel_size workers' resources on one node (STRICT_PACK); the workers are the actor's processes, since
a replica's tensor-parallel group never spans nodes. `ray.init()` is called only when Ray is not initialized:
`address=None` starts (or joins, with RAY_ADDRESS) a local Ray, `address="auto"` or "ray://..." a cluster.

Fleet-wide weight changes are two-phase. A change is first prepared on every replica that holds the fleet's
version (received, validated, post-processed, rollback copies kept, nothing served from it); only if every one
prepared is it committed everywhere, with one version. If any replica fails, times out or dies before that,
every replica rolls back and the fleet goes on serving the previous version.

    IDLE --init_weight_transfer_engine()--> (transport on every replica; the group is fixed until shutdown)
    IDLE --start_weight_update()--> SESSION --update_weights()*--> SESSION --finish_weight_update()-->
         PREPARE (all replicas) --all prepared--> COMMIT (all, one version) --> IDLE
         any failure before COMMIT --> every replica aborts (rolled back) --> IDLE
    IDLE --reload_weights()--> PREPARE --> COMMIT | roll back everywhere --> IDLE

A replica is routable only while it is up and holds the fleet's version. A replica that dies (its actor dies,
or it does not answer a health check within `health_check_timeout_s`) leaves routing at once, is restarted by
the fleet in its placement group, brought to the fleet's version (from the checkpoint folder when the version
came from one, else copied from a live replica and checked against its checksums) outside any weight change,
paused if the fleet is, and only then routed to again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from hotswap.config import EngineConfig, apply_overrides, live_overrides
from hotswap.errors import EngineUnavailable
from hotswap.fleet.replica import ReplicaServer
from hotswap.fleet.router import Router, request_cost
from hotswap.inputs import PromptType, chat_prompts, per_prompt, stage
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams
from hotswap.weights.session import WeightUpdateFailed
from hotswap.weights.version import VersionArg, VersionLabels, parse_version

logger = logging.getLogger(__name__)

_FORWARDED_ENV = ("HOTSWAP_", "TORCH_EXTENSIONS_DIR", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY",
                  "ONEDNN_MAX_CPU_ISA")


class FleetUpdateFailed(WeightUpdateFailed):
    """A fleet-wide weight change failed on some replica; every replica was rolled back (HTTP 409)."""


class ReplicaDown(EngineUnavailable):
    """A replica died (or stopped answering) during a call; the fleet restarts it (HTTP 503)."""


@dataclasses.dataclass
class _Member:
    index: int
    actor: Any
    placement_group: Any
    state: str = "starting"  # starting | up | down
    version: int = 0
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    restarts: int = 0
    error: str | None = None
    restored_from: str | None = None  # after a restart: "folder" or "copy" (of a live replica's weights)
    ping: Any = None  # the health check in flight, the actor it was sent to, and when
    ping_actor: Any = None
    ping_sent: float = 0.0
    retry_at: float = 0.0  # a failed restart is retried from then on (backing off up to a minute)
    backoff: float = 0.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError("a fleet runs on Ray: pip install 'hotswap[ray]'") from err
    return ray


class Fleet:
    """N replicas of one model behind a router, with `LLM`'s methods (generate, chat, the weight lifecycle,
    pause/resume, sleep) applied fleet-wide.

    `engine_kwargs` are `LLM`'s keyword arguments, given to every replica; they are validated here first (a bad
    one raises before any actor starts). `num_cpus_per_worker` / `num_gpus_per_worker` size each worker's share
    of the placement group (GPU: default 1 where CUDA is configured, else 0)."""

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
            ray.init(address=address, **{"include_dashboard": False, **(ray_init_kwargs or {})})
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

        from transformers import AutoTokenizer

        from hotswap.engine.detokenizer import Detokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.config.model_config.tokenizer)
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
        # Lock order: _change, then _lock. _change: one weight change, pause / resume / sleep, or a replica's
        # catch-up at a time; _lock: the members and the fleet's state, held briefly.
        self._lock = threading.RLock()
        self._change = threading.Lock()
        self._session: dict[str, Any] | None = None  # the open update session: members, token
        self._group: list[Any] | None = None  # the actors a group transport (torch_dist) joined, in rank order
        self._transport: dict[str, Any] | None = None  # a non-group transport's init_info (shm, tensors, disk)
        self.paused = False  # once every replica paused ('wait': drained)
        self.pausing = False  # from the start of a pause: new requests are refused ('abort' / 'wait')
        self.pause_mode = "keep"
        self.asleep = False
        self.counters = {"updates_committed": 0, "updates_failed": 0, "replica_restarts": 0, "replica_failures": 0}
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._check_resources(ray)
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

    def _check_resources(self, ray: Any) -> None:
        """Raises ValueError when the cluster cannot hold every replica's placement group."""
        total = ray.cluster_resources()
        for resource, amount in self._bundle.items():
            if total.get(resource, 0) + 1e-9 < amount * self.num_replicas:
                raise ValueError(
                    f"{self.num_replicas} replicas x {amount:g} {resource} (tensor_parallel_size "
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
                raise TimeoutError(f"replica {index}'s placement group {self._bundle} could not be placed within "
                                   f"{self._start_timeout:g} s (start_timeout_s)") from None
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
        """Replicas that may take requests now: up, and holding the fleet's version."""
        with self._lock:
            return [m.index for m in self.members if m.state == "up" and m.version == self.version]

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
        method: str,
        *args: Any,
        timeout: float | None = None,
        each: Sequence[tuple[Any, ...]] | None = None,
    ) -> tuple[dict[int, Any], dict[int, BaseException]]:
        """Calls `method` on every member concurrently (with `args`, or member k with `each[k]`): (results,
        errors) by replica index; what the replica's method raised comes back as itself. A replica that died, did
        not answer within `timeout` or failed in Ray itself is marked down and its error is a `ReplicaDown`."""
        ray = _ray()
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

    def _all(self, members: Sequence[_Member], method: str, *args: Any, timeout: float | None = None,
             down_ok: bool = False) -> dict[int, Any]:
        """`_call` that raises the first error (as `_with_replica` names it). `down_ok`: a replica that went down
        is left out instead (its restart re-applies what the fleet state says: pause, config)."""
        results, errors = self._call(members, method, *args, timeout=timeout)
        if down_ok:
            errors = {i: e for i, e in errors.items() if not isinstance(e, ReplicaDown)}
        if errors:
            index, err = next(iter(errors.items()))
            raise _with_replica(err, index, method)
        return results

    # ---- requests -----------------------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def next_request_id(self) -> str:
        return f"fleet-{next(self._ids)}"

    def prepare_prompt(self, prompt: PromptType) -> dict[str, Any]:
        """The prompt as replicas take it, tokenized once here: {"prompt", "prompt_token_ids", "cache_salt"?}."""
        return stage(prompt, self.tokenizer).as_dict()

    def route(self, prompt: dict[str, Any], params: SamplingParams, request_id: str, key: str | None = None,
              avoid: Iterable[int] = ()) -> _Member:
        """Chooses the request's replica and books its cost. Raises EngineUnavailable when none is routable."""
        salt = prompt.get("cache_salt")
        routable = [r for r in self.routable() if r not in set(avoid)]
        try:
            index = self.router.pick(routable, key if key is not None else salt)
        except RuntimeError as err:
            raise EngineUnavailable(str(err)) from None
        max_tokens = params.max_tokens if params.max_tokens is not None else 16
        self.router.started(request_id, index, request_cost(len(prompt["prompt_token_ids"]), max_tokens, params.n))
        return self.members[index]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """As `LLM.generate`: outputs in prompt order, spread over the replicas (a replica that dies meanwhile
        has its prompts generated again by the others).

        Never blocks for ever: a paused fleet refuses a new call at once (`EngineUnavailable`: resume first), and a
        replica that has not returned its outputs within `request_timeout_s` (one paused meanwhile in 'keep' mode,
        say) raises `TimeoutError` naming it; its requests are cancelled."""
        ray = _ray()
        if self.paused or self.pausing:
            raise EngineUnavailable(f"the fleet is paused ({self.pause_mode!r}); call resume_generation() first")
        prompts, params_list = per_prompt(prompts, sampling_params)
        staged = [self.prepare_prompt(p) for p in prompts]
        results: dict[int, RequestOutput] = {}
        pending = list(range(len(prompts)))
        avoid: set[int] = set()
        booked: list[str] = []
        calls: dict[int, Any] = {}
        try:
            while pending:
                groups: dict[int, list[tuple[int, str]]] = {}
                for i in pending:
                    request_id = self.next_request_id()
                    member = self.route(staged[i], params_list[i], request_id, avoid=avoid)
                    booked.append(request_id)
                    groups.setdefault(member.index, []).append((i, request_id))
                actors = {index: self.members[index].actor for index in groups}
                calls = {
                    index: actors[index].generate_batch.remote(
                        [staged[i] for i, _ in group], [params_list[i] for i, _ in group], [r for _, r in group])
                    for index, group in groups.items()
                }
                pending = []
                deadline = time.monotonic() + self._request_timeout
                for index, ref in list(calls.items()):
                    try:
                        outs = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                        for (i, _), out in zip(groups[index], outs, strict=True):
                            results[i] = out
                    except ray.exceptions.GetTimeoutError:
                        raise TimeoutError(
                            f"replica {index} did not return its {len(groups[index])} outputs within "
                            f"{self._request_timeout:g} s (request_timeout_s); paused={self.paused}") from None
                    except ray.exceptions.RayTaskError as err:
                        raise _cause(err) from None
                    except ray.exceptions.RayError as err:  # the replica died: its prompts go to the others
                        self._failed(self.members[index], f"it failed while generating: {_first_line(err)}",
                                     actors[index])
                        avoid.add(index)
                        pending += [i for i, _ in groups[index]]
                    del calls[index]
        finally:
            for ref in calls.values():  # left unread after an error: stop them
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
            for request_id in booked:
                self.router.finished(request_id)
        return [results[i] for i in range(len(prompts))]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
             add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        prompts = chat_prompts(self.tokenizer, messages, add_generation_prompt, chat_template)
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- pause, resume, sleep, config ------------------------------------------------------------------------

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pauses every replica (modes as `LLM.pause_generation`; 'wait' returns once every replica drained). A
        replica restarted while the fleet is paused is paused the same way before it is routed to."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        with self._change:
            with self._lock:
                self.pausing, self.pause_mode = True, mode
            self._all(self._up(), "pause_generation", mode, clear_cache, down_ok=True)
            self.paused = True

    def resume_generation(self) -> None:
        with self._change:
            with self._lock:
                self.paused = self.pausing = False
            self._all(self._up(), "resume_generation", down_ok=True)

    def is_paused(self) -> bool:
        return self.paused

    def sleep(self, level: int = 1) -> None:
        """Every replica sleeps (see `LLM.sleep`); no replica is restarted until the fleet is awake."""
        with self._change:
            self.asleep = True  # first: a restart that catches up now must not bring up an awake replica
            try:
                self._all(self._up(), "sleep", level, down_ok=True)
            finally:
                self._settle_sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        with self._change:
            try:
                self._all(self._up(), "wake_up", tags, down_ok=True)
            finally:
                self._settle_sleep()

    def _settle_sleep(self) -> None:
        """`asleep` as the replicas say: while any sleeps (or none answers), the fleet counts as asleep."""
        statuses = self._call(self._up(), "status", timeout=60)[0]
        self.asleep = any(st["asleep"] for st in statuses.values()) if statuses else self.asleep

    def reset_prefix_cache(self) -> None:
        self._all(self._up(), "reset_prefix_cache", down_ok=True)

    def update_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        """Applies a live config change on every replica (validated here first; replayed on restarted replicas).
        A fleet keeps atomic updates: `weight_transfer_config.atomic` False is refused."""
        sections = live_overrides(self.config, overrides)
        if "weight_transfer_config" in sections:
            _check_atomic(sections["weight_transfer_config"].atomic)
        with self._change:
            self._check_no_session("update_config")
            old = {sec: {name: getattr(getattr(self.config, sec), name) for name in fields}
                   for sec, fields in overrides.items()}
            members = self._up()
            results, errors = self._call(members, "update_config", overrides, timeout=self._rpc_timeout)
            errors = {i: e for i, e in errors.items() if not isinstance(e, ReplicaDown)}
            if errors:  # the replicas that took it go back, so that all of them keep one config
                _, undo = self._call([m for m in members if m.index in results], "update_config", old,
                                     timeout=self._rpc_timeout)
                for index, err in undo.items():
                    self._failed(self.members[index], f"could not undo a config change: {_first_line(err)}")
                index, err = next(iter(errors.items()))
                raise _with_replica(err, index, "update_config")
            apply_overrides(self.config, sections)
            for sec, fields in overrides.items():
                if sec == "model_config":  # the folder is the fleet's to track (`_folder`)
                    fields = {k: v for k, v in fields.items() if k != "model"}
                self._overrides.setdefault(sec, {}).update(fields)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> list[Any]:
        """Runs a Worker method on every worker of every up replica: results in replica, then rank, order."""
        members = self._up()
        results = self._all(members, "collective_rpc", method, tuple(args), kwargs, timeout=timeout)
        return [r for m in members for r in results[m.index]]

    # ---- weights ------------------------------------------------------------------------------------------

    def get_weight_version(self, target: str = "model") -> int:
        """The fleet's version: every routable replica serves it. `target` "draft": the version the draft models
        were last updated for."""
        if target not in ("model", "draft"):
            raise ValueError(f"target must be 'model' or 'draft', got {target!r}")
        return self.draft_version if target == "draft" else self.version

    def get_weight_version_label(self) -> str:
        """The fleet's version as clients see it: the label given to it, or its integer as a string."""
        return self.labels.label(self.version)

    def update_weight_version(self, new_version: int | str, abort_all_requests: bool = False) -> str:
        """Renames the fleet's version on every replica (see `LLM.update_weight_version`); weights and requests
        are untouched unless `abort_all_requests`. Returns the new label."""
        if new_version is None:
            raise ValueError("new_version must be a non-empty label")
        parse_version(new_version, "new_version")
        with self._change:
            self._all(self._up(), "update_weight_version", new_version, abort_all_requests, down_ok=True)
            with self._lock:
                self.labels.set(self.version, str(new_version))
        return self.get_weight_version_label()

    def weight_checksums(self, target: str = "model") -> dict[str, str]:
        """A routable replica's checksums (every routable replica holds the same weights)."""
        try:
            index = self.router.pick(self.routable())
        except RuntimeError as err:
            raise EngineUnavailable(str(err)) from None
        return cast("dict[str, str]", self._all([self.members[index]], "weight_checksums", target)[index])

    def replica_checksums(self, target: str = "model") -> dict[int, dict[str, str]]:
        """Each up replica's checksums, by replica index."""
        return self._all(self._up(), "weight_checksums", target)

    def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Iterable[tuple[str, Any]] | None = None,
        target: str = "model",
        weight_version: VersionArg = None,
    ) -> None:
        """Reloads every replica in place, two-phase: all of them commit one new version (the next, or
        `weight_version`: an integer or a label), or none changes. As for one engine, requests in flight refuse
        it: pause first. With a folder, this also brings the fleet back when no replica holds its version any
        more: the replicas restart from the folder."""
        parse_version(weight_version)
        if target != "model":
            raise ValueError("a fleet reloads the served model's weights (target 'model'); a draft model is "
                             "updated through a session with target 'all'")
        if weights_path is not None and weights_iterator is not None:
            raise ValueError("give weights_path or weights_iterator, not both")
        new_folder = None
        if weights_path is not None:  # a folder of this model, checked before any replica is asked
            new_folder = live_overrides(self.config, {"model_config": {"model": str(weights_path)}})
        ray = _ray()
        with self._change:
            self._check_no_session("reload_weights")
            members = self._current(required=weights_path is None)
            confirmed = True
            if members:
                weights = None if weights_iterator is None else ray.put(list(weights_iterator))
                confirmed = self._two_phase(members, "prepare_reload", weights_path, weights, version=weight_version)
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
                    raise ValueError(f"world_size must be {world}: the trainer's rank(s) before rank_offset={offset} "
                                     f"and {len(members)} replicas x {self.tensor_parallel_size} workers, got "
                                     f"{init_info['world_size']!r}")
                infos = [{**init_info, "rank_offset": offset + k * self.tensor_parallel_size, "world_size": world}
                         for k in range(len(members))]
            connect = 2 * self.config.weight_transfer_config.timeout_s + 30  # the engine's own connect deadline
            _, errors = self._call(members, "init_weight_transfer_engine", timeout=connect,
                                   each=[(info,) for info in infos])
            if errors:
                self._call(self._up(), "shutdown_weight_transfer_engine", timeout=self._rpc_timeout)
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
            self._all(self._up(), "shutdown_weight_transfer_engine", timeout=self._rpc_timeout, down_ok=True)

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
            results, errors = self._call(members, "start_weight_update", target, timeout=self._rpc_timeout)
            if errors:
                self._abort([m for m in members if m.index in results])
                index, err = next(iter(errors.items()))
                raise _with_replica(err, index, "start_weight_update")
            token = secrets.token_hex(16)
            self._session = {"members": members, "token": token}
            return token

    def update_weights(self, update_info: Any, session_token: str | None = None) -> None:
        """One update of the open session on every replica at once; a failure anywhere rolls every replica back
        and ends the session."""
        with self._change:
            members = self._session_members(session_token, "update_weights")
            _, errors = self._call(members, "update_weights", update_info, timeout=self._rpc_timeout)
            if errors:
                self._roll_back(members, errors, "update_weights")

    def finish_weight_update(self, weight_version: VersionArg = None, session_token: str | None = None) -> None:
        """Prepares the session's update on every replica, then commits it on all with one version (the fleet's
        next, or `weight_version`: an integer or a label); if any replica fails to prepare, all roll back."""
        parse_version(weight_version)
        with self._change:
            members = self._session_members(session_token, "finish_weight_update")
            self._session = None
            confirmed = self._two_phase(members, "prepare_weight_update", version=weight_version)
            self._folder_current = False
            if not confirmed:
                raise _no_commit(self.version)

    def abort_weight_update(self, session_token: str | None = None) -> None:
        """Ends the open session on every replica, restoring their weights. An update blocked waiting for its
        trainer is interrupted first, so the abort does not wait for the transport's timeout."""
        session = self._session
        if session is not None and (session_token is None or session_token == session["token"]):
            for member in session["members"]:
                with contextlib.suppress(Exception):
                    member.actor.interrupt_transfer.remote()
        with self._change:
            if self._session is None:
                return
            if session_token is not None and session_token != self._session["token"]:
                raise RuntimeError("this weight-update session belongs to another caller (its session_token differs)")
            members = self._session["members"]
            self._session = None
            self._abort(members)

    def _check_no_session(self, method: str) -> None:
        if self._session is not None:
            raise RuntimeError(f"{method}() while a fleet weight-update session is open; finish or abort it first")

    def _current(self, required: bool = True) -> list[_Member]:
        """The replicas a weight change runs on: up and holding the fleet's version. With `required`, raises
        EngineUnavailable when there is none."""
        with self._lock:
            members = [m for m in self.members if m.state == "up" and m.version == self.version]
        if not members and required:
            raise EngineUnavailable("no replica holds the fleet's weights now (all are down or restarting); a "
                                    "reload from a checkpoint folder brings the fleet back")
        return members

    def _session_members(self, session_token: str | None, method: str) -> list[_Member]:
        if self._session is None:
            raise RuntimeError(f"{method}() without an open session; call start_weight_update() first")
        if session_token is not None and session_token != self._session["token"]:
            raise RuntimeError("this weight-update session belongs to another caller (its session_token differs)")
        members: list[_Member] = self._session["members"]
        return members

    def _abort(self, members: Sequence[_Member]) -> None:
        """Rolls back the open change on `members`; one that cannot is replaced (its weights are unknown)."""
        live = [m for m in members if m.state == "up"]
        _, errors = self._call(live, "abort_weight_update", timeout=self._rpc_timeout)
        for index, err in errors.items():
            self._failed(self.members[index], f"its rollback failed ({type(err).__name__}: {_first_line(err)})")

    def _roll_back(self, members: list[_Member], errors: dict[int, BaseException], method: str) -> None:
        """After `method` failed on some replicas: every other one aborts (restoring its weights); raises."""
        self._session = None
        self._abort([m for m in members if m.index not in errors])
        with self._lock:
            self.counters["updates_failed"] += 1
        index, err = next(iter(errors.items()))
        if isinstance(err, (ValueError, TypeError)):
            raise _with_replica(err, index, method)
        message = (f"replica {index} failed in {method}() ({type(err).__name__}: {_first_line(err)}); every replica "
                   f"was rolled back and the fleet serves version {self.version}")
        if all(isinstance(e, TimeoutError) and not isinstance(e, ReplicaDown) for e in errors.values()):
            raise TimeoutError(message) from err  # e.g. a trainer that stopped sending
        raise FleetUpdateFailed(message) from err

    def _two_phase(self, members: list[_Member], prepare: str, *args: Any, version: VersionArg = None) -> bool:
        """Prepares on every member, then commits all with one version, or rolls all back (and raises). Returns
        whether any replica confirmed its commit (if none did, the fleet is at the new version with no replica
        holding it: the caller records where it came from, then raises `_no_commit`)."""
        try:
            _, errors = self._call(members, prepare, *args, timeout=self._rpc_timeout)
        except BaseException:
            self._abort(members)
            raise
        if errors:
            self._roll_back(members, errors, prepare)
        number, label = parse_version(version)
        proposed = self.version + 1 if number is None else number
        results, errors = self._call(members, "commit_weight_update", proposed, label, timeout=self._rpc_timeout)
        for index, err in errors.items():  # the decision is made: a replica that cannot commit is replaced
            self._failed(self.members[index], f"its commit failed ({type(err).__name__}: {_first_line(err)})")
        pairs = [tuple(r) for r in results.values()]  # (model version, draft version) as the commits left them
        agreed = max(set(pairs), key=pairs.count) if pairs else (proposed, self.draft_version)
        odd = []
        with self._lock:
            if agreed[0] == proposed:
                self.labels.set(proposed, label)
            self.version, self.draft_version = agreed
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
                        if status["workers_problem"]:  # a dead worker process; invalid weights are no reason
                            self._failed(member, f"unhealthy: {status['workers_problem']}", member.ping_actor)
                member.ping = None
            elif time.monotonic() - member.ping_sent > self._health_timeout:
                member.ping = None
                self._failed(member, f"no answer to a health check within {self._health_timeout:g} s",
                             member.ping_actor)
        if not self._restart or self.asleep:
            return
        for member in list(self.members):
            with self._lock:
                due = member.state == "down" and time.monotonic() >= member.retry_at
                if due:
                    member.state, member.ping = "starting", None
                    folder, generation = self._folder, self._folder_generation
            if due and not self._stopping.is_set():
                threading.Thread(target=self._replace, args=(member, folder, generation), daemon=True,
                                 name=f"hotswap-fleet-restart-{member.index}").start()

    def _replace(self, member: _Member, folder: str, generation: int) -> None:
        """Starts a new actor for a dead replica (loading `folder`, the fleet's last) and, holding the change lock
        outside any session, brings it to the fleet's state: its config changes, its version (the folder's when
        it alone holds it, else a copy of a live replica's weights), its transport, its pause. Only then is it
        routed to. A failure leaves it down, retried with a growing delay."""
        ray = _ray()
        actor = None
        try:
            new = self._spawn(member.index, folder, member.placement_group)
            actor = new.actor
            ray.get(actor.status.remote(), timeout=self._start_timeout)
            with self._change:
                while self._session is not None:  # a session holds no lock between its calls: wait for its end
                    self._change.release()
                    try:
                        if self._stopping.wait(0.05):
                            raise RuntimeError("the fleet is shutting down")
                    finally:
                        self._change.acquire()
                if self.asleep:  # it would hold the memory a sleep released; it comes back once the fleet wakes
                    raise RuntimeError("the fleet fell asleep while this replica restarted")
                if self._overrides:
                    ray.get(actor.update_config.remote(self._overrides), timeout=self._rpc_timeout)
                if self._folder_current and self._folder_generation == generation:
                    ray.get(actor.set_weight_version.remote(self.version, self.draft_version, self.labels.snapshot()),
                            timeout=60)
                    restored = "folder"
                else:
                    self._copy_weights(actor)
                    restored = "copy"
                if self._transport is not None:
                    ray.get(actor.init_weight_transfer_engine.remote(self._transport), timeout=self._rpc_timeout)
                if self.paused:
                    ray.get(actor.pause_generation.remote(self.pause_mode, True), timeout=self._rpc_timeout)
                status = ray.get(actor.status.remote(), timeout=60)
                with self._lock:
                    member.actor, member.version, member.error, member.status = actor, self.version, None, status
                    member.state, member.backoff, member.restored_from = "up", 0.0, restored
                    member.restarts += 1
                    self.counters["replica_restarts"] += 1
            logger.warning("fleet replica %d is back at version %d (%s)", member.index, self.version, restored)
        except Exception as err:
            with self._lock:
                member.backoff = min(60.0, max(1.0, 2 * member.backoff))
                member.state, member.error = "down", f"restart failed: {_first_line(err)}"
                member.retry_at = time.monotonic() + member.backoff
            logger.warning("fleet replica %d did not come back: %s", member.index, _first_line(err))
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)

    def _copy_weights(self, actor: Any) -> None:
        """Copies a live replica's weights (at the fleet's version) into `actor` and checks their checksums."""
        ray = _ray()
        source = None if self.asleep else next(
            (m for m in self.members if m.state == "up" and m.version == self.version), None)
        if source is None:
            raise RuntimeError(f"no live replica holds version {self.version} and no checkpoint folder does; "
                               "reload the fleet from a folder to bring replicas back")
        states = source.actor.export_weights.remote()
        ray.get(actor.adopt_weights.remote(states, self.version, self.draft_version, self.labels.snapshot()),
                timeout=self._start_timeout)
        which = "all" if self.config.draft_model_config is not None else "model"
        theirs, mine = ray.get([source.actor.weight_checksums.remote(which), actor.weight_checksums.remote(which)],
                               timeout=self._start_timeout)
        if theirs != mine:
            raise RuntimeError("the copied weights' checksums differ from the source replica's")

    def health_problem(self) -> str | None:
        """Why the fleet cannot serve (no routable replica), or None; answers at once."""
        if self.routable():
            return None
        with self._lock:
            reasons = "; ".join(f"replica {m.index} {m.state}" + (f" ({m.error})" if m.error else "")
                                for m in self.members)
        return f"no replica can serve: {reasons}"

    def replica_status(self) -> list[dict[str, Any]]:
        """Per replica: index, state, version, routable, restarts, error, and its last health report."""
        with self._lock:
            routable = {m.index for m in self.members if m.state == "up" and m.version == self.version}
            return [{"index": m.index, "state": m.state, "weight_version": self.labels.label(m.version),
                     "version_id": m.version, "routable": m.index in routable,
                     "restarts": m.restarts, "restored_from": m.restored_from, "error": m.error,
                     "routed": self.router.routed.get(m.index, 0),
                     "outstanding_tokens": self.router.outstanding(m.index), **{"status": dict(m.status)}}
                    for m in self.members]

    def stats(self) -> dict[str, Any]:
        """The replicas' engine statistics summed, with the fleet's own."""
        totals: dict[str, Any] = {}
        with self._lock:
            members = list(self.members)
        for m in members:
            if m.state != "up":
                continue
            for key, value in (m.status.get("stats") or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key.startswith("num_"):
                    totals[key] = totals.get(key, 0) + value
        fleet = {"replicas": len(members), "replicas_up": len(self.routable()), "weight_version": self.version,
                 **self.counters}
        return {**totals, **{f"fleet_{k}": v for k, v in fleet.items()}}

    def shutdown(self) -> None:
        """Stops the monitor and every replica, and releases their placement groups."""
        ray = _ray()
        self._stopping.set()
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=5)
        from ray.util.placement_group import remove_placement_group

        for member in getattr(self, "members", []):
            with contextlib.suppress(Exception):
                ray.get(member.actor.shutdown.remote(), timeout=10)
            with contextlib.suppress(Exception):
                ray.kill(member.actor, no_restart=True)
            with contextlib.suppress(Exception):
                remove_placement_group(member.placement_group)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _no_commit(version: int) -> ReplicaDown:
    return ReplicaDown(f"every replica failed while committing version {version}; restarted replicas are brought "
                       "to it where a folder or a live replica holds it (else reload the fleet from a folder)")


def _check_atomic(atomic: bool) -> None:
    if not atomic:
        raise ValueError("a fleet needs weight_transfer_config.atomic True: rolling every replica back needs each "
                         "one's rollback copies")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _cause(err: BaseException) -> BaseException:
    """The exception a replica's method raised, out of Ray's wrapper (RayTaskError.cause)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


def _with_replica(err: BaseException, index: int, method: str) -> BaseException:
    """`err` as the caller should see it, naming the replica: user errors (ValueError, TypeError, RuntimeError for
    a wrong order, TimeoutError) and EngineUnavailable (a replica down) keep their type; the original is the
    cause."""
    new: BaseException = RuntimeError(f"replica {index} failed in {method}(): {type(err).__name__}: {err}")
    for kind in (ReplicaDown, FleetUpdateFailed, WeightUpdateFailed, EngineUnavailable, ValueError, TypeError,
                 TimeoutError, RuntimeError):
        if isinstance(err, kind):
            new = err if str(err).startswith(f"replica {index}") else kind(f"replica {index}: {err}")
            break
    if new is not err:
        new.__cause__ = err
    return new
