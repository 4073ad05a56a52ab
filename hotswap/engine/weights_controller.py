"""The one owner of the engine's weight changes: the transfer session (its token, target and last declaration), a
change prepared for a two-phase commit, the weight versions and their labels, and whether every worker's weights
are valid. `LLMEngine` steps requests; everything that changes weights goes through `engine.weights`.

    (no session) --start_weight_update()--> SESSION --update_weights()*--> SESSION
    SESSION --finish_weight_update()--> committed: new version, prefix cache invalidated --> (no session)
    SESSION --prepare_weight_update()--> PREPARED --commit_weight_update()--> committed --> (no session)
    (no session) --prepare_reload()--> PREPARED;  reload_weights() = prepare + commit in one call
    any failure, abort_weight_update() --> rolled back on every worker --> (no session)

The engine is UPDATING (no step runs) from start_weight_update / prepare_reload until the session ends.
"""

from __future__ import annotations

import itertools
import secrets
import time
from typing import Any, Literal, Protocol, cast

import torch

from hotswap.config import EngineConfig, apply_overrides, live_overrides
from hotswap.engine.block_manager import BlockManager
from hotswap.engine.canary import Canary
from hotswap.engine.lora_updates import LoRAUpdates, lora_target
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.sequence import Request
from hotswap.engine.state import EngineState
from hotswap.executor.base import Executor
from hotswap.weights.delta import is_delta
from hotswap.weights.target import WeightTarget, check_target
from hotswap.weights.version import VersionArg, VersionLabels, parse_version


class EngineHooks(Protocol):
    """What the controller reads and moves of its engine (`LLMEngine` has it): the workers, the config, the
    scheduler and KV cache it must leave consistent, and the engine state machine."""

    executor: Executor
    config: EngineConfig
    scheduler: Scheduler
    block_manager: BlockManager
    requests: dict[str, Request]
    released: set[str]
    state: EngineState

    def reset_prefix_cache(self, force: bool = False) -> None: ...

    def serving_state(self) -> EngineState: ...

    def enter_state(self, state: EngineState) -> None: ...

    def leave_state(self, state: EngineState) -> None: ...

    def is_asleep(self) -> bool: ...

    def score_probes(self, probes: list[list[int]]) -> list[list[float]]: ...


# the worker methods of a transfer session that `_session_rpc` runs
SessionMethod = Literal[
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "abort_weight_update",
    "shutdown_weight_transfer_engine",
]


class WeightsController:
    """Changes the weights of every worker of `engine` together (all of them or none), and keeps the versions."""

    def __init__(self, engine: EngineHooks) -> None:
        self.engine = engine
        self.executor = engine.executor
        self.config = engine.config
        self.version = 0  # orders versions; the label a client gave is kept beside it
        self.labels = VersionLabels()
        # the speculative draft's version is the target version it was last updated for: stale while they differ
        self.draft_version = 0
        self.valid = True  # every worker's weights, as of the last weight change
        self.token: str | None = None  # of the open update session
        self.target: WeightTarget = "model"
        self.last_update_info: dict[str, Any] | None = None  # the declaration an empty one repeats
        # a prepared (phase-one) change awaiting commit_weight_update(): ("session" | "reload", folder or None)
        self.prepared: tuple[str, str | None] | None = None
        self.connect_deadline = 0.0  # monotonic time by which a transport being connected must be ready
        self.receiving: Literal["update", "reload", "lora"] | None = None  # a change being received in slices
        self.staged_lora: Any = None  # the adapter version a sliced LoRA reload prepares (lora_registry.Prepared)
        self.received = False  # the change being received has all arrived; its commit is next
        self.staged_lora_packed = False  # the adapter version being received has its packs (its commit is next)
        self.staged_reload: tuple[str | None, VersionArg] | None = None  # its folder to record, its version
        self._salts = itertools.count(1)  # prefix-cache salts: private, never reused (unlike user versions)

    @property
    def staged(self) -> bool:
        """Whether updates are staged (`update_staging="shadow"`): received beside the served weights while
        requests keep generating, committed between two steps."""
        return self.config.weight_transfer_config.update_staging == "shadow"

    @property
    def draft_stale(self) -> bool:
        """Whether the target was updated after the draft model (never, without one)."""
        return self.config.speculative_config.uses_draft and self.draft_version != self.version

    def next_salt(self) -> int:
        return next(self._salts)

    def _end(self) -> None:
        """The session (or prepared change) is over: the engine leaves UPDATING."""
        self.token = None
        self.prepared = None
        self.engine.leave_state(EngineState.UPDATING)

    def _lora(self) -> LoRAUpdates:
        updates = getattr(self.engine, "lora_updates", None)
        if updates is None:
            raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True")
        return cast(LoRAUpdates, updates)

    def _lora_open(self) -> bool:
        """Whether the open session updates a LoRA adapter."""
        updates = getattr(self.engine, "lora_updates", None)
        return updates is not None and updates.open is not None

    def check_can_change(self, method: str) -> None:
        """Raises RuntimeError unless a weight change may start now: nothing prepared awaits its commit, and no
        request is being generated (pause first)."""
        if self.prepared is not None:
            raise RuntimeError(
                f"{method}() while a prepared change awaits commit_weight_update() or abort_weight_update()"
            )
        if self.receiving is not None:
            raise RuntimeError(f"{method}() while a staged {self.receiving} is being received")
        scheduler = self.engine.scheduler
        if self.staged:
            return  # the served weights change only at the commit, between two steps
        if self.engine.serving_state().steps and scheduler.num_in_flight() + len(scheduler.running):
            raise RuntimeError(
                f"{method}() while {len(self.engine.requests)} request(s) are being generated; call "
                "pause_generation() first (or let them finish)"
            )

    def _session_rpc(self, method: SessionMethod, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs a transfer-session method on every worker (reloads, config changes and finish have methods of their
        own) and moves the engine state with it. A failed update ends the session on every rank (rolled back in
        atomic mode). Calls that may have changed the served weights invalidate the prefix cache, even when they
        fail."""
        if method == "start_weight_update":
            self.check_can_change(method)
        changed = method == "update_weights" and not self.staged  # staged: the served weights are untouched
        ok = False
        try:
            result = self.executor.collective_rpc(method, args, kwargs)
            changed = changed or (method == "abort_weight_update" and any(result) and not self.staged)
            ok = True
        except BaseException:
            if method == "update_weights":
                try:
                    self._abort_on_every_rank()
                finally:
                    self._end()
            raise
        finally:
            if changed:
                self._weights_changed(failed=not ok)
        if method == "start_weight_update" and not self.staged:
            self.engine.enter_state(EngineState.UPDATING)
        elif method in ("abort_weight_update", "shutdown_weight_transfer_engine"):
            self._end()
        return result

    def begin_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Creates the receiving side of a transport on every worker without waiting for its trainer; the caller
        polls `weight_transfer_ready` (between steps, with its lock released in between), bounded by the
        transport's timeout."""
        self._session_rpc("init_weight_transfer_engine", init_info)
        # the store connection and the group's rendezvous may each take up to timeout_s
        self.connect_deadline = time.monotonic() + 2 * self.config.weight_transfer_config.timeout_s + 10

    def weight_transfer_ready(self) -> bool:
        """Whether every worker's transport has connected. If one failed (or the engine-side deadline passed),
        every worker drops its transport and the error is raised: init_weight_transfer_engine() again."""
        try:
            ready = all(self.executor.collective_rpc("weight_transfer_ready"))
            if not ready and time.monotonic() > self.connect_deadline:
                raise TimeoutError("the weight transfer engine did not connect to its trainer in time")
        except BaseException:
            self.executor.collective_rpc("shutdown_weight_transfer_engine")  # ranks still connecting drop theirs
            raise
        return ready

    def start_weight_update(self, target: str = "model") -> str:
        """Opens an update session on every worker and returns its token: calls that carry another token are
        refused (a second trainer cannot feed, finish or abort this one's session); calls without a token are
        accepted, as clients of the vLLM API send none. `target`: "model", "draft" (the speculative draft alone)
        or "all" (both, committed or rolled back together)."""
        name = lora_target(target)
        if name is not None:  # an adapter's next version, loaded beside the served one: nothing pauses
            if self.token is not None:
                raise RuntimeError("a weight-update session is open; finish or abort it first")
            self._lora().start(name)
            self.token = secrets.token_hex(16)
            return self.token
        checked = check_target(target)  # before any worker is asked
        self._session_rpc("start_weight_update", checked)
        self.target = checked
        self.token = secrets.token_hex(16)
        return self.token

    def check_session(self, session_token: str | None, ending: bool = False) -> None:
        """Raises RuntimeError when `session_token` names a session other than the open one. `ending` (an abort):
        with no session open there is nothing to protect, whatever the token."""
        if ending and self.token is None:
            return
        if session_token is not None and session_token != self.token:
            raise RuntimeError(
                "this weight-update session belongs to another caller (its session_token differs); wait for it, "
                "or abort it without a token"
            )

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], session_token: str | None = None, sliced: bool = False
    ) -> None:
        """One update of the open session, if `session_token` (when given) is that session's. vLLM's forms are
        accepted: a list with one update_info per worker (identical declarations), and an empty declaration
        meaning the previous update's (a trainer that sends the same tensors every step declares them once).
        Staged, with `sliced`: the update is only opened, and `advance_staged` receives it (the serving engine
        alternates its slices with steps)."""
        self.check_session(session_token)
        lora = self._lora_open()
        if self.prepared is not None or (lora and self._lora().prepared):
            raise RuntimeError(
                "update_weights() after the update was prepared; call commit_weight_update() or abort_weight_update()"
            )
        if isinstance(update_info, list):
            if not update_info or any(entry != update_info[0] for entry in update_info):
                self._abort_open_session()  # like any failed update, it ends the session
                raise ValueError(
                    "update_info given per worker must hold one identical declaration per worker "
                    "(the session was rolled back)"
                )
            update_info = update_info[0]
        if not lora and isinstance(update_info, dict) and update_info.get("base_version") is not None:
            try:
                self.check_base(update_info["base_version"])
            except ValueError as err:
                self._session_rpc("abort_weight_update")  # like any failed update, it ends the session
                raise ValueError(f"{err} (the session was rolled back)") from None
        if isinstance(update_info, dict) and self.last_update_info is not None and _empty_declaration(update_info):
            update_info = {**self.last_update_info, **{k: v for k, v in update_info.items() if v}}
        if lora:  # an adapter's next version (the adapter's own base version is checked there)
            try:
                self._lora().update(update_info)
            except BaseException:
                self.token = None
                raise
        elif self.staged and sliced:  # received by `advance_staged`, between steps
            self._session_rpc("update_weights", update_info, sliced=True)
            self.receiving = "update"
        else:
            self._session_rpc("update_weights", update_info, **({"sliced": True} if self.staged else {}))
            if self.staged:
                self.receiving = "update"
                while not self.advance_staged(None):
                    pass
        if isinstance(update_info, dict) and "names" in update_info:
            self.last_update_info = {k: v for k, v in update_info.items() if k in _DECLARATION}

    def advance_staged(self, budget_s: float | None) -> bool:
        """Receives the staged update or reload being received for about `budget_s` seconds on every worker (None:
        to its end). Returns True once it ended; a reload is then committed (served from the next step, a new
        version): with a budget, in a call of its own, so that no slice holds both the last chunks and the commit.
        A failure ends the change on every rank (the served weights were never written) and raises."""
        if self.receiving is None:
            return True
        if not self.received:
            if not self._receive(budget_s):
                return False
            self.received = True
            if budget_s is not None and self.receiving in ("reload", "lora"):
                return False  # the commit comes next, between two other steps
        if self.receiving == "lora" and self.staged_lora is not None and not self.staged_lora_packed:
            self.staged_lora_packed = True  # its packs built on every worker, between two other steps
            try:
                self.executor.collective_rpc("finish_weight_update", (), {"commit": False})
            except BaseException:
                self.abort_weight_update()
                raise
            if budget_s is not None:
                return False
        kind, self.receiving, self.received, self.staged_lora_packed = self.receiving, None, False, False
        if kind == "reload":
            self._commit_staged_reload()
        elif kind == "lora":
            prepared, self.staged_lora = self.staged_lora, None
            self._lora().finish_sliced(prepared)
        return True

    def _receive(self, budget_s: float | None) -> bool:
        """One slice of `advance_staged` on every worker: whether every worker received all of it."""
        try:
            return all(n is not None for n in self.executor.collective_rpc("advance_weight_update", (budget_s,)))
        except BaseException:
            try:
                self._abort_on_every_rank()
            finally:
                kind, self.receiving = self.receiving, None
                if kind == "reload":
                    self.staged_reload = None
                if kind == "lora":
                    self._lora().registry.discard(self.staged_lora.uid)
                    self.staged_lora = None
                else:
                    self._end()
            raise

    def _abort_open_session(self) -> None:
        """Ends the open session, a model's or an adapter's (rolled back / dropped)."""
        if self._lora_open():
            self.token = None
            self._lora().abort()
        else:
            self._session_rpc("abort_weight_update")

    def abort_weight_update(self, session_token: str | None = None) -> None:
        """Ends the open session (rolled back); with no session open, nothing happens whatever the token."""
        self.check_session(session_token, ending=True)
        self.receiving = self.staged_reload = None  # a staged change being received is dropped with it
        self.received = self.staged_lora_packed = False
        if self.staged_lora is not None:  # an adapter's next version being received in slices
            uid, self.staged_lora = self.staged_lora.uid, None
            self.executor.collective_rpc("abort_weight_update")
            self._lora().registry.discard(uid)
            return
        if self._lora_open():
            self.token = None
            self._lora().abort()
            return
        self._session_rpc("abort_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:
        """Drops every worker's transport (ending an open session, rolled back)."""
        self.receiving = self.staged_reload = None
        self.received = False
        if self._lora_open():
            self.token = None
            self._lora().abort()
        self._session_rpc("shutdown_weight_transfer_engine")

    def _abort_on_every_rank(self) -> None:
        """After a failure on some ranks: the others still hold their update open; roll it back there too (a
        no-op on ranks without one)."""
        if self.config.parallel_config.tensor_parallel_size > 1:
            self.executor.collective_rpc("abort_weight_update")

    def _two_phase(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Runs `method` on every worker so that they all change or none does: with worker processes, first with
        commit=False (everything that can fail, rollback copies kept), then, if every rank succeeded, the commit
        (`finish_weight_update`); on any failure every rank rolls back. One worker commits in one call."""
        if self.config.parallel_config.tensor_parallel_size == 1:
            self.executor.collective_rpc(method, args, kwargs)
            return
        try:
            self.executor.collective_rpc(method, args, {**kwargs, "commit": False})
        except BaseException:
            self._abort_on_every_rank()
            raise
        self.executor.collective_rpc("finish_weight_update")

    def _weights_changed(self, failed: bool = False) -> None:
        """After anything that may have changed the served weights, even a failed or aborted update: KV computed
        before it must never be reused (reset policy: drop the cache; salt policy: move to a fresh salt). After a
        failure, or while they are known invalid, the workers are asked whether their weights are valid (for
        `health_problem`); a success cannot invalidate them, so steady-state updates make no extra call.
        A prompt part-way through a chunked prefill starts again, all of it on the weights of now; after a success,
        so does every running request whose KV policy is "recompute" (`SamplingParams.on_weight_update`, else the
        engine's `on_weight_update`)."""
        self.engine.scheduler.restart_prefills()
        if not failed:
            default = self.config.scheduler_config.on_weight_update
            self.engine.scheduler.recompute(
                lambda seq: (getattr(seq.request.params, "on_weight_update", None) or default) == "recompute"
            )
        self.engine.reset_prefix_cache()
        self.engine.block_manager.salt = self.next_salt()
        if failed or not self.valid:
            try:
                self.valid = all(state.valid for state in self.executor.collective_rpc("weight_state"))
            except Exception:  # the workers are gone: health_problem reports the executor's reason
                pass

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

    def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Any = None,
        target: str = "model",
        weight_version: VersionArg = None,
        encoding: str | None = None,
        base_version: VersionArg = None,
        checksums: dict[str, str] | None = None,
        sliced: bool = False,
    ) -> None:
        """Reloads in place on every worker (see `Worker.reload_weights`), all of them or none; an iterator is read
        once, here, so a generator works with worker processes too. The engine's config (and every worker's)
        records a new folder only after every worker loaded it. Advances the weight version on success; `target`
        "draft" reloads the speculative draft instead, which then counts as updated for the current version.
        `weight_version` (an integer or a label, see `hotswap.weights.version`) names the new version. `encoding`
        (xor, sparse, overwrite: hotswap/weights/delta.py) reads the tensors as a delta, refused unless
        `base_version` (when given) is the served version; `checksums` are the trainer's SHA-256 of each result,
        verified before the commit. Staged (`update_staging="shadow"`), with `sliced`: the reload is only
        opened; `advance_staged` receives and commits it."""
        name = lora_target(target)
        if name is not None:  # an adapter's next version (see hotswap/engine/lora_updates.py): nothing pauses
            if self.token is not None or self.prepared is not None or self.receiving is not None:
                raise RuntimeError(
                    "a weight-update session is open; finish or abort it before reloading a LoRA adapter"
                )
            if weight_version is not None:
                raise ValueError("weight_version names a version of the model; a LoRA adapter numbers its own")
            if sliced and weights_iterator is not None:  # received between steps, then committed
                self.staged_lora = self._lora().prepare_reload(
                    name, None, weights_iterator, encoding, base_version, checksums, sliced=True
                )
                self.receiving = "lora"
                return
            self._lora().reload(name, weights_path, weights_iterator, encoding, base_version, checksums)
            return
        self.check_can_change("reload_weights")
        check_target(target, ("model", "draft"), "reload_weights target")
        parse_version(weight_version)
        self.check_base(base_version)
        if target == "draft" and weight_version is not None:
            raise ValueError("weight_version names a new version of the model; a draft reload keeps the current one")
        if target == "draft" and self.config.draft_model_config is None:
            raise ValueError("reload_weights(target='draft') needs a draft model (speculative_config 'draft_model')")
        if weights_iterator is not None:
            weights_iterator = list(weights_iterator)
        if self.staged and target == "model":
            self.begin_staged_reload(weights_path, weights_iterator, weight_version, encoding, checksums)
            while not sliced and not self.advance_staged(None):
                pass
            return
        ok = False
        try:
            self._two_phase(
                "reload_weights",
                weights_path=weights_path,
                weights_iterator=weights_iterator,
                target=target,
                **_delta_kwargs(encoding, checksums),
            )
            ok = True
        finally:
            self._weights_changed(failed=not ok)
        if target == "draft":
            if weights_path is not None:
                if self.config.parallel_config.tensor_parallel_size > 1:
                    self.executor.collective_rpc("record_folder", (str(weights_path), "draft"))
                assert self.config.draft_model_config is not None
                self.config.speculative_config.model = self.config.draft_model_config.model = str(weights_path)
            self.draft_version = self.version
            return
        if weights_path is not None and not is_delta(encoding):  # a folder of deltas is not the model's
            self._record_model_folder(str(weights_path))
        self._advance_version(weight_version)

    def begin_staged_reload(
        self,
        weights_path: str | None,
        weights_iterator: Any,
        weight_version: VersionArg,
        encoding: str | None,
        checksums: dict[str, str] | None,
    ) -> None:
        """Opens a staged reload of the model (see `reload_weights`, whose checks the caller ran): `advance_staged`
        receives it, then commits it."""
        if self.token is not None or self.prepared is not None or self.receiving is not None:
            raise RuntimeError("reload_weights() while a weight update is open; finish or abort it first")
        try:
            self.executor.collective_rpc(
                "reload_weights",
                (),
                {
                    "weights_path": weights_path,
                    "weights_iterator": weights_iterator,
                    "commit": False,
                    "sliced": True,
                    **_delta_kwargs(encoding, checksums),
                },
            )
        except BaseException:
            self._abort_on_every_rank()
            raise
        folder = None if weights_path is None or is_delta(encoding) else str(weights_path)
        self.staged_reload = (folder, weight_version)
        self.receiving = "reload"

    def _commit_staged_reload(self) -> None:
        assert self.staged_reload is not None
        (folder, weight_version), self.staged_reload = self.staged_reload, None
        ok = False
        try:
            self.executor.collective_rpc("finish_weight_update")
            ok = True
        except BaseException:
            self._abort_on_every_rank()
            raise
        finally:
            self._weights_changed(failed=not ok)
        if folder is not None:
            self._record_model_folder(folder)
        self._advance_version(weight_version)

    def finish_weight_update(
        self, weight_version: VersionArg = None, session_token: str | None = None, canary: Any = None
    ) -> None:
        """Closes the session on every worker, all of them or none (a failure rolls every rank back); the prefix
        cache is invalidated and the version advances (or takes `weight_version`: an integer or a label).
        `canary` (hotswap/engine/canary.py): probes scored with the new weights before the commit; a probe that
        fails rolls every rank back and raises ValueError naming it."""
        self.check_session(session_token)
        parse_version(weight_version)
        self._check_received("finish_weight_update")
        if self._lora_open():
            if weight_version is not None or canary is not None:
                raise ValueError("weight_version and canary apply to the model; a LoRA update takes neither")
            self.token = None
            self._lora().finish()
            return
        if self.prepared is not None:
            raise RuntimeError("this update was prepared for a two-phase commit; call commit_weight_update()")
        probes = self._canary(canary)
        ok = False
        try:
            if probes is None:
                self._two_phase("finish_weight_update")
            else:
                self._prepare("finish_weight_update", {}, probes)
                self.executor.collective_rpc("finish_weight_update")
            ok = True
        finally:
            self._end()
            self._weights_changed(failed=not ok)
        self._versions_after_commit(weight_version)

    def _check_received(self, method: str) -> None:
        if self.receiving is not None:
            raise RuntimeError(f"{method}() while the last update_weights() is still being received")

    def _canary(self, canary: Any) -> Canary | None:
        """The parsed canary (None: none given). A malformed one ends the session (rolled back), as any failed
        update does."""
        if canary is None:
            return None
        try:
            if self.engine.is_asleep():
                raise ValueError(
                    "the canary scores its probes through the KV cache, which sleep released; "
                    "wake_up(['kv_cache']) before finishing, or finish without a canary"
                )
            mc = self.config.model_config
            assert mc.max_model_len is not None
            return Canary.parse(canary, mc.hf_config["vocab_size"], mc.max_model_len)
        except ValueError as err:
            self._session_rpc("abort_weight_update")
            raise ValueError(f"{err} (the session was rolled back)") from None

    # ---- two-phase changes for a fleet of engines ------------------------------------------------------------

    def prepare_weight_update(self, session_token: str | None = None, canary: Any = None) -> None:
        """Phase one of finishing the open session: every worker post-processes what it received and keeps its
        rollback copies (nothing can fail after this but the process itself). The session stays open, serving
        nothing new, until `commit_weight_update()` or `abort_weight_update()`. A failure rolls every rank back
        and ends the session."""
        self.check_session(session_token)
        if self._lora_open():  # an adapter's next version: held on every worker, served at the commit
            if canary is not None:
                raise ValueError("a canary scores the model; a LoRA update takes none")
            try:
                self._lora().prepare()
            except BaseException:
                self.token = None
                raise
            return
        if self.token is None:
            raise RuntimeError("prepare_weight_update() needs an open session; call start_weight_update() first")
        self._check_received("prepare_weight_update")
        if self.prepared is not None:
            raise RuntimeError("the update is already prepared; call commit_weight_update() or abort_weight_update()")
        self._prepare("finish_weight_update", {}, self._canary(canary))
        self.prepared = ("session", None)

    def prepare_reload(
        self,
        weights_path: str | None = None,
        weights_iterator: Any = None,
        encoding: str | None = None,
        base_version: VersionArg = None,
        checksums: dict[str, str] | None = None,
    ) -> None:
        """Phase one of a reload (see `reload_weights`): every worker loads and post-processes the new weights in
        place but keeps its rollback copies; the engine is UPDATING (no step runs) until `commit_weight_update()`
        or `abort_weight_update()`. A failure rolls every rank back."""
        self.check_can_change("reload_weights")
        if self.engine.state is EngineState.UPDATING or self.token is not None:
            raise RuntimeError("a weight-update session is open; finish or abort it before a reload")
        self.check_base(base_version)
        if weights_iterator is not None:
            weights_iterator = list(weights_iterator)
        if not self.staged:
            self.engine.enter_state(EngineState.UPDATING)
        self._prepare(
            "reload_weights",
            {"weights_path": weights_path, "weights_iterator": weights_iterator, **_delta_kwargs(encoding, checksums)},
        )
        folder = None if weights_path is None or is_delta(encoding) else str(weights_path)
        self.prepared = ("reload", folder)  # a folder of deltas is not recorded as the model's

    def _prepare(self, method: str, kwargs: dict[str, Any], canary: Canary | None = None) -> None:
        """Phase one on every worker, then the canary's probes on the prepared weights; any failure rolls every
        rank back and ends the update."""
        try:
            self.executor.collective_rpc(method, (), {**kwargs, "commit": False})
            if canary is not None:
                if self.staged:  # the probes score the staged weights; requests go on with the served ones
                    self.executor.collective_rpc("view_staged", (True,))
                    try:
                        scores = self.engine.score_probes(canary.token_ids)
                    finally:
                        self.executor.collective_rpc("view_staged", (False,))
                else:
                    scores = self.engine.score_probes(canary.token_ids)
                canary.check(scores)
        except BaseException:
            try:
                self.executor.collective_rpc("abort_weight_update")  # ranks that prepared roll back too
            finally:
                self._end()
                self._weights_changed(failed=True)
            raise

    def commit_weight_update(self, weight_version: VersionArg = None, label: str | None = None) -> None:
        """Phase two: every worker commits the prepared change (it drops its rollback copies); the prefix cache is
        invalidated and the version advances (or takes `weight_version`, as a fleet gives every replica one, with
        `label` if given)."""
        parse_version(weight_version)
        parse_version(label, "label")
        updates = getattr(self.engine, "lora_updates", None)
        if updates is not None and updates.prepared:
            self.token = None
            updates.commit()
            return
        if self.prepared is None:
            raise RuntimeError("nothing is prepared; call prepare_weight_update() or prepare_reload() first")
        kind, folder = self.prepared
        ok = False
        try:
            self.executor.collective_rpc("finish_weight_update")
            ok = True
        finally:
            self._end()
            self._weights_changed(failed=not ok)
        if kind == "reload":
            if folder is not None:
                self._record_model_folder(folder)
            self._advance_version(weight_version, label)
        else:
            self._versions_after_commit(weight_version, label)

    def _versions_after_commit(self, weight_version: VersionArg, label: str | None = None) -> None:
        """Advances the versions of what the committed session wrote (the model's, and the draft's)."""
        parts = (
            {"model"}
            if self.target == "model"
            else {"draft"}
            if self.target == "draft"
            else (set(self.executor.collective_rpc("weight_state")[0].updated_parts) or {"model"})
        )
        if "model" in parts:
            self._advance_version(weight_version, label)
        if "draft" in parts:
            self.draft_version = self.version

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
            self._weights_changed(failed=not ok)
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


_DECLARATION = ("names", "dtypes", "dtype_names", "shapes", "bucket_size_bytes", "load_format")


def _delta_kwargs(encoding: str | None, checksums: dict[str, str] | None) -> dict[str, Any]:
    """The worker's reload_weights keywords of a delta (none for a plain reload: older workers' signature)."""
    return {k: v for k, v in (("encoding", encoding), ("checksums", checksums)) if v is not None}


def _empty_declaration(update_info: dict[str, Any]) -> bool:
    """{} or {"names": [], "dtype_names": [], "shapes": []} (vLLM 0.33: "the same as last time")."""
    return all(not update_info.get(k) for k in _DECLARATION) and not any(
        isinstance(v, (list, dict)) and v for k, v in update_info.items() if k not in _DECLARATION and k != "target"
    )
