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

LoRA adapters change the same way, on every replica that holds the fleet's version or on none, without pausing
(see `load_lora_adapter`): a load (`prepare_lora_adapter` on each replica, then `commit_lora_adapter` on all, else
`abort_lora_adapter` where it was prepared), `reload_weights(target="lora:<name>")`, and a transfer session with
target "lora:<name>" (two-phase through prepare_weight_update / commit, as the model's). An adapter a request names
for the first time is loaded on every replica before the request is routed.

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
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch

from hotswap.config import apply_overrides, live_overrides
from hotswap.engine.lora_updates import lora_target
from hotswap.errors import EngineBusy, EngineUnavailable, EngineUnresponsive
from hotswap.fleet.replicas import (
    FleetReplicas,
    FleetUpdateFailed,
    ReplicaDown,
    _cause,
    _check_atomic,
    _first_line,
    _Member,
    _no_commit,
    _ray,
    _with_replica,
)
from hotswap.fleet.router import request_cost
from hotswap.inputs import PromptType, chat_prompts, per_prompt, per_prompt_lora, stage
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams
from hotswap.weights.delta import is_delta
from hotswap.weights.target import check_target
from hotswap.weights.version import VersionArg, parse_version

logger = logging.getLogger(__name__)


class Fleet(FleetReplicas):
    """N replicas of one model behind a router, with `LLM`'s methods (generate, chat, the weight lifecycle,
    pause/resume, sleep) applied fleet-wide.

    `engine_kwargs` are `LLM`'s keyword arguments, given to every replica; they are validated here first (a bad
    one raises before any actor starts). `num_cpus_per_worker` / `num_gpus_per_worker` size each worker's share
    of the placement group (GPU: default 1 where CUDA is configured, else 0)."""

    # ---- requests -----------------------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.tokenizer

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

    # ---- LoRA adapters ------------------------------------------------------------------------------------

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
            members, "prepare_lora_adapter", lora_name, lora_path, load_inplace, ref, peft_config, lora_int_id, pinned
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
            results, errors = self._call(members, "unload_lora_adapter", lora_name, timeout=self._rpc_timeout)
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
            "list[dict[str, Any]]", self._all(members[:1], "list_loras", timeout=self._rpc_timeout)[members[0].index]
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

    def _lora_two_phase(self, members: list[_Member], prepare: str, lora_name: str, *args: Any) -> dict[str, Any]:
        """`prepare` (prepare_lora_adapter, prepare_lora_reload) of adapter `lora_name` on every member, then
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
                raise _with_replica(err, index, prepare)
            raise FleetUpdateFailed(
                f"replica {index} failed in {prepare}() ({type(err).__name__}: {_first_line(err)}); every replica "
                f"dropped the new version: LoRA adapter {lora_name!r} is unchanged"
            ) from err
        results, errors = self._call(members, "commit_lora_adapter", lora_name, timeout=self._rpc_timeout)
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
        _, errors = self._call(live, "abort_lora_adapter", lora_name, timeout=self._rpc_timeout)
        for index, err in errors.items():
            self._failed(self.members[index], f"its LoRA rollback failed ({type(err).__name__}: {_first_line(err)})")

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
            old = {
                sec: {name: getattr(getattr(self.config, sec), name) for name in fields}
                for sec, fields in overrides.items()
            }
            members = self._up()
            results, errors = self._call(members, "update_config", overrides, timeout=self._rpc_timeout)
            errors = {i: e for i, e in errors.items() if not isinstance(e, ReplicaDown)}
            if errors:  # the replicas that took it go back, so that all of them keep one config
                _, undo = self._call(
                    [m for m in members if m.index in results], "update_config", old, timeout=self._rpc_timeout
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
        results = self._all(members, "collective_rpc", method, tuple(args), kwargs, timeout=timeout)
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
            self._reload_lora(lora, weights_path, weights_iterator, weight_version, encoding, base_version, checksums)
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
                    "prepare_reload",
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

    def _reload_lora(
        self,
        lora_name: str,
        weights_path: str | None,
        weights_iterator: Iterable[tuple[str, Any]] | None,
        weight_version: VersionArg,
        encoding: str | None,
        base_version: VersionArg,
        checksums: dict[str, str] | None,
    ) -> None:
        """`reload_weights(target="lora:<name>")`: prepare_lora_reload on every replica, then commit (or abort)."""
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
            description = self._lora_two_phase(
                members, "prepare_lora_reload", lora_name, weights_path, weights, encoding, base_version, checksums
            )
            if weights_path is not None:  # the folder holds this version whole
                self._record_lora(description, {"tensors": None, "peft_config": None, "current": True})
            else:
                with self._lock:
                    record = self._loras.get(lora_name)
                if record is not None:
                    self._record_lora(
                        description, {**{k: record[k] for k in ("tensors", "peft_config")}, "current": False}
                    )

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
                members, "init_weight_transfer_engine", timeout=connect, each=[(info,) for info in infos]
            )
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
            self._session = {"members": members, "token": token, "target": target}
            return token

    def update_weights(self, update_info: Any, session_token: str | None = None) -> None:
        """One update of the open session on every replica at once; a failure anywhere rolls every replica back
        and ends the session."""
        with self._change:
            members = self._session_members(session_token, "update_weights")
            _, errors = self._call(members, "update_weights", update_info, timeout=self._rpc_timeout)
            if errors:
                self._roll_back(members, errors, "update_weights")

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
            lora = lora_target(self._session["target"])
            if lora is not None and (weight_version is not None or canary is not None):
                raise ValueError("weight_version and canary apply to the model; a LoRA update takes neither")
            self._session = None
            confirmed = self._two_phase(
                members, "prepare_weight_update", None, canary, version=weight_version, versioned=lora is None
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

    def check_liveness(self, timeout_s: float = 5.0) -> float:
        """Every routable replica's `check_liveness` at once; returns the seconds it took. Raises EngineBusy when
        no replica answered because admin calls held them, EngineUnresponsive when no replica answered in time
        (naming each one's reason); a replica that did not answer at all is marked down and restarted, as for
        any call."""
        start = time.monotonic()
        members = self._current(required=False)
        if not members:
            raise EngineUnresponsive(f"no replica is routable: {self.health_problem()}")
        results, errors = self._call(members, "check_liveness", timeout_s, timeout=timeout_s + 1.0)
        if not results and any(isinstance(e, EngineBusy) for e in errors.values()):
            raise EngineBusy("; ".join(f"replica {i}: {_first_line(e)}" for i, e in sorted(errors.items())))
        if not results:
            reasons = "; ".join(f"replica {i}: {_first_line(e)}" for i, e in sorted(errors.items()))
            raise EngineUnresponsive(f"no replica answered a liveness round trip within {timeout_s:g} s ({reasons})")
        return time.monotonic() - start

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
        message = (
            f"replica {index} failed in {method}() ({type(err).__name__}: {_first_line(err)}); every replica "
            f"was rolled back and the fleet serves version {self.version}"
        )
        if all(isinstance(e, TimeoutError) and not isinstance(e, ReplicaDown) for e in errors.values()):
            raise TimeoutError(message) from err  # e.g. a trainer that stopped sending
        raise FleetUpdateFailed(message) from err

    def _two_phase(
        self, members: list[_Member], prepare: str, *args: Any, version: VersionArg = None, versioned: bool = True
    ) -> bool:
        """Prepares on every member, then commits all with one version (not `versioned`: an adapter's change,
        which numbers its own), or rolls all back (and raises). Returns
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
        results, errors = self._call(
            members, "commit", *((proposed, label) if versioned else (None, None)), timeout=self._rpc_timeout
        )
        for index, err in errors.items():  # the decision is made: a replica that cannot commit is replaced
            self._failed(self.members[index], f"its commit failed ({type(err).__name__}: {_first_line(err)})")
        # (model version, draft version, the model version's label) as the commits left them: the fleet takes the
        # replicas' own (a draft-only session leaves the model's version and label as they were)
        states = [tuple(r) for r in results.values()]
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
