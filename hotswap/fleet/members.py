"""What a fleet's modules share: a replica's record (`_Member`), the open session's (`FleetChange`), the errors
a fleet raises, and the helpers that name a replica's failure."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from hotswap.errors import EngineUnavailable
from hotswap.fleet.replica import ReplicaStatus
from hotswap.weights.version import VersionArg
from hotswap.worker.session import WeightUpdateFailed


class FleetUpdateFailed(WeightUpdateFailed):
    """A fleet-wide weight change failed on some replica; every replica was rolled back (HTTP 409)."""


class ReplicaDown(EngineUnavailable):
    """A replica died (or stopped answering) during a call; the fleet restarts it (HTTP 503)."""


Verb = Callable[..., Any]  # a `ReplicaServer` method: what `_call` runs on each replica's actor


@dataclasses.dataclass
class FleetChange:
    """The fleet's open update session: the replicas it runs on (each holds its own engine's `OpenChange`), its
    token and its target, and when it started."""

    members: list[_Member]
    token: str
    target: str
    started: float = dataclasses.field(default_factory=time.monotonic)
    version: VersionArg = None  # the version it commits as (None: the next; `set_change_version`)


class _FolderChanged(RuntimeError):
    """The fleet reloaded from another folder while a restarted replica loaded the previous one: the restart is
    begun again from the new folder (a version a folder holds is always restored from it)."""


@dataclasses.dataclass
class _Member:
    index: int
    actor: Any
    placement_group: Any
    state: str = "starting"  # starting (a restart) | joining (add_replicas) | up | down | removed
    leaving: bool = False  # remove_replicas: out of routing and of new changes, draining until it is stopped
    version: int = 0
    status: ReplicaStatus | None = None  # its last health report (None: none yet)
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


def _stop(actor: Any, placement_group: Any) -> None:
    """Ends a replica: its requests still in flight, its actor, its placement group (errors ignored: it may be
    gone already)."""
    ray = _ray()
    from ray.util.placement_group import remove_placement_group

    with contextlib.suppress(Exception):
        ray.get(actor.shutdown.remote(), timeout=10)
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)
    with contextlib.suppress(Exception):
        remove_placement_group(placement_group)


def _no_commit(version: int) -> ReplicaDown:
    return ReplicaDown(
        f"every replica failed while committing version {version}; restarted replicas are brought "
        "to it where a folder or a live replica holds it (else reload the fleet from a folder)"
    )


def _check_atomic(atomic: bool) -> None:
    if not atomic:
        raise ValueError(
            "a fleet needs weight_transfer_config.atomic True: rolling every replica back needs each "
            "one's rollback copies"
        )


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
    for kind in (
        ReplicaDown,
        FleetUpdateFailed,
        WeightUpdateFailed,
        EngineUnavailable,
        ValueError,
        TypeError,
        TimeoutError,
        RuntimeError,
    ):
        if isinstance(err, kind):
            new = err if str(err).startswith(f"replica {index}") else kind(f"replica {index}: {err}")
            break
    if new is not err:
        new.__cause__ = err
    return new
