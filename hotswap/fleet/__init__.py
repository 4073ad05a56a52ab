"""Data-parallel replicas on Ray behind one router, with fleet-wide two-phase weight updates (needs `hotswap[ray]`)."""

from hotswap.fleet.fleet import Fleet
from hotswap.fleet.replicas import FleetUpdateFailed

__all__ = ["Fleet", "FleetUpdateFailed"]
