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

The weight changes are in hotswap/fleet/changes.py (`FleetChanges`), the LoRA adapters in hotswap/fleet/loras.py
(`FleetLoRAs`), the replicas' lives in hotswap/fleet/replicas.py (`FleetReplicas`): `Fleet` is all of them.

A replica is routable only while it is up and holds the fleet's version. A replica that dies (its actor dies,
or it does not answer a health check within `health_check_timeout_s`) leaves routing at once, is restarted by
the fleet in its placement group, brought to the fleet's version (from the checkpoint folder when the version
came from one, else copied from a live replica and checked against its checksums) and given the fleet's LoRA
adapters (copied from a live replica) outside any weight change, paused if the fleet is, and only then routed to
again.

Replicas join and leave a running fleet (`add_replicas`, `remove_replicas`) between weight changes: a new one
is brought to the fleet's state as a restarted one is (its checksums checked against a live replica's, a folder's
load included) before it is routable; one that leaves is out of routing at once, drains its requests, and is
stopped once no update session that included it is open.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from hotswap.config import apply_overrides, live_overrides
from hotswap.engine.client import EngineStatus
from hotswap.errors import EngineBusy, EngineUnavailable, EngineUnresponsive
from hotswap.fleet.loras import FleetLoRAs
from hotswap.fleet.replica import ReplicaServer as Replica
from hotswap.fleet.replicas import ReplicaDown, _cause, _check_atomic, _first_line, _Member, _ray, _with_replica
from hotswap.fleet.router import request_cost
from hotswap.inputs import PromptType, Tokenizer, chat_prompts, per_prompt, per_prompt_lora, stage
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams
from hotswap.weights.target import check_target
from hotswap.weights.version import parse_version

logger = logging.getLogger(__name__)


class Fleet(FleetLoRAs):
    """N replicas of one model behind a router, with `LLM`'s methods (generate, chat, the weight lifecycle,
    pause/resume, sleep) applied fleet-wide.

    `engine_kwargs` are `LLM`'s keyword arguments, given to every replica; they are validated here first (a bad
    one raises before any actor starts). `num_cpus_per_worker` / `num_gpus_per_worker` size each worker's share
    of the placement group (GPU: default 1 where CUDA is configured, else 0)."""

    # ---- requests -----------------------------------------------------------------------------------------

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def status(self) -> EngineStatus:
        """The fleet's state now: its own versions, pause, sleep and open change, and its up replicas' figures
        as of their last health check (a draft is stale while any replica's is; requests are those routed)."""
        statuses = [m.status for m in self.members if m.state == "up" and m.status is not None]
        return EngineStatus(
            weight_version=self.version,
            weight_version_label=self.labels.label(self.version),
            draft_weight_version=self.draft_version,
            draft_weight_version_label=self.labels.label(self.draft_version),
            draft_stale=any(s.draft_stale for s in statuses),
            paused=self.paused,
            pause_mode=self.pause_mode,
            refusing_new_requests=self.pausing and self.pause_mode in ("abort", "wait"),
            asleep=self.asleep,
            health_problem=self.health_problem(),
            requests=len(self.router.in_flight()),
            running=sum(s.running for s in statuses),
            waiting=sum(s.waiting for s in statuses),
            stats=self.stats(),
            change=self._session,
        )

    def next_request_id(self) -> str:
        return f"fleet-{next(self._ids)}"

    def prepare_prompt(self, prompt: PromptType) -> dict[str, Any]:
        """The prompt as replicas take it, tokenized once here: {"prompt", "prompt_token_ids", "cache_salt"?}."""
        return stage(prompt, self.tokenizer).as_dict()

    def route(
        self,
        prompt: dict[str, Any],
        params: SamplingParams,
        request_id: str,
        key: str | None = None,
        avoid: Iterable[int] = (),
    ) -> _Member:
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """As `LLM.generate`: outputs in prompt order, spread over the replicas (a replica that dies meanwhile
        has its prompts generated again by the others). `lora_request`: the adapter for all prompts, or one (or
        None) per prompt; one the fleet has not loaded is loaded on every replica first (`resolve_loras`).

        Never blocks for ever: a paused fleet refuses a new call at once (`EngineUnavailable`: resume first), and a
        replica that has not returned its outputs within `request_timeout_s` (one paused meanwhile in 'keep' mode,
        say) raises `TimeoutError` naming it; its requests are cancelled."""
        ray = _ray()
        if self.paused or self.pausing:
            raise EngineUnavailable(f"the fleet is paused ({self.pause_mode!r}); call resume_generation() first")
        prompts, params_list = per_prompt(prompts, sampling_params)
        loras = per_prompt_lora(lora_request, len(prompts))
        staged = [self.prepare_prompt(p) for p in prompts]
        loras = self.resolve_loras(loras)
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
                        [staged[i] for i, _ in group],
                        [params_list[i] for i, _ in group],
                        [r for _, r in group],
                        [loras[i] for i, _ in group],
                    )
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
                            f"{self._request_timeout:g} s (request_timeout_s); paused={self.paused}"
                        ) from None
                    except ray.exceptions.RayTaskError as err:
                        raise _cause(err) from None
                    except ray.exceptions.RayError as err:  # the replica died: its prompts go to the others
                        self._failed(
                            self.members[index], f"it failed while generating: {_first_line(err)}", actors[index]
                        )
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

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        prompts = chat_prompts(self.tokenizer, messages, add_generation_prompt, chat_template)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    # ---- pause, resume, sleep, config ------------------------------------------------------------------------

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pauses every replica (modes as `LLM.pause_generation`; 'wait' returns once every replica drained). A
        replica restarted while the fleet is paused is paused the same way before it is routed to."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        with self._change:
            with self._lock:
                self.pausing, self.pause_mode = True, mode
            self._all(self._up(), Replica.pause_generation, mode, clear_cache, down_ok=True)
            self.paused = True

    def resume_generation(self) -> None:
        with self._change:
            with self._lock:
                self.paused = self.pausing = False
            self._all(self._up(), Replica.resume_generation, down_ok=True)

    def is_paused(self) -> bool:
        return self.paused

    def sleep(self, level: int = 1) -> None:
        """Every replica sleeps (see `LLM.sleep`); no replica is restarted until the fleet is awake."""
        with self._change:
            self.asleep = True  # first: a restart that catches up now must not bring up an awake replica
            try:
                self._all(self._up(), Replica.sleep, level, down_ok=True)
            finally:
                self._settle_sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        with self._change:
            try:
                self._all(self._up(), Replica.wake_up, tags, down_ok=True)
            finally:
                self._settle_sleep()

    def _settle_sleep(self) -> None:
        """`asleep` as the replicas say: while any sleeps (or none answers), the fleet counts as asleep."""
        statuses = self._call(self._up(), Replica.status, timeout=60)[0]
        self.asleep = any(st.asleep for st in statuses.values()) if statuses else self.asleep

    def reset_prefix_cache(self) -> None:
        self._all(self._up(), Replica.reset_prefix_cache, down_ok=True)

    def update_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        """Applies a live config change on every replica (validated here first; replayed on restarted replicas).
        A fleet keeps atomic updates: `weight_transfer_config.atomic` False is refused."""
        sections = live_overrides(self.config, overrides)
        if "weight_transfer_config" in sections:
            _check_atomic(sections["weight_transfer_config"].atomic)
        with self._change:
            self._check_no_session("update_config")
            old = {
                sec: {name: getattr(getattr(self.config, sec), name) for name in fields}
                for sec, fields in overrides.items()
            }
            members = self._up()
            results, errors = self._call(members, Replica.update_config, overrides, timeout=self._rpc_timeout)
            errors = {i: e for i, e in errors.items() if not isinstance(e, ReplicaDown)}
            if errors:  # the replicas that took it go back, so that all of them keep one config
                _, undo = self._call(
                    [m for m in members if m.index in results], Replica.update_config, old, timeout=self._rpc_timeout
                )
                for index, err in undo.items():
                    self._failed(self.members[index], f"could not undo a config change: {_first_line(err)}")
                index, err = next(iter(errors.items()))
                raise _with_replica(err, index, "update_config")
            apply_overrides(self.config, sections)
            for sec, fields in overrides.items():
                if sec == "model_config":  # the folder is the fleet's to track (`_folder`)
                    fields = {k: v for k, v in fields.items() if k != "model"}
                self._overrides.setdefault(sec, {}).update(fields)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Runs a Worker method on every worker of every up replica: results in replica, then rank, order."""
        members = self._up()
        results = self._all(members, Replica.collective_rpc, method, tuple(args), kwargs, timeout=timeout)
        return [r for m in members for r in results[m.index]]

    # ---- weights ------------------------------------------------------------------------------------------

    def get_weight_version(self, target: str = "model") -> int:
        """The fleet's version: every routable replica serves it. `target` "draft": the version the draft models
        were last updated for."""
        check_target(target, ("model", "draft"))
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
            self._all(self._up(), Replica.update_weight_version, new_version, abort_all_requests, down_ok=True)
            with self._lock:
                self.labels.set(self.version, str(new_version))
        return self.get_weight_version_label()

    def weight_checksums(self, target: str = "model") -> dict[str, str]:
        """A routable replica's checksums (every routable replica holds the same weights)."""
        try:
            index = self.router.pick(self.routable())
        except RuntimeError as err:
            raise EngineUnavailable(str(err)) from None
        return cast("dict[str, str]", self._all([self.members[index]], Replica.weight_checksums, target)[index])

    def replica_checksums(self, target: str = "model") -> dict[int, dict[str, str]]:
        """Each up replica's checksums, by replica index."""
        return self._all(self._up(), Replica.weight_checksums, target)

    def check_liveness(self, timeout_s: float = 5.0) -> float:
        """Every routable replica's `check_liveness` at once; returns the seconds it took. Raises EngineBusy when
        no replica answered because admin calls held them, EngineUnresponsive when no replica answered in time
        (naming each one's reason); a replica that did not answer at all is marked down and restarted, as for
        any call."""
        start = time.monotonic()
        members = self._current(required=False)
        if not members:
            raise EngineUnresponsive(f"no replica is routable: {self.health_problem()}")
        results, errors = self._call(members, Replica.check_liveness, timeout_s, timeout=timeout_s + 1.0)
        if not results and any(isinstance(e, EngineBusy) for e in errors.values()):
            raise EngineBusy("; ".join(f"replica {i}: {_first_line(e)}" for i, e in sorted(errors.items())))
        if not results:
            reasons = "; ".join(f"replica {i}: {_first_line(e)}" for i, e in sorted(errors.items()))
            raise EngineUnresponsive(f"no replica answered a liveness round trip within {timeout_s:g} s ({reasons})")
        return time.monotonic() - start
