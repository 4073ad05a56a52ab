"""An open weight change (`OpenChange`), and what it changes (`ChangeTarget`): the served model, the speculative
draft or both (`ModelTarget`), or the next version of a LoRA adapter (`AdapterTarget`, in
hotswap/engine/lora_updates.py).

The controller (hotswap/engine/weights_controller.py) owns the one `OpenChange` of an engine and runs every verb
the same way for every target: it checks the session token and the order of the calls, merges declarations,
advances versions and invalidates the prefix cache; the target does what only its kind does, through the worker
commands of hotswap/worker/commands.py. The server, the SGLang dialect and a fleet read the record (its token,
when it started, the version it commits as); none keeps a copy.

    start -> receive* -> [prepare ->] commit | abort          (a transfer session; a token guards it)
    reload (phase one, commit=False) -> commit | abort        (a prepared reload; no token)
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from hotswap.executor.base import Executor
from hotswap.weights.target import WeightTarget
from hotswap.weights.version import VersionArg
from hotswap.worker.commands import Abort, Commit, Load, ModelPart, Pairs, Part, Receive, StartUpdate


class ChangeHost(Protocol):
    """What a target uses of its controller: the workers, whether updates are staged, and what follows a change
    of the served weights."""

    executor: Executor

    @property
    def staged(self) -> bool: ...

    def weights_changed(self, failed: bool = False) -> None: ...

    def abort_on_every_rank(self) -> None: ...


class ChangeTarget(ABC):
    """What one kind of weight change does on the workers, and how the controller treats it:
    - `pauses`: it writes the served model in place, so requests in flight refuse it (unless updates are staged),
      the engine is UPDATING while it is open, and the prefix cache is invalidated once it ended;
    - `packs_first`: a reload received in slices is prepared (phase one) in a slice of its own before its commit;
    - `strict_two_phase`: once prepared, only `commit_weight_update` commits it, and it is prepared once (else
      `finish_weight_update` commits a prepared change too, and preparing again changes nothing)."""

    pauses = True
    packs_first = False
    strict_two_phase = True
    name = "model"  # as clients name it ("model", "draft", "all", "lora:<name>")

    @abstractmethod
    def part(self) -> Part:
        """What it writes on the workers."""

    def start(self, host: ChangeHost) -> None:
        """Opens a transfer session on every worker."""
        host.executor.send(StartUpdate(self.part()))

    @abstractmethod
    def receive(self, host: ChangeHost, update_info: dict[str, Any], sliced: bool) -> None:
        """One update of the open session on every worker; a failure ends the change everywhere and raises."""

    @abstractmethod
    def check_base(self, served: Callable[[VersionArg], None], base_version: VersionArg) -> None:
        """Raises ValueError when a delta's `base_version` is not what this target serves (None: no check;
        `served`: the controller's check against the served model's version)."""

    def check_commit(self, weight_version: VersionArg, canary: object) -> None:  # noqa: B027 - optional
        """Raises ValueError for a commit's arguments that do not apply to this target (nothing changes)."""

    @abstractmethod
    def load(
        self,
        host: ChangeHost,
        weights_path: str | None,
        weights_iterator: Pairs | None,
        encoding: str | None,
        checksums: dict[str, str] | None,
        sliced: bool = False,
    ) -> None:
        """Phase one of a reload on every worker (its base version checked): what the commit makes current is
        held until then (`sliced`: only opened, received between steps by `Advance`)."""

    def prepare(self, host: ChangeHost) -> None:
        """Phase one of the commit on every worker: everything that can fail, rollback copies kept."""
        host.executor.send(Commit(prepare_only=True))

    def commit(self, host: ChangeHost) -> None:
        """Phase two (or the one call of one worker): the change is what the workers hold."""
        host.executor.send(Commit())

    def abort(self, host: ChangeHost) -> bool:
        """Rolls the change back on every worker (or drops it); whether any worker had it open."""
        return self.drop(host)

    def drop(self, host: ChangeHost) -> bool:
        """`abort` after a failure (what the failure changed is the caller's to settle)."""
        return any(host.executor.send(Abort()))

    def dropped(self) -> None:  # noqa: B027 - optional
        """After a failure or an abort: what the engine side keeps of the change goes."""


class ModelTarget(ChangeTarget):
    """The served model ("model"), the speculative draft ("draft"), or both ("all")."""

    def __init__(self, name: WeightTarget = "model") -> None:
        self.name = name
        self.written: WeightTarget = name  # `name`, typed as the worker's part names it

    def part(self) -> ModelPart:
        return ModelPart(self.written)

    def check_base(self, served: Callable[[VersionArg], None], base_version: VersionArg) -> None:
        served(base_version)

    def receive(self, host: ChangeHost, update_info: dict[str, Any], sliced: bool) -> None:
        """In place (each write served at once: the prefix cache is invalidated even if it fails), or staged
        (`sliced`: only opened, received between steps by `Advance`)."""
        changed = not host.staged
        ok = False
        try:
            host.executor.send(Receive(update_info, sliced))
            ok = True
        except BaseException:
            host.abort_on_every_rank()
            raise
        finally:
            if changed:
                host.weights_changed(failed=not ok)

    def abort(self, host: ChangeHost) -> bool:
        aborted = self.drop(host)
        if aborted and not host.staged:
            host.weights_changed()
        return aborted

    def load(
        self,
        host: ChangeHost,
        weights_path: str | None,
        weights_iterator: Pairs | None,
        encoding: str | None,
        checksums: dict[str, str] | None,
        sliced: bool = False,
    ) -> None:
        host.executor.send(
            Load(self.part(), weights_path, weights_iterator, encoding, checksums, commit=False, sliced=sliced)
        )


MODEL_TARGET = ModelTarget()


@dataclass
class OpenChange:
    """The engine's open weight change: a transfer session (`token`) or a prepared or staged reload."""

    target: ChangeTarget
    token: str | None = None  # a transfer session's; None: a reload (no caller owns it)
    kind: Literal["session", "reload"] = "session"
    declaration: dict[str, Any] | None = None  # its last update's declaration (an empty one repeats it)
    prepared: bool = False  # phase one done on every worker: awaits commit_weight_update()
    started: float = field(default_factory=time.monotonic)  # when it opened (monotonic seconds)
    version: VersionArg = None  # the version it commits as (None: the next)
    folder: str | None = None  # a reload's checkpoint folder, recorded as the model's once committed
    paused: bool = False  # the engine entered UPDATING for it
    receiving: bool = False  # staged: being received in slices between steps
    received: bool = False  # all of it arrived; its commit (or, for a session, the next call) follows
    packed: bool = False  # an adapter's next version has its packs built (its commit is next)


DECLARATION = ("names", "dtypes", "dtype_names", "shapes", "bucket_size_bytes", "load_format")


def empty_declaration(update_info: dict[str, Any]) -> bool:
    """{} or {"names": [], "dtype_names": [], "shapes": []} (vLLM 0.33: "the same as last time")."""
    return all(not update_info.get(k) for k in DECLARATION) and not any(
        isinstance(v, (list, dict)) and v for k, v in update_info.items() if k not in DECLARATION and k != "target"
    )
