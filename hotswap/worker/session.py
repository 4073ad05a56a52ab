"""A worker's weight lifecycle: one-shot loads and the transfer session, as an explicit state machine.

    NO_ENGINE --init_weight_transfer_engine--> READY --start_weight_update--> ACTIVE
    READY --weight_transfer_ready, the transport failed to connect--> NO_ENGINE
    ACTIVE --update_weights (x N)--> ACTIVE
    ACTIVE --finish_weight_update--> READY          (post-processing completes, rollback copies dropped)
    ACTIVE --abort_weight_update / any failure--> READY   (atomic: rolled back; else: weights invalid)
    NO_ENGINE | READY --abort_weight_update--> same state (nothing to abort)
    READY --shutdown_weight_transfer_engine--> NO_ENGINE
    NO_ENGINE | READY --load (startup load, reload_weights)--> same state
    NO_ENGINE | READY --load(commit=False)--> ACTIVE      (then finish or abort, as for a session)

Two-phase commit, for worker processes that must change together: `load(commit=False)` and
`finish(commit=False)` do everything that can fail (loading, post-processing) but keep the rollback copies and
the update open; the engine then calls `finish()` on every rank only if every rank succeeded, else `abort()` on
every rank.

A call out of order raises RuntimeError naming the call that was expected. The session owns the rollback
buffers (reused across updates, so steady-state updates fault in no fresh memory) and `weights_valid`: False
after a failed non-atomic update wrote something (or sleep(2) released the weights), until committed updates
have rewritten every weight (one full update, or several partial ones: bucketed senders commit per bucket).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Generator
from typing import Any, NoReturn

import torch

from hotswap.config import WeightTransferConfig
from hotswap.transfer.base import TransferEngine, clear_interrupt, create_engine
from hotswap.weights.delta import check_encoding, checked, decoded
from hotswap.weights.index import WeightIndex
from hotswap.weights.shadow import Shadow
from hotswap.weights.update import RankSelection, WeightSource, WeightUpdate, renamed_source
from hotswap.worker.commands import MODEL, AdapterPart, Part

Rename = Callable[[str], str] | None  # how a source's names map to the index's (None: as they are)


class SessionState(enum.Enum):
    NO_ENGINE = "no_engine"
    READY = "ready"
    ACTIVE = "active"


class WeightUpdateFailed(RuntimeError):
    """A weight update failed; the message says whether the weights were rolled back."""


_HINTS = {
    SessionState.NO_ENGINE: "call init_weight_transfer_engine(init_info) first",
    SessionState.READY: "call start_weight_update() first",
    SessionState.ACTIVE: "a weight update is in progress; call update_weights(), finish_weight_update() "
    "or abort_weight_update()",
}


class WeightSession:
    def __init__(self) -> None:
        self.state = SessionState.NO_ENGINE
        self.engine: TransferEngine | None = None
        self.update: WeightUpdate | None = None
        self.backups: dict[str, torch.Tensor] = {}
        self.shadows: dict[str, torch.Tensor] = {}  # the staging copies' pool (update_staging="shadow")
        # a staged update being received in slices (`advance`): its steps and the transport (None: a reload)
        self.job: tuple[Generator[None, None, int], TransferEngine | None] | None = None
        self.weights_valid = True
        self._rewritten: set[tuple[str, object]] = set()  # served weights committed since they became invalid
        self._idle = SessionState.NO_ENGINE  # the state an open update returns to
        self.part: Part = MODEL  # what the open (or else the last) update writes

    def is_valid(self) -> bool:
        """Whether the served weights are valid: False after a failed non-atomic update or their release (sleep
        level 2), until updates rewrote every tensor or a reload ran."""
        return self.weights_valid

    def expect(self, *states: SessionState, call: str) -> None:
        if self.state not in states:
            raise RuntimeError(f"{call}() is not allowed now (session state: {self.state.value}); {_HINTS[self.state]}")

    # ---- one-shot loads ---------------------------------------------------------------------------------------

    def load(
        self,
        index: WeightIndex,
        source: WeightSource,
        atomic: bool,
        check_finite: bool,
        commit: bool = True,
        encoding: dict[str, Any] | None = None,
        rename: Rename = None,
        staged: bool = False,
        sliced: bool = False,
        backup_device: str = "cpu",
        part: Part = MODEL,
    ) -> WeightUpdate:
        """Applies one source and finishes, or fails as a whole (rolled back in atomic mode). With `commit` False
        the update stays open with its rollback copies (see the two-phase commit above). `encoding`: the
        source's delta encoding and checksums ({"encoding", "checksums"}, see hotswap/weights/delta.py). Returns
        the update (its `loaded_names`). `rename`: applied to the source's names (and to the checksums' names).
        `staged`: written into staging copies (hotswap/weights/shadow.py), served from the commit on. `sliced`
        (staged, not committing): only opens the update; `advance` receives it, slice by slice. `part`: what it
        writes (kept while it is open, and named by a failure's message)."""
        self.expect(SessionState.NO_ENGINE, SessionState.READY, call="reload_weights")
        update = self._update(index, atomic, check_finite, staged, backup_device)
        self.part = part
        if sliced:
            # staged, or into weights nothing serves yet (an adapter's next version); committed by finish()
            assert not commit and (staged or not index.validating_keys), "a sliced load writes nothing served"
            info = encoding or {}
            source = renamed_source(source, rename) if rename is not None else source
            self._open(update, part)
            self.job = (update.steps(encoded(source, info, update, rename), final=False), None)
            return update
        try:
            info = encoding or {}
            source = renamed_source(source, rename) if rename is not None else source
            update.apply(encoded(source, info, update, rename), final=commit)
            update.finish(keep_copies=not commit)
        except BaseException as err:
            self._fail(update, err)
        if not commit:
            self._open(update, part)
            return update
        self._settle(update)
        return update

    # ---- the transfer session ---------------------------------------------------------------------------------

    def init_engine(self, init_info: dict[str, Any], config: WeightTransferConfig) -> None:
        self.expect(SessionState.NO_ENGINE, SessionState.READY, call="init_weight_transfer_engine")
        engine = create_engine(init_info, config)
        self.shutdown_engine()
        self.engine = engine
        self.state = SessionState.READY

    def engine_ready(self) -> bool:
        """Whether the transport has connected (see `TransferEngine.ready`). A transport that failed to connect
        is shut down (NO_ENGINE) and its error re-raised."""
        self.expect(SessionState.READY, SessionState.ACTIVE, call="weight_transfer_ready")
        assert self.engine is not None
        try:
            return self.engine.ready()
        except BaseException:
            self.shutdown_engine()
            raise

    def start(self, index: WeightIndex, config: WeightTransferConfig, part: Part = MODEL) -> None:
        self.expect(SessionState.READY, call="start_weight_update")
        clear_interrupt()  # an interrupt from now until the session ends ends its next (or current) wait
        self._open(
            self._update(
                index, config.atomic, config.check_finite, config.update_staging == "shadow", config.backup_device
            ),
            part,
        )

    def open_part(self) -> Part | None:
        """What the open update writes; None while none is open."""
        return self.part if self.state is SessionState.ACTIVE else None

    def _update(
        self, index: WeightIndex, atomic: bool, check_finite: bool, staged: bool, backup_device: str = "cpu"
    ) -> WeightUpdate:
        shadow = Shadow(index, self.shadows) if staged else None
        return WeightUpdate(
            index,
            atomic=atomic,
            check_finite=check_finite,
            backups=self.backups,
            shadow=shadow,
            backup_device=backup_device,
        )

    def receive(
        self, update_info: dict[str, Any], selection: RankSelection, rename: Rename = None, sliced: bool = False
    ) -> int:
        """One update of the session: its source built by the transport, this rank's entries selected, renamed
        by `rename` (e.g. a prefix put before a draft model's names), then applied. Any failure ends the session
        (rolled back in atomic mode; a transport that cannot survive it is closed) and re-raises. Returns the
        number of tensors loaded. `sliced` (a staged session): only prepares the receive, which `advance` runs
        (returns 0)."""
        self.expect(SessionState.ACTIVE, call="update_weights")
        engine, update = self.engine, self.update
        assert engine is not None and update is not None
        if self.job is not None:
            raise RuntimeError("update_weights() while the previous update is still being received")
        try:
            source = selection.apply(engine.source(update_info))
            source = renamed_source(source, rename) if rename is not None else source
            if sliced:
                assert update.shadow is not None, "only a staged update is received in slices"
                self.job = (update.steps(encoded(source, update_info, update, rename)), engine)
                return 0
            return update.apply(encoded(source, update_info, update, rename))
        except BaseException as err:
            self._receive_failed(engine, update, err)

    def chain_job(self, first: Generator[None, None, None], last: Generator[None, None, None]) -> None:
        """Runs `first` (e.g. copies the update's writes depend on) before the sliced job, and `last` (e.g. what
        is built from everything written) after it, in the same slices."""
        assert self.job is not None, "no sliced job"
        steps, engine = self.job

        def chained() -> Generator[None, None, int]:
            yield from first
            count = yield from steps
            yield from last
            return count

        self.job = (chained(), engine)

    def advance(self, budget_s: float | None) -> int | None:
        """Receives the staged update of `load(sliced=True)` / `receive(sliced=True)` for about `budget_s` seconds
        (None: to its end; at least one tensor), its writes swapped in meanwhile. Returns the tensors it loaded
        once it ended, None while more remain. A failure ends the session, as in `receive`."""
        self.expect(SessionState.ACTIVE, call="advance_weight_update")
        if self.job is None:
            raise RuntimeError("no staged update is being received")
        steps, engine = self.job
        update = self.update
        assert update is not None
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        try:
            with update.writing():
                while True:
                    try:
                        next(steps)
                    except StopIteration as stop:
                        self.job = None
                        return int(stop.value)
                    if deadline is not None and time.perf_counter() >= deadline:
                        return None
        except BaseException as err:
            self.job = None
            if engine is None:
                self._end()
                self._fail(update, err)
            self._receive_failed(engine, update, err)

    def _receive_failed(self, engine: TransferEngine, update: WeightUpdate, err: BaseException) -> NoReturn:
        self._end()
        if not engine.survives_failure:
            self.shutdown_engine()
            if isinstance(err, (ValueError, RuntimeError)):
                err = type(err)(
                    f"{err}; the {type(engine).__name__} channel was closed, call init_weight_transfer_engine() again"
                )
        self._fail(update, err)

    def finish(self, commit: bool = True) -> WeightUpdate:
        """Completes post-processing of partially updated modules and closes the update; with `commit` False it
        only post-processes, keeping the update open with its rollback copies (the first phase)."""
        self.expect(SessionState.ACTIVE, call="finish_weight_update")
        assert self.update is not None
        if self.job is not None:
            raise RuntimeError("finish_weight_update() while an update is still being received")
        update = self.update
        try:
            update.finish(keep_copies=not commit)
        except BaseException as err:
            self._end()
            self._fail(update, err)
        if commit:
            self._end()
            self._settle(update)
        return update

    def abort(self) -> bool:
        """Ends the open update, restoring what it changed (atomic mode; otherwise the weights become invalid).
        Without an open update there is nothing to abort (e.g. it already failed, which rolled it back): returns
        False."""
        if self.state is not SessionState.ACTIVE:
            return False
        self.job = None
        update = self._end()
        if update.atomic or update.shadow is not None:
            update.rollback()
        if update.shadow is None and (not update.atomic or update.unprotected) and update.wrote_served():
            self.invalidate()
        return True

    def shutdown_engine(self) -> None:
        """Aborts an open update, then releases the transport (connections, shared buffers)."""
        if self.state is SessionState.ACTIVE:
            self.abort()
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None
        self.state = SessionState.NO_ENGINE

    def release_backups(self) -> None:
        """Frees the pooled rollback buffers and staging copies (sleep, transport shutdown); the next update
        re-allocates."""
        self.backups.clear()
        self.shadows.clear()

    # ---- helpers --------------------------------------------------------------------------------------------

    def _open(self, update: WeightUpdate, part: Part) -> None:
        self._idle, self.update, self.state, self.part = self.state, update, SessionState.ACTIVE, part

    def _end(self) -> WeightUpdate:
        assert self.update is not None
        update, self.update = self.update, None
        self.state = self._idle
        return update

    def invalidate(self) -> None:
        """The served weights can no longer be trusted (a failed non-atomic update, memory released): the worker
        refuses to execute until every weight was rewritten, by one update or by several committed ones."""
        self.weights_valid = False
        self._rewritten = set()

    def _settle(self, update: WeightUpdate) -> None:
        if update.covers_all():
            self.weights_valid = True
        elif not self.weights_valid:  # bucketed updates (one session per bucket) rewrite it piece by piece
            self._rewritten |= update.loaded_keys & update.index.validating_keys
            self.weights_valid = bool(update.index.validating_keys) and update.index.validating_keys <= self._rewritten
        if self.weights_valid:
            self._rewritten = set()

    def _fail(self, update: WeightUpdate, err: BaseException) -> NoReturn:
        """Rolls back (atomic) or invalidates the weights, then re-raises `err` with the outcome attached. A
        speculative draft's weights alone never invalidate: outputs do not depend on them."""
        if update.atomic and update.unprotected and update.loaded_names:
            update.rollback()
            if update.wrote_served():
                self.invalidate()
                outcome = (
                    "it failed after writing without rollback copies, so the engine refuses to generate "
                    "until a successful reload_weights()"
                )
            else:
                left = _unserved(self.part, "reload the draft model")
                outcome = f"it failed after writing without rollback copies: {left}"
        elif update.shadow is not None:
            update.rollback()
            outcome = "it was staged: the served weights were never written"
        elif update.atomic:
            update.rollback()
            outcome = "the previous weights were restored"
        elif update.loaded_names and update.wrote_served():
            self.invalidate()
            outcome = "atomic mode is off, so the engine refuses to generate until a successful reload_weights()"
        elif update.loaded_names:
            outcome = f"atomic mode is off: {_unserved(self.part, _DRAFT_LEFT)}"
        else:
            outcome = "no weight had been changed"
        if isinstance(err, (ValueError, TimeoutError)):
            raise type(err)(f"{err} ({outcome})") from err
        if isinstance(err, Exception):
            raise WeightUpdateFailed(f"weight update failed: {err!r} ({outcome})") from err
        raise err


_DRAFT_LEFT = "the draft model is left part-updated (outputs are unaffected); reload it"


def _unserved(part: Part, draft: str) -> str:
    """What a failed update that wrote only weights nothing serves leaves behind: `draft` for the speculative
    draft; an adapter's next version is dropped."""
    if isinstance(part, AdapterPart):
        return "the adapter's new version was dropped; the served version is unchanged"
    return draft


def encoded(source: WeightSource, info: dict[str, Any], update: WeightUpdate, rename: Rename = None) -> WeightSource:
    """`source` decoded from `info["encoding"]` and verified against `info["checksums"]` (both optional; an
    update_info carries them, as `reload_weights` passes them). `rename`: applied to the checksums' names, as to
    the source's own."""
    encoding = check_encoding(info.get("encoding") if isinstance(info, dict) else None)
    checksums = info.get("checksums") if isinstance(info, dict) else None
    if rename is not None and isinstance(checksums, dict):
        checksums = {rename(k): v for k, v in checksums.items()}
    return checked(decoded(source, encoding, update), update.index, checksums)
