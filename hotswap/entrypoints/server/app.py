"""The app factory of the OpenAI-compatible HTTP server with an authenticated admin API for RL weight updates.

OpenAI routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`, streaming over SSE) need
`Authorization: Bearer <api key>` when one is set. Admin routes (weights, generation control, inspection,
allow-listed `collective_rpc`) need `Authorization: Bearer <admin key>`, and are never open by accident:
- without an admin key they answer 403, unless `admin_auth="none"` opens them on purpose (loopback hosts
  only; it logs a warning), for a trusted network whose RL framework sends no key;
- empty keys are refused at start;
- an admin request whose Host header is not an allowed host (DNS rebinding), or that carries an Origin header
  (a web page's cross-site request), is refused with 403.
Client mistakes get 4xx in OpenAI's error shape. `/health` answers 503 with the reason when the engine cannot
serve (a dead worker, invalid weights).

The routes are routers by surface (`health`, `openai`, `sglang`, `fleet`, `vllm_rl`); this module adds the
authentication, the error handlers, the request-size guard and the lifespan around them (which loads the
`--lora-modules` adapters before the first request). LoRA adapters are loaded and unloaded through admin routes
(vLLM's `/v1/load_lora_adapter`, SGLang's `/load_lora_adapter`, ...); a request runs with one by naming it as its
`model` (OpenAI routes) or `lora_path` (`/generate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import secrets
from collections.abc import AsyncIterator, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import hotswap.entrypoints.server.chat as chat_routes
import hotswap.entrypoints.server.fleet as fleet
import hotswap.entrypoints.server.health as health
import hotswap.entrypoints.server.join as join
import hotswap.entrypoints.server.openai as openai
import hotswap.entrypoints.server.scoring as scoring
import hotswap.entrypoints.server.sglang as sglang
import hotswap.entrypoints.server.sglang_weights as sglang_weights
import hotswap.entrypoints.server.vllm_rl as vllm_rl
from hotswap.engine.client import EngineClient
from hotswap.entrypoints import openai_protocol as oai
from hotswap.entrypoints.metrics import Metrics
from hotswap.entrypoints.server.state import (
    ENGINE_ERRORS,
    ApiError,
    ChatSettings,
    RequestLimits,
    ServerState,
    api_error,
    get_state,
)

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_LIMITS = RequestLimits()
logger = logging.getLogger(__name__)


class BodyTooLarge(BaseException):
    """Raised from `receive` past the body limit. A BaseException, so that the framework's body parsing (which
    turns an Exception into a 400) lets it reach the middleware that answers 413."""


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else None


def _host_name(host_header: str) -> str:
    """The host part of a Host header ("example.com:8000" -> "example.com", "[::1]:80" -> "::1")."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def check_keys(api_key: str | None, admin_key: str | None) -> None:
    """Raises ValueError for an empty (or blank) key: it would otherwise match a request without one."""
    for flag, key in (("--api-key", api_key), ("--admin-key", admin_key)):
        if key is not None and not key.strip():
            raise ValueError(f"{flag} is empty; give a real key, or leave the option out")


# ---- authentication (FastAPI dependencies) ------------------------------------------------------------------


def _check(expected: str | None, request: Request) -> None:
    """Raises a 401 ApiError unless the request's bearer token is `expected` (None: no key asked)."""
    given = (_bearer(request) or "").encode("utf-8", "surrogateescape")
    if expected is not None and not secrets.compare_digest(given, expected.encode()):
        raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)", "authentication_error")


def user_auth(request: Request) -> None:
    """The user's API key, when the server has one (401 otherwise)."""
    _check(get_state(request).api_key, request)


def require_admin(request: Request) -> None:
    """An admin request: an allowed Host and no Origin (403 otherwise), then the admin key (401), unless
    admin_auth is "none"; without an admin key (and admin_auth "key") the admin routes are off (403)."""
    state = get_state(request)
    host = _host_name(request.headers.get("host", "")).lower()
    if state.allowed_hosts is not None and host not in state.allowed_hosts:
        raise ApiError(
            403,
            f"admin routes do not answer for Host {host!r} (allowed: {sorted(state.allowed_hosts)})",
            "permission_error",
        )
    if "origin" in request.headers:
        raise ApiError(403, "admin routes refuse cross-origin (browser) requests", "permission_error")
    if state.admin_auth == "none":
        return
    if state.admin_key is None:
        raise ApiError(
            403,
            "admin routes are off: start the server with --admin-key (or --admin-auth none on a trusted network)",
            "permission_error",
        )
    _check(state.admin_key, request)


def require_ready(request: Request) -> None:
    """Every route but /health, /liveness and /metrics: 503 with Retry-After until the server serves (`--join`:
    until it caught up with the live server)."""
    reason = get_state(request).not_ready
    if reason is not None:
        raise ApiError(503, f"not ready: {reason}", "service_unavailable", {"Retry-After": "5"})


# ---- errors -----------------------------------------------------------------------------------------------


async def _api_error(_: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(oai.error_body(err.message, err.kind, err.status), status_code=err.status, headers=err.headers)


async def _engine_error(request: Request, err: Exception) -> JSONResponse:
    """An engine error a route let through, answered as `api_error` maps it (400, 409, 503, 504)."""
    mapped = api_error(err)
    assert mapped is not None  # handlers are registered for ENGINE_ERRORS alone
    return await _api_error(request, mapped)


async def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in err.errors()
    )
    return JSONResponse(oai.error_body(problems or "invalid request", "invalid_request_error", 400), status_code=400)


async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(oai.error_body(str(err.detail), "invalid_request_error", err.status_code), err.status_code)


# ---- middleware -------------------------------------------------------------------------------------------


class Guard:
    """Pure ASGI middleware (unlike @app.middleware, it keeps disconnect detection working for streams):
    refuses request bodies over `limits.max_request_bytes` with 413 before they are read into memory or
    tokenized (by Content-Length when given, else as the bytes arrive), and counts responses by route."""

    def __init__(self, inner: ASGIApp, limits: RequestLimits, metrics: Metrics) -> None:
        self.inner, self.limits, self.metrics = inner, limits, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        limit = self.limits.max_request_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(send, limit)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return message

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                # the matched route's template, never the raw path: a bounded set of label values
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                self.metrics.inc("hotswap_requests", route=route, status=str(message["status"]))
            await send(message)

        try:
            await self.inner(scope, counting_receive, counting_send)
        except BodyTooLarge:
            await _too_large(counting_send, limit)


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps(
        oai.error_body(f"request body over {limit} bytes (--max-request-bytes)", "invalid_request_error", 413)
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    for name, path in app.state.lora_modules:  # --lora-modules: loaded before the server answers
        try:
            await state.engine.load_lora_adapter(name, path)
        except Exception as err:
            logger.error("cannot load LoRA adapter %r from %r (--lora-modules): %s", name, path, err)
            await state.engine.shutdown()  # the start fails: its workers go too
            raise
    catching_up = None if app.state.join is None else asyncio.create_task(join.catch_up(state, app.state.join))
    yield
    if catching_up is not None:
        catching_up.cancel()
    await state.engine.shutdown()  # on server shutdown (SIGTERM): requests still in flight end


# ---- the app ----------------------------------------------------------------------------------------------


def create_app(
    engine: EngineClient,
    served_model_name: str,
    api_key: str | None = None,
    admin_key: str | None = None,
    enable_admin: bool = True,
    admin_auth: str = "key",
    allowed_hosts: frozenset[str] | None = LOOPBACK_NAMES,
    limits: RequestLimits = DEFAULT_LIMITS,
    chat: ChatSettings | None = None,
    lora_modules: Sequence[tuple[str, str]] = (),
    join_source: join.JoinSource | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine`. `admin_auth` "key" (admin routes need `admin_key`; without one they are
    off) or "none" (no key asked: a trusted network). Admin requests must name one of `allowed_hosts` in their
    Host header (None: any, for a server bound to a public address, where the key is what protects them).
    `lora_modules`: (name, PEFT folder) adapters loaded at start-up (a failure stops the start). `join_source`: a
    live server whose committed state this one copies before any route but /health, /liveness and /metrics
    answers (`join.catch_up`). Raises ValueError for empty keys or an unknown `admin_auth`."""
    check_keys(api_key, admin_key)
    if admin_auth not in ("key", "none"):
        raise ValueError(f"admin_auth must be 'key' or 'none', got {admin_auth!r}")
    if enable_admin and admin_auth == "none":
        logger.warning(
            "admin routes answer WITHOUT a key (admin_auth='none'): anyone who reaches this port can "
            "change the served weights; use this on a trusted network only"
        )

    app = FastAPI(title="hotswap", version="0.1.0", lifespan=_lifespan)
    metrics = health.server_metrics(engine.replicas is not None, engine.status().weight_version_label)
    app.state.server = ServerState(
        engine=engine,
        served_model_name=served_model_name,
        metrics=metrics,
        limits=limits,
        api_key=api_key,
        admin_key=admin_key,
        admin_auth=admin_auth,
        allowed_hosts=allowed_hosts,
        vocab_size=int(engine.config.model_config.hf_config.get("vocab_size", 0)),
        chat=chat or ChatSettings(),
    )
    app.state.lora_modules = list(lora_modules)
    app.state.join = join_source
    if join_source is not None:
        app.state.server.not_ready = f"catching up with {join_source.url} (--join)"
    app.exception_handler(ApiError)(_api_error)
    for kind in ENGINE_ERRORS:  # what a route lets an engine call raise
        app.exception_handler(kind)(_engine_error)
    app.exception_handler(RequestValidationError)(_validation)
    app.exception_handler(StarletteHTTPException)(_http)
    app.add_middleware(Guard, limits=limits, metrics=metrics)

    # FastAPI takes the first route that matches: the order below is the order routes are tried (and listed)
    ready = Depends(require_ready)
    user, admin = [Depends(user_auth), ready], [Depends(require_admin), ready]
    one_engine = engine.local is not None  # SGLang's admin routes and /export_state serve one engine
    app.include_router(health.router)
    app.include_router(openai.router, dependencies=user)
    app.include_router(chat_routes.router, dependencies=user)
    app.include_router(scoring.router, dependencies=user)
    app.include_router(sglang.generate_router, dependencies=user)
    app.include_router(sglang.public_router, dependencies=[ready])
    if not enable_admin:
        return app
    if one_engine:
        app.include_router(sglang.admin_router, dependencies=admin)
        app.include_router(sglang_weights.weights_router, dependencies=admin)
        app.include_router(join.router, dependencies=admin)
    else:
        app.include_router(fleet.router, dependencies=admin)
    app.include_router(sglang_weights.lora_router, dependencies=admin)
    app.include_router(vllm_rl.router, dependencies=admin)
    app.include_router(openai.tokenizer_router, dependencies=user)  # served only with the admin routes on
    return app
