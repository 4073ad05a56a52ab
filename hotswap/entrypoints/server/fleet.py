"""`/fleet_status`: a fleet's weight version and its replicas. `create_app` includes `router` behind the admin key
when the engine is an `AsyncFleet`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from hotswap.entrypoints.server.state import ApiError, StateDep
from hotswap.fleet.async_fleet import AsyncFleet

router = APIRouter()


@router.get("/fleet_status")
async def fleet_status(state: StateDep) -> dict[str, Any]:
    """The fleet's version and, per replica, its state, version, routing and last health report."""
    engine = state.engine
    if not isinstance(engine, AsyncFleet):
        raise ApiError(404, "this server runs one engine, not a fleet", "not_found")
    return {"weight_version": engine.fleet.get_weight_version_label(), "version_id": engine.fleet.version,
            "replicas": engine.fleet.replica_status()}
