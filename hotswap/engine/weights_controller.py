"""The one owner of the engine's weight changes: the transfer session (its token, target and last declaration), a
change prepared for a two-phase commit, the weight versions and their labels, and whether every worker's weights
are valid. `LLMEngine` steps requests; everything that changes weights goes through `engine.weights`.

    (no session) --start_weight_update()--> SESSION --update_weights()*--> SESSION
    SESSION --finish_weight_update()--> committed: new version, prefix cache invalidated --> (no session)
    SESSION --prepare_weight_update()--> PREPARED --commit_weight_update()--> committed --> (no session)
    (no session) --prepare_reload()--> PREPARED;  reload_weights() = prepare + commit in one call
    any failure, abort_weight_update() --> rolled back on every worker --> (no session)

The engine is UPDATING (no step runs) from start_weight_update / prepare_reload until the session ends, unless
updates are staged or the change writes an adapter's next version. The open change is one `OpenChange` record
(hotswap/engine/change.py), `self.change`; what differs between the model, the draft and an adapter is its
`ChangeTarget`, and every call to the workers is a command (hotswap/worker/commands.py).
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Iterable
from typing import Any

import torch

from hotswap.engine.canary import Canary
from hotswap.engine.change import DECLARATION, MODEL_TARGET, ChangeTarget, ModelTarget, OpenChange, empty_declaration
from hotswap.engine.lora_updates import AdapterTarget, lora_target
from hotswap.engine.state import EngineState
from hotswap.engine.weight_versions import EngineHooks, WeightVersions
from hotswap.weights.delta import is_delta
from hotswap.weights.target import TARGETS, WeightTarget, check_target
from hotswap.weights.version import VersionArg, VersionLabels, parse_version
from hotswap.worker.commands import (
    Abort,
    Advance,
    Commit,
    InitTransport,
    Load,
    Pairs,
    ReadState,
    RecordFolder,
    ShutdownTransport,
    TransportReady,
    ViewStaged,
)


class WeightsController(WeightVersions):
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
        self.change: OpenChange | None = None  # the open weight change (one at a time)
        self.last_update_info: dict[str, Any] | None = None  # the last declaration, which an empty one repeats
        self.connect_deadline = 0.0  # monotonic time by which a transport being connected must be ready
        self._salts = itertools.count(1)  # prefix-cache salts: private, never reused (unlike user versions)

    # ---- what the front ends read of the open change --------------------------------------------------------

    @property
    def token(self) -> str | None:
        """The open transfer session's token (None: no session is open)."""
        return None if self.change is None else self.change.token

    @property
    def receiving(self) -> str | None:
        """The kind of staged change being received in slices ("update", "reload"), or None."""
        change = self.change
        if change is None or not change.receiving:
            return None
        return "update" if change.kind == "session" else "reload"

    @property
    def staged(self) -> bool:
        """Whether updates are staged (`update_staging="shadow"`): received beside the served weights while
        requests keep generating, committed between two steps."""
        return self.config.weight_transfer_config.update_staging == "shadow"

    def next_salt(self) -> int:
        return next(self._salts)

    # ---- the open change --------------------------------------------------------------------------------------

    def _target(self, target: str, allowed: tuple[WeightTarget, ...] = TARGETS, what: str = "target") -> ChangeTarget:
        """The change target `target` names: "model", "draft", "all" (as `allowed`), or "lora:<name>"."""
        name = lora_target(target)
        if name is None:
            return ModelTarget(check_target(target, allowed, what))
        updates = self.engine.lora_updates
        if updates is None:
            raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True")
        return updates.target(name)

    def _open(self, change: OpenChange) -> OpenChange:
        """`change` is the open one; the engine is UPDATING while it writes the served model in place."""
        if change.target.pauses and not self.staged:
            self.engine.enter_state(EngineState.UPDATING)
            change.paused = True
        self.change = change
        return change

    def _end(self) -> None:
        """The open change is over (committed, rolled back or dropped): the engine leaves UPDATING."""
        change, self.change = self.change, None
        if change is None or change.paused:
            self.engine.leave_state(EngineState.UPDATING)

    def _current(self) -> ChangeTarget:
        """The open change's target; with none open, the model's (whose workers then refuse the call in order)."""
        return MODEL_TARGET if self.change is None else self.change.target

    def check_can_change(self, method: str) -> None:
        """Raises RuntimeError unless a weight change may start now: nothing prepared awaits its commit, and no
        request is being generated (pause first)."""
        change = self.change
        if change is not None and change.prepared:
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

    # ---- the transport ----------------------------------------------------------------------------------------

    def begin_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Creates the receiving side of a transport on every worker without waiting for its trainer; the caller
        polls `weight_transfer_ready` (between steps, with its lock released in between), bounded by the
        transport's timeout."""
        self.executor.send(InitTransport(init_info))
        # the store connection and the group's rendezvous may each take up to timeout_s
        self.connect_deadline = time.monotonic() + 2 * self.config.weight_transfer_config.timeout_s + 10

    def weight_transfer_ready(self) -> bool:
        """Whether every worker's transport has connected. If one failed (or the engine-side deadline passed),
        every worker drops its transport and the error is raised: init_weight_transfer_engine() again."""
        try:
            ready = all(self.executor.send(TransportReady()))
            if not ready and time.monotonic() > self.connect_deadline:
                raise TimeoutError("the weight transfer engine did not connect to its trainer in time")
        except BaseException:
            self.executor.send(ShutdownTransport())  # ranks still connecting drop theirs
            raise
        return ready

    def shutdown_weight_transfer_engine(self) -> None:
        """Drops every worker's transport (ending an open change, rolled back)."""
        change = self.change
        try:
            self.executor.send(ShutdownTransport())  # a change open on the workers is rolled back there
        finally:
            self._end()
            if change is not None:
                change.target.dropped()

    # ---- the transfer session ---------------------------------------------------------------------------------

    def start_weight_update(self, target: str = "model") -> str:
        """Opens an update session on every worker and returns its token: calls that carry another token are
        refused (a second trainer cannot feed, finish or abort this one's session); calls without a token are
        accepted, as clients of the vLLM API send none. `target`: "model", "draft" (the speculative draft alone),
        "all" (both, committed or rolled back together) or "lora:<name>" (an adapter's next version, loaded
        beside the served one: nothing pauses)."""
        change_target = self._target(target)  # before any worker is asked
        if change_target.pauses:
            self.check_can_change("start_weight_update")
        elif self.change is not None:
            raise RuntimeError("a weight-update session is open; finish or abort it first")
        change_target.start(self)
        token = secrets.token_hex(16)
        self._open(OpenChange(change_target, token))
        return token

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], session_token: str | None = None, sliced: bool = False
    ) -> None:
        """One update of the open session, if `session_token` (when given) is that session's. vLLM's forms are
        accepted: a list with one update_info per worker (identical declarations), and an empty declaration
        meaning the previous update's (a trainer that sends the same tensors every step declares them once).
        Staged, with `sliced`: the update is only opened, and `advance_staged` receives it (the serving engine
        alternates its slices with steps)."""
        self.check_session(session_token)
        target = self._current()
        if self.change is not None and self.change.prepared:
            raise RuntimeError(
                "update_weights() after the update was prepared; call commit_weight_update() or abort_weight_update()"
            )
        if isinstance(update_info, list):
            if not update_info or any(entry != update_info[0] for entry in update_info):
                self.abort_weight_update()  # like any failed update, it ends the session
                raise ValueError(
                    "update_info given per worker must hold one identical declaration per worker "
                    "(the session was rolled back)"
                )
            update_info = update_info[0]
        if target.pauses and isinstance(update_info, dict) and update_info.get("base_version") is not None:
            try:
                target.check_base(self.check_base, update_info["base_version"])
            except ValueError as err:
                self.abort_weight_update()  # like any failed update, it ends the session
                raise ValueError(f"{err} (the session was rolled back)") from None
        if isinstance(update_info, dict) and self.last_update_info is not None and empty_declaration(update_info):
            update_info = {**self.last_update_info, **{k: v for k, v in update_info.items() if v}}
        staged = self.staged and target.pauses  # an adapter's next version is written aside anyway
        try:
            target.receive(self, update_info, staged)
        except BaseException:
            self._end()
            raise
        change = self.change
        if staged and change is not None:
            change.receiving = True
            while not sliced and not self.advance_staged(None):
                pass
        if isinstance(update_info, dict) and "names" in update_info:
            self.last_update_info = {k: v for k, v in update_info.items() if k in DECLARATION}
            if change is not None:
                change.declaration = self.last_update_info

    def advance_staged(self, budget_s: float | None) -> bool:
        """Receives the staged update or reload being received for about `budget_s` seconds on every worker (None:
        to its end). Returns True once it ended; a reload is then committed (served from the next step, a new
        version): with a budget, in a call of its own, so that no slice holds both the last chunks and the commit.
        A failure ends the change on every rank (the served weights were never written) and raises."""
        change = self.change
        if change is None or not change.receiving:
            return True
        if not change.received:
            if not self._receive(change, budget_s):
                return False
            change.received = True
            if budget_s is not None and change.kind == "reload":
                return False  # the commit comes next, between two other steps
        if change.kind == "reload" and change.target.packs_first and not change.packed:
            change.packed = True  # phase one on every worker (an adapter's packs), between two other steps
            try:
                change.target.prepare(self)
            except BaseException:
                try:
                    change.target.drop(self)
                finally:
                    self._end()
                raise
            if budget_s is not None:
                return False
        change.receiving = change.received = change.packed = False
        if change.kind == "reload":
            self._commit(change, change.version, None)
        return True

    def _receive(self, change: OpenChange, budget_s: float | None) -> bool:
        """One slice of `advance_staged` on every worker: whether every worker received all of it."""
        try:
            return all(n is not None for n in self.executor.send(Advance(budget_s)))
        except BaseException:
            try:
                self.abort_on_every_rank()
                change.target.dropped()
            finally:
                self._end()
            raise

    def finish_weight_update(
        self, weight_version: VersionArg = None, session_token: str | None = None, canary: Any = None
    ) -> None:
        """Closes the session on every worker, all of them or none (a failure rolls every rank back); the prefix
        cache is invalidated and the version advances (or takes `weight_version`: an integer or a label).
        `canary` (hotswap/engine/canary.py): probes scored with the new weights before the commit; a probe that
        fails rolls every rank back and raises ValueError naming it. An adapter's session takes neither."""
        self.check_session(session_token)
        parse_version(weight_version)
        self._check_received("finish_weight_update")
        target, change = self._current(), self.change
        target.check_commit(weight_version, canary)
        if change is not None and change.prepared and target.strict_two_phase:
            raise RuntimeError("this update was prepared for a two-phase commit; call commit_weight_update()")
        probes = self._canary(canary)
        if change is None or not change.prepared:
            if probes is not None:
                self._prepare(target, probes)
            elif self.config.parallel_config.tensor_parallel_size > 1:
                self._prepare(target, None)
        self._commit(change or OpenChange(target), weight_version, None)

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
            self.abort_weight_update()
            raise ValueError(f"{err} (the session was rolled back)") from None

    def abort_weight_update(self, session_token: str | None = None) -> None:
        """Ends the open change (rolled back); with no session open, nothing happens whatever the token."""
        self.check_session(session_token, ending=True)
        target = self._current()
        try:
            target.abort(self)
        finally:
            self._end()

    def abort_on_every_rank(self) -> None:
        """After a failure on some ranks: the others still hold their update open; roll it back there too (a
        no-op on ranks without one)."""
        if self.config.parallel_config.tensor_parallel_size > 1:
            self.executor.send(Abort())

    # ---- two-phase changes (worker processes, a fleet of engines) ---------------------------------------------

    def prepare_weight_update(self, session_token: str | None = None, canary: Any = None) -> None:
        """Phase one of finishing the open session: every worker post-processes what it received and keeps its
        rollback copies (nothing can fail after this but the process itself). The session stays open, serving
        nothing new, until `commit_weight_update()` or `abort_weight_update()`. A failure rolls every rank back
        and ends the session."""
        self.check_session(session_token)
        change = self.change
        if change is None or change.token is None:
            raise RuntimeError("prepare_weight_update() needs an open session; call start_weight_update() first")
        change.target.check_commit(None, canary)
        self._check_received("prepare_weight_update")
        if change.prepared:
            if not change.target.strict_two_phase:
                return
            raise RuntimeError("the update is already prepared; call commit_weight_update() or abort_weight_update()")
        self._prepare(change.target, self._canary(canary))
        change.prepared = True

    def prepare_reload(
        self,
        weights_path: str | None = None,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        encoding: str | None = None,
        base_version: VersionArg = None,
        checksums: dict[str, str] | None = None,
        target: str = "model",
    ) -> None:
        """Phase one of a reload (see `reload_weights`): every worker loads and post-processes the new weights in
        place but keeps its rollback copies; the engine is UPDATING (no step runs) until `commit_weight_update()`
        or `abort_weight_update()`. A failure rolls every rank back. `target` "lora:<name>": the adapter's next
        version, held on every worker beside the served one (nothing pauses) until the commit."""
        change_target = self._target(target, ("model",), "prepare_reload target")
        if change_target.pauses:
            self.check_can_change("reload_weights")
        if self.engine.state is EngineState.UPDATING or self.change is not None:
            raise RuntimeError("a weight-update session is open; finish or abort it before a reload")
        change_target.check_base(self.check_base, base_version)
        change = self._open(OpenChange(change_target, kind="reload", folder=_folder(weights_path, encoding)))
        try:
            change_target.load(self, weights_path, _listed(weights_iterator), encoding, checksums)
        except BaseException:
            self._failed(change_target)
            raise
        self._prepare(change_target, None, loaded=True)
        change.prepared = True

    def _prepare(self, target: ChangeTarget, canary: Canary | None, loaded: bool = False) -> None:
        """Phase one on every worker (`loaded`: a reload's load was it), then the canary's probes on the prepared
        weights; any failure rolls every rank back and ends the change."""
        try:
            if not loaded:
                target.prepare(self)
            if canary is not None:
                if self.staged:  # the probes score the staged weights; requests go on with the served ones
                    self.executor.send(ViewStaged(True))
                    try:
                        scores = self.engine.score_probes(canary.token_ids)
                    finally:
                        self.executor.send(ViewStaged(False))
                else:
                    scores = self.engine.score_probes(canary.token_ids)
                canary.check(scores)
        except BaseException:
            self._failed(target, rolled_back=False)
            raise

    def _failed(self, target: ChangeTarget, rolled_back: bool = True) -> None:
        """After a failed phase one: every rank rolls back (the ranks that failed already did, unless not
        `rolled_back`), the change ends, and the prefix cache is invalidated where the served weights were."""
        try:
            if rolled_back:
                self.abort_on_every_rank()
            else:
                target.drop(self)
        finally:
            self._end()
            if target.pauses:
                self.weights_changed(failed=True)

    def commit_weight_update(self, weight_version: VersionArg = None, label: str | None = None) -> None:
        """Phase two: every worker commits the prepared change (it drops its rollback copies); the prefix cache is
        invalidated and the version advances (or takes `weight_version`, as a fleet gives every replica one, with
        `label` if given). An adapter's change takes no version (ValueError; it stays prepared)."""
        parse_version(weight_version)
        parse_version(label, "label")
        change = self.change
        if change is None or not change.prepared:
            raise RuntimeError("nothing is prepared; call prepare_weight_update() or prepare_reload() first")
        change.target.check_commit(weight_version if label is None else label, None)
        self._commit(change, weight_version, label)

    def _commit(self, change: OpenChange, weight_version: VersionArg, label: str | None) -> None:
        """The last call of a change on every worker, then what it leaves: the prefix cache invalidated and the
        versions advanced (where it wrote the served model), the folder it came from recorded."""
        target = change.target
        ok = False
        try:
            target.commit(self)
            ok = True
        except BaseException:
            if change.kind == "reload" and not change.prepared and target.pauses:  # a staged reload's
                self.abort_on_every_rank()
            raise
        finally:
            self._end()
            if target.pauses:
                self.weights_changed(failed=not ok)
        if not isinstance(target, ModelTarget):
            return
        if change.kind == "reload":
            if change.folder is not None:
                self._record_model_folder(change.folder)
            self._advance_version(weight_version, label)
        else:
            self._versions_after_commit(target, weight_version, label)

    def weights_changed(self, failed: bool = False) -> None:
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
                self.valid = all(state.valid for state in self.executor.send(ReadState()))
            except Exception:  # the workers are gone: health_problem reports the executor's reason
                pass

    def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
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
        "draft" reloads the speculative draft instead, which then counts as updated for the current version;
        "lora:<name>" an adapter's next version (hotswap/engine/lora_updates.py; nothing pauses).
        `weight_version` (an integer or a label, see `hotswap.weights.version`) names the new version. `encoding`
        (xor, sparse, overwrite: hotswap/weights/delta.py) reads the tensors as a delta, refused unless
        `base_version` (when given) is the served version; `checksums` are the trainer's SHA-256 of each result,
        verified before the commit. Staged (`update_staging="shadow"`), with `sliced`: the reload is only
        opened; `advance_staged` receives and commits it."""
        change_target = self._target(target, ("model", "draft"), "reload_weights target")
        if isinstance(change_target, AdapterTarget):
            if self.change is not None:
                raise RuntimeError(
                    "a weight-update session is open; finish or abort it before reloading a LoRA adapter"
                )
            if weight_version is not None:
                raise ValueError("weight_version names a version of the model; a LoRA adapter numbers its own")
            if change_target.reload(self, weights_path, weights_iterator, encoding, base_version, checksums, sliced):
                self._open(OpenChange(change_target, kind="reload", receiving=True))  # received between steps
            return
        assert isinstance(change_target, ModelTarget)
        self.check_can_change("reload_weights")
        parse_version(weight_version)
        self.check_base(base_version)
        draft = change_target.name == "draft"
        if draft and weight_version is not None:
            raise ValueError("weight_version names a new version of the model; a draft reload keeps the current one")
        if draft and self.config.draft_model_config is None:
            raise ValueError("reload_weights(target='draft') needs a draft model (speculative_config 'draft_model')")
        pairs = _listed(weights_iterator)
        if self.staged and not draft:  # received beside the served weights, between steps, then committed
            if self.change is not None:
                raise RuntimeError("reload_weights() while a weight update is open; finish or abort it first")
            change = self._open(
                OpenChange(change_target, kind="reload", version=weight_version, folder=_folder(weights_path, encoding))
            )
            try:
                change_target.load(self, weights_path, pairs, encoding, checksums, sliced=True)
            except BaseException:
                self.abort_on_every_rank()
                self._end()
                raise
            change.receiving = True
            while not sliced and not self.advance_staged(None):
                pass
            return
        ok = False
        try:
            if self.config.parallel_config.tensor_parallel_size == 1:  # one worker changes in one call
                self.executor.send(Load(change_target.part(), weights_path, pairs, encoding, checksums))
            else:
                try:
                    change_target.load(self, weights_path, pairs, encoding, checksums)
                except BaseException:
                    self.abort_on_every_rank()
                    raise
                self.executor.send(Commit())
            ok = True
        finally:
            self.weights_changed(failed=not ok)
        if draft:
            if weights_path is not None:
                if self.config.parallel_config.tensor_parallel_size > 1:
                    self.executor.send(RecordFolder(str(weights_path), "draft"))
                assert self.config.draft_model_config is not None
                self.config.speculative_config.model = self.config.draft_model_config.model = str(weights_path)
            self.draft_version = self.version
            return
        folder = _folder(weights_path, encoding)
        if folder is not None:
            self._record_model_folder(folder)
        self._advance_version(weight_version)


def _folder(weights_path: str | None, encoding: str | None) -> str | None:
    """The folder a reload records as the model's once committed (a folder of deltas is not the model's)."""
    return None if weights_path is None or is_delta(encoding) else str(weights_path)


def _listed(weights_iterator: Iterable[tuple[str, torch.Tensor]] | None) -> Pairs | None:
    """The pairs of an iterator, read once, here (a generator works with worker processes too)."""
    return None if weights_iterator is None else list(weights_iterator)
