"""A fleet's admin routes: `/fleet_status` (its weight version and its replicas), `/fleet/add_replicas` and
`/fleet/remove_replicas` (replicas joining and leaving a running fleet). `create_app` includes `router` behind the
admin key when the engine is a fleet (its `replicas` control)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from hotswap.engine.client import ReplicaControl
from hotswap.entrypoints.server.bodies import AddReplicasBody, RemoveReplicasBody
from hotswap.entrypoints.server.state import ApiError, ServerState, StateDep

router = APIRouter()


def _fleet(state: ServerState) -> ReplicaControl:
    replicas = state.engine.replicas
    if replicas is None:
        raise ApiError(404, "this server runs one engine, not a fleet", "not_found")
    return replicas


def _status(state: ServerState) -> dict[str, Any]:
    now = state.engine.status()
    return {
        "weight_version": now.weight_version_label,
        "version_id": now.weight_version,
        "replicas": _fleet(state).replica_status(),
    }


@router.get("/fleet_status")
async def fleet_status(state: StateDep) -> dict[str, object]:
    """The fleet's version and, per replica, its state, version, routing and last health report."""
    return _status(state)


@router.post("/fleet/add_replicas")
async def add_replicas(state: StateDep, body: AddReplicasBody | None = None) -> dict[str, object]:
    """Starts `n` replicas and answers once they serve the fleet's version (checksums checked against a live
    replica's): `added` (their indices) and the fleet's status. An update session in flight completes first."""
    added = await _fleet(state).add_replicas((body or AddReplicasBody()).n)
    return {"added": added, **_status(state)}


@router.post("/fleet/remove_replicas")
async def remove_replicas(body: RemoveReplicasBody, state: StateDep) -> dict[str, object]:
    """Takes `n` replicas (or those `indices` names) out of routing at once, lets their requests finish (up to
    `drain_timeout_s`), then stops them; answers `removed` and the fleet's status. 400 for a removal that would
    leave no replica."""
    removed = await _fleet(state).remove_replicas(body.n, body.indices, body.drain_timeout_s)
    return {"removed": removed, **_status(state)}
