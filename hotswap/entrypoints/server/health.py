"""`/health`, `/liveness` and `/metrics`, served without a key; and the metric names the server exports.

`/health` answers 200 `{"status": "ok"}`, or 503 with the reason when the engine cannot serve (a dead worker,
invalid weights) or the server is not ready yet (`--join`: catching up with a live server), without calling the
workers. `/liveness` makes a round trip through them (see `liveness`).
`/metrics` answers every metric in Prometheus' text format, reading the engine's figures
(requests running, speculative decoding's counters, a fleet's replicas) when scraped.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from hotswap.entrypoints.metrics import Metrics
from hotswap.entrypoints.openai_protocol import error_body
from hotswap.entrypoints.server.state import StateDep
from hotswap.errors import EngineBusy, EngineUnresponsive

router = APIRouter()

# engine stats -> Prometheus names, with speculative decoding on
SPEC_METRICS = {
    "spec_draft_tokens": "hotswap_spec_draft_tokens",
    "spec_accepted_tokens": "hotswap_spec_accepted_tokens",
    "spec_steps": "hotswap_spec_steps",
    "spec_acceptance_rate": "hotswap_spec_acceptance_rate",
    "spec_mean_accepted_length": "hotswap_spec_mean_accepted_length",
    "draft_weight_version": "hotswap_draft_weight_version",
    "draft_stale": "hotswap_draft_stale",
}
# sessions (hotswap/engine/sessions.py): their hit rate is cached / prompt tokens, from each one's second request
SESSION_METRICS = {
    "open_sessions": "hotswap_sessions_open",
    "session_later_prompt_tokens": "hotswap_session_prompt_tokens",
    "session_later_cached_tokens": "hotswap_session_cached_tokens",
    "session_cached_blocks": "hotswap_session_cached_blocks",
}
SESSION_METRIC_HELP = {
    "hotswap_sessions_open": ("gauge", "Open sessions"),
    "hotswap_session_prompt_tokens": ("gauge", "Prompt tokens of open sessions' requests after their first"),
    "hotswap_session_cached_tokens": ("gauge", "Of those, tokens found in the prefix cache"),
    "hotswap_session_cached_blocks": ("gauge", "Free cached KV blocks held with priority for open sessions"),
}
SPEC_METRIC_HELP = {
    "hotswap_spec_draft_tokens": ("counter", "Speculative tokens proposed"),
    "hotswap_spec_accepted_tokens": ("counter", "Speculative tokens the target accepted"),
    "hotswap_spec_steps": ("counter", "Speculative verification steps (one per sequence and step)"),
    "hotswap_spec_acceptance_rate": ("gauge", "Accepted / proposed speculative tokens since start"),
    "hotswap_spec_mean_accepted_length": ("gauge", "Tokens emitted per verification step since start"),
    "hotswap_draft_weight_version": ("gauge", "The target weight version the draft model was last updated for"),
    "hotswap_draft_stale": ("gauge", "1 while the target was updated after the draft model"),
}

# a fleet's stats -> Prometheus names (and per replica, labelled replica="i": up, weight version, requests routed)
FLEET_METRICS = {
    "fleet_replicas": "hotswap_fleet_replicas",
    "fleet_replicas_up": "hotswap_fleet_replicas_up",
    "fleet_updates_committed": "hotswap_fleet_updates_committed",
    "fleet_updates_failed": "hotswap_fleet_updates_failed",
    "fleet_replica_failures": "hotswap_fleet_replica_failures",
    "fleet_replica_restarts": "hotswap_fleet_replica_restarts",
}
FLEET_METRIC_HELP = {
    "hotswap_fleet_replicas": ("gauge", "Replicas in the fleet"),
    "hotswap_fleet_replicas_up": ("gauge", "Replicas taking requests (up, at the fleet's weight version)"),
    "hotswap_fleet_updates_committed": ("counter", "Fleet-wide weight changes committed on every replica"),
    "hotswap_fleet_updates_failed": ("counter", "Fleet-wide weight changes rolled back on every replica"),
    "hotswap_fleet_replica_failures": ("counter", "Replicas found dead or unresponsive"),
    "hotswap_fleet_replica_restarts": ("counter", "Replicas restarted and brought to the fleet's version"),
    "hotswap_fleet_replica_up": ("gauge", "1 while the replica takes requests"),
    "hotswap_fleet_replica_weight_version": ("gauge", "The weight version the replica holds"),
    "hotswap_fleet_replica_requests_routed": ("counter", "Requests routed to the replica"),
}


def server_metrics(fleet: bool, weight_version_label: str) -> Metrics:
    """The server's metrics, described (a fleet's too when `fleet`), the weight version starting at 0 with
    `weight_version_label` as its label."""
    metrics = Metrics()
    metrics.describe("hotswap_requests", "counter", "Requests by route and status")
    metrics.describe("hotswap_prompt_tokens", "counter", "Prompt tokens processed")
    metrics.describe("hotswap_generation_tokens", "counter", "Tokens generated")
    metrics.describe("hotswap_request_latency_seconds", "summary", "End-to-end latency of generation requests")
    metrics.describe("hotswap_weight_version", "gauge", "Weight version being served (the integer that orders them)")
    metrics.describe("hotswap_weight_version_info", "gauge", "1, labelled with the served version's label")
    for name, (kind, text) in (SPEC_METRIC_HELP | SESSION_METRIC_HELP).items():
        metrics.describe(name, kind, text)
    if fleet:
        for name, (kind, text) in FLEET_METRIC_HELP.items():
            metrics.describe(name, kind, text)
    metrics.describe("hotswap_requests_running", "gauge", "Requests queued or being generated")
    metrics.describe("hotswap_weight_update_seconds", "summary", "Duration of weight updates (start to finish)")
    metrics.set("hotswap_weight_version", 0)
    metrics.set_only("hotswap_weight_version_info", 1, weight_version=weight_version_label)
    return metrics


@router.get("/health")
async def health(state: StateDep) -> JSONResponse:
    if state.not_ready is not None:  # --join: catching up with a live server (or it failed to)
        return JSONResponse({"status": "not_ready", "reason": state.not_ready}, status_code=503)
    problem = state.engine.status().health_problem
    if problem is not None:
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/liveness")
async def liveness(state: StateDep, timeout_s: float = 5.0) -> JSONResponse:
    """A no-op round trip through every worker (every routable replica of a fleet) once the engine is between
    steps, within `timeout_s` (query parameter, 0.1-60): 200 with its milliseconds; 200 `{"status": "busy"}` while
    an admin call (a reload, an update) held the engine all along; or 503 `engine_unresponsive`.
    `/health` stays the cheap check (no worker call)."""
    if not 0.1 <= timeout_s <= 60:
        return JSONResponse(
            error_body(f"timeout_s must be in [0.1, 60], got {timeout_s}", "invalid_request_error", 400, "timeout_s"),
            status_code=400,
        )
    try:
        seconds = await state.engine.check_liveness(timeout_s)
    except EngineBusy as err:  # alive: an update or reload holds the engine (its own timeouts bound it)
        return JSONResponse({"status": "busy", "reason": str(err)})
    except EngineUnresponsive as err:
        return JSONResponse(error_body(str(err), "engine_unresponsive", 503), status_code=503)
    return JSONResponse({"status": "ok", "round_trip_ms": round(seconds * 1e3, 3)})


@router.get("/metrics", response_class=PlainTextResponse)
async def get_metrics(state: StateDep) -> str:
    engine, metrics = state.engine, state.metrics
    now = engine.status()
    metrics.set("hotswap_requests_running", now.requests)
    stats = now.stats
    for key, name in (SPEC_METRICS | SESSION_METRICS).items():
        if key in stats:
            metrics.set(name, float(stats[key]))
    if engine.replicas is not None:
        for key, name in FLEET_METRICS.items():
            metrics.set(name, float(stats[key]))
        for replica in engine.replicas.replica_status():
            label = str(replica["index"])
            metrics.set("hotswap_fleet_replica_up", float(replica["routable"]), replica=label)
            metrics.set("hotswap_fleet_replica_weight_version", float(replica["version_id"]), replica=label)
            metrics.set("hotswap_fleet_replica_requests_routed", float(replica["routed"]), replica=label)
    return metrics.render()
