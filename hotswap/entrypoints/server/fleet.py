"""A fleet's admin routes: `/fleet_status` (its weight version and its replicas), `/fleet/add_replicas` and
`/fleet/remove_replicas` (replicas joining and leaving a running fleet). `create_app` includes `router` behind the
admin key when the engine is an `AsyncFleet`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from hotswap.entrypoints.server.bodies import AddReplicasBody, RemoveReplicasBody
from hotswap.entrypoints.server.state import ApiError, ServerState, StateDep
from hotswap.fleet.async_fleet import AsyncFleet

router = APIRouter()


def _fleet(state: ServerState) -> AsyncFleet:
    engine = state.engine
    if not isinstance(engine, AsyncFleet):
        raise ApiError(404, "this server runs one engine, not a fleet", "not_found")
    return engine


def _status(engine: AsyncFleet) -> dict[str, Any]:
    return {
        "weight_version": engine.fleet.get_weight_version_label(),
        "version_id": engine.fleet.version,
        "replicas": engine.fleet.replica_status(),
    }


@router.get("/fleet_status")
async def fleet_status(state: StateDep) -> dict[str, Any]:
    """The fleet's version and, per replica, its state, version, routing and last health report."""
    return _status(_fleet(state))


@router.post("/fleet/add_replicas")
async def add_replicas(state: StateDep, body: AddReplicasBody | None = None) -> dict[str, Any]:
    """Starts `n` replicas and answers once they serve the fleet's version (checksums checked against a live
    replica's): `added` (their indices) and the fleet's status. An update session in flight completes first."""
    engine = _fleet(state)
    added = await state.guarded(engine.add_replicas((body or AddReplicasBody()).n))
    return {"added": added, **_status(engine)}


@router.post("/fleet/remove_replicas")
async def remove_replicas(body: RemoveReplicasBody, state: StateDep) -> dict[str, Any]:
    """Takes `n` replicas (or those `indices` names) out of routing at once, lets their requests finish (up to
    `drain_timeout_s`), then stops them; answers `removed` and the fleet's status. 400 for a removal that would
    leave no replica."""
    engine = _fleet(state)
    removed = await state.guarded(engine.remove_replicas(body.n, body.indices, body.drain_timeout_s))
    return {"removed": removed, **_status(engine)}
