"""A server that joins a running one (`hotswap serve MODEL --join URL`), and the admin route it copies from.

The live server answers `GET /export_state` (admin): one snapshot, taken between two engine steps and refused
(409) while a weight update is open, of its committed version (integer, label, the labels before it), its model
folder, its live config, its LoRA adapters (descriptions and whole tensors), the SHA-256 checksums of every rank's
weights and, with `?weights=true`, every rank's parameters and buffers. The body is a stream of frames: an 8-byte
little-endian length, a JSON header, then (for a tensor) its raw bytes.

The joining server builds its engine from MODEL, then, before it serves anything (`/health` answers 503 and every
other route but `/metrics` and `/liveness` 503 with Retry-After), catches up (`catch_up`):
1. it takes the live server's snapshot without weights and applies its live config;
2. if the live server's folder differs from its own and is readable here, it reloads it; if its weights then have
   the snapshot's checksums (the live version came from that folder) nothing more moves, else it streams the
   live server's weights (`?weights=true`) and adopts them (same model, dtype and tensor_parallel_size needed),
   and checks their checksums against the snapshot's;
3. it takes the snapshot's version, label and LoRA adapters (its own adapters are dropped first);
4. it compares its checksums with the live server's `/weight_checksums` and its label with the live label: if the
   live server moved on meanwhile (a run of updates), it begins again; an update open on the live server is
   waited for (409s are retried). Only when both agree does it open its routes.
A failure that retrying cannot mend (another model, a config the engine refuses) or `--join-timeout-s` elapsing
leaves the server up but unready: `/health` answers 503 with the reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from hotswap.config import LIVE_FIELDS, EngineConfig
from hotswap.engine.client import LocalEngine
from hotswap.engine.llm_engine import LLMEngine
from hotswap.engine.state import EngineState
from hotswap.entrypoints.server.state import ApiError, ServerState, StateDep
from hotswap.fleet.replica import adopt_lora_exports, lora_exports

logger = logging.getLogger(__name__)
router = APIRouter()

_LENGTH = struct.Struct("<Q")
_RETRIED_STATUSES = (409, 502, 503, 504)  # the live server is busy (an update is open) or not reachable now


@dataclass(frozen=True)
class JoinSource:
    """The live server a new one copies its state from (`--join`, `--join-admin-key`, `--join-timeout-s`)."""

    url: str
    admin_key: str | None = None
    timeout_s: float = 600.0


# ---- the live server's side ---------------------------------------------------------------------------------


@router.get("/export_state")
async def export_state(state: StateDep, weights: bool = Query(False)) -> StreamingResponse:
    """The committed state a joining server copies (see the module docstring); 409 while a weight update is open
    or the engine sleeps, 404 on a fleet's server (add replicas with /fleet/add_replicas)."""
    engine = state.engine.local
    if engine is None:
        raise ApiError(404, "this server runs a fleet: add replicas with /fleet/add_replicas", "not_found")
    snapshot = await engine.between_steps(_snapshot, weights)
    return StreamingResponse(_frames(snapshot), media_type="application/octet-stream")


def _snapshot(engine: LLMEngine, weights: bool) -> dict[str, Any]:
    """Runs between two steps: the committed state, its checksums, its adapters and (with `weights`) its tensors."""
    if engine.state is EngineState.UPDATING:
        raise RuntimeError("a weight update is open on this server; its state is copied once the update ends")
    if engine.is_asleep():
        raise RuntimeError("this server sleeps; wake it up before another server copies its state")
    w, config = engine.weights, engine.config
    loras = lora_exports(engine)
    meta = {
        "kind": "state",
        "version_id": w.version,
        "draft_version_id": w.draft_version,
        "weight_version": w.current_label,
        "labels": {str(k): v for k, v in w.labels.snapshot().items()},
        "model": config.model_config.model,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "config": live_settings(config),
        "checksums": engine.executor.collective_rpc("weight_checksums", (_which(config),)),
        "loras": engine.loras.describe() if engine.loras is not None else [],
        "lora_exports": [{k: v for k, v in entry.items() if k != "tensors"} for entry in loras],
    }
    return {"meta": meta, "states": w.export_weights() if weights else [], "loras": loras}


def _frames(snapshot: dict[str, Any]) -> Iterator[bytes]:
    """The snapshot as frames (the tensors' bytes without a copy where torch allows)."""
    yield _header(snapshot["meta"])
    count = 0
    for rank, tensors in enumerate(snapshot["states"]):
        for name, tensor in tensors.items():
            yield from _tensor_frame({"kind": "weight", "rank": rank, "name": name}, tensor)
            count += 1
    for entry in snapshot["loras"]:
        for name, tensor in entry["tensors"].items():
            yield from _tensor_frame({"kind": "lora", "adapter": entry["lora_name"], "name": name}, tensor)
            count += 1
    yield _header({"kind": "end", "tensors": count})


def _header(header: dict[str, Any]) -> bytes:
    data = json.dumps(header).encode()
    return _LENGTH.pack(len(data)) + data


def _tensor_frame(header: dict[str, Any], tensor: torch.Tensor) -> Iterator[bytes]:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    yield _header(
        {
            **header,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "nbytes": flat.numel(),
        }
    )
    if flat.numel():
        yield flat.numpy().tobytes()


def live_settings(config: EngineConfig) -> dict[str, dict[str, Any]]:
    """The live config fields' values (`LIVE_FIELDS`, the model folder aside: a joining server loads it itself),
    as JSON; a section the engine does not use (speculative decoding off) is left out."""
    out: dict[str, dict[str, Any]] = {}
    for section, names in LIVE_FIELDS.items():
        if section == "model_config" or (section == "speculative_config" and not config.speculative_config.enabled):
            continue
        values = {name: getattr(getattr(config, section), name) for name in sorted(names)}
        out[section] = json.loads(json.dumps(values, default=str))
    return out


def _which(config: EngineConfig) -> str:
    """The weights checksums cover: the draft model's too when there is one."""
    return "all" if config.draft_model_config is not None else "model"


# ---- the joining server's side ------------------------------------------------------------------------------


class _Retry(Exception):
    """The live server cannot give a consistent state now (an update is open, it moved on, it is unreachable)."""


async def catch_up(state: ServerState, source: JoinSource) -> None:
    """Brings this server's engine to the live server's committed state, then opens its routes
    (`state.not_ready` None). Retries while the live server is busy or moves on, until `source.timeout_s`; a
    failure leaves the routes closed with the reason in `state.not_ready` (what /health answers)."""
    engine = state.engine.local
    assert engine is not None  # serve() refuses --join with a fleet
    started = time.monotonic()
    deadline = started + source.timeout_s
    headers = {"Authorization": f"Bearer {source.admin_key}"} if source.admin_key else {}
    delay, attempts = 0.2, 0
    try:
        async with httpx.AsyncClient(
            base_url=source.url.rstrip("/"), headers=headers, timeout=httpx.Timeout(60.0, read=source.timeout_s)
        ) as http:
            while True:
                attempts += 1
                try:
                    report = await _attempt(engine, http)
                    break
                except (_Retry, httpx.TransportError) as err:
                    if time.monotonic() + delay > deadline:
                        raise TimeoutError(
                            f"no consistent state within {source.timeout_s:g} s (--join-timeout-s) "
                            f"after {attempts} attempts; last: {err}"
                        ) from err
                    logger.info("catching up with %s: %s; trying again", source.url, err)
                    await asyncio.sleep(delay)
                    delay = min(5.0, 2 * delay)
    except Exception as err:  # (a cancellation, on shutdown, passes)
        state.not_ready = f"could not catch up with {source.url} (--join): {type(err).__name__}: {err}"
        logger.error("%s", state.not_ready)
        return
    state.version_changed()
    state.not_ready = None
    logger.warning(
        "caught up with %s in %.1f s (%d attempt(s)): version %r, weights from %s, %d LoRA adapter(s), "
        "checksums equal; serving",
        source.url,
        time.monotonic() - started,
        attempts,
        report["weight_version"],
        report["restored_from"],
        report["loras"],
    )


async def _attempt(engine: LocalEngine, http: httpx.AsyncClient) -> dict[str, Any]:
    """One try at the live server's state (see the module docstring); raises _Retry where trying again may do."""
    meta, loras, _ = await _fetch(http, weights=False)
    config = engine.config
    changes = {
        section: {k: v for k, v in values.items() if _live_value(config, section, k) != v}
        for section, values in meta["config"].items()
    }
    changes = {section: values for section, values in changes.items() if values}
    if changes:
        await engine.update_config(changes)
    folder = meta["model"]
    if folder != config.model_config.model and os.path.isdir(folder):  # the live folder, read here
        await engine.reload_weights(weights_path=folder)
    restored = "folder"
    if await engine.collective_rpc("weight_checksums", (_which(config),)) != meta["checksums"]:
        copied, loras, states = await _fetch(http, weights=True)
        if copied["version_id"] != meta["version_id"]:
            raise _Retry(
                f"the live server moved from version {meta['weight_version']!r} to {copied['weight_version']!r}"
            )
        meta, restored = copied, "copy"
        await engine.adopt_weights(states, meta["version_id"], meta["draft_version_id"])
        if await engine.collective_rpc("weight_checksums", (_which(config),)) != meta["checksums"]:
            raise RuntimeError("the copied weights' checksums differ from the live server's")
    labels = {int(k): v for k, v in meta["labels"].items()}
    await engine.between_steps(_set_versions, meta["version_id"], meta["draft_version_id"], labels)
    if config.lora_config.enable_lora:
        for adapter in await engine.list_loras():  # the live server's adapters, and only those
            await engine.unload_lora_adapter(adapter["lora_name"])
        await engine.between_steps(adopt_lora_exports, loras)
        if await engine.list_loras() != meta["loras"]:
            raise RuntimeError(
                f"the copied LoRA adapters {await engine.list_loras()} differ from the live server's {meta['loras']}"
            )
    elif meta["loras"]:
        raise ValueError("the live server serves LoRA adapters; start this one with --enable-lora")
    live = await _get_json(http, "/weight_checksums")
    mine = (await engine.collective_rpc("weight_checksums"))[0]
    if live["weight_version"] != meta["weight_version"] or live["checksums"] != mine:
        raise _Retry(
            f"the live server moved on (it serves {live['weight_version']!r}, this copy {meta['weight_version']!r})"
        )
    return {"weight_version": meta["weight_version"], "restored_from": restored, "loras": len(meta["loras"])}


def _set_versions(engine: LLMEngine, version: int, draft_version: int, labels: dict[int, str]) -> None:
    """Numbers the served weights as the live server's, with its labels."""
    engine.weights.set_versions(version, draft_version, labels)


def _live_value(config: EngineConfig, section: str, name: str) -> Any:
    return json.loads(json.dumps(getattr(getattr(config, section), name), default=str))


async def _get_json(http: httpx.AsyncClient, path: str) -> Any:
    response = await http.get(path)
    if response.status_code >= 400:
        _refused(response.status_code, response.text)
    return response.json()


def _refused(status: int, text: str) -> None:
    """Raises for an error answer of the live server: _Retry for a busy one, RuntimeError otherwise."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:500]
    if status in _RETRIED_STATUSES:
        raise _Retry(f"the live server answered {status}: {message}")
    raise RuntimeError(f"the live server refused ({status}): {message}")


async def _fetch(
    http: httpx.AsyncClient, weights: bool
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, torch.Tensor]]]:
    """The live server's snapshot: its header, its adapters (as `adopt_lora_exports` takes them) and, with
    `weights`, every rank's tensors."""
    async with http.stream("GET", "/export_state", params={"weights": str(weights).lower()}) as response:
        if response.status_code >= 400:
            _refused(response.status_code, (await response.aread()).decode(errors="replace"))
        reader = _Reader(response.aiter_bytes())
        meta = await reader.header()
        states: list[dict[str, torch.Tensor]] = [{} for _ in range(meta["tensor_parallel_size"] if weights else 0)]
        loras = {e["lora_name"]: {**e, "tensors": {}} for e in meta["lora_exports"]}
        count = 0
        while (header := await reader.header())["kind"] != "end":
            tensor = _tensor(header, await reader.read(header["nbytes"]))
            if header["kind"] == "weight":
                states[header["rank"]][header["name"]] = tensor
            else:
                loras[header["adapter"]]["tensors"][header["name"]] = tensor
            count += 1
        if header["tensors"] != count:
            raise _Retry(f"the state stream carried {count} tensors of {header['tensors']}")
    return meta, list(loras.values()), states


def _tensor(header: dict[str, Any], data: bytearray) -> torch.Tensor:
    dtype = getattr(torch, str(header["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeError(f"the live server sent a tensor of unknown dtype {header['dtype']!r}")
    if not data:
        return torch.empty(header["shape"], dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(header["shape"])


class _Reader:
    """Reads frames off a byte stream."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks, self.buffer = chunks, bytearray()

    async def read(self, size: int) -> bytearray:
        while len(self.buffer) < size:
            chunk = await anext(self.chunks, None)
            if chunk is None:
                raise _Retry("the state stream ended early")
            self.buffer += chunk
        data = self.buffer[:size]
        del self.buffer[:size]
        return data

    async def header(self) -> dict[str, Any]:
        (length,) = _LENGTH.unpack(await self.read(_LENGTH.size))
        header: dict[str, Any] = json.loads(await self.read(length))
        return header
