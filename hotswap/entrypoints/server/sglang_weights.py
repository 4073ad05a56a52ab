"""SGLang's weight and LoRA admin routes: disk reloads, a torch.distributed group's updates (inside an optional
`/begin_weight_update` session, or each one its own), a colocated trainer's tensors, and adapters loaded from a
folder or from tensors. Each runs through the same engine verbs as hotswap's own routes (validated, atomic,
versioned); a refusal or failure is SGLang's 400 `{"success": false, "message": ...}`, the weights untouched.

`create_app` includes `weights_router` (one engine) and `lora_router` (one engine or a fleet) behind the admin key.
The `/begin_weight_update` session is the engine's open change (`EngineStatus.change`): the server keeps only the
token SGLang's route opened it with, so that a session another route opened is never fed or ended here; the
version `/update_weights_from_distributed` gives it is set on that change (`set_change_version`) and committed by
`/end_weight_update`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from hotswap.engine.client import EngineClient
from hotswap.entrypoints.server.bodies import TensorUpdateBody
from hotswap.entrypoints.server.sglang import EngineDep
from hotswap.entrypoints.server.state import ServerState, StateDep, api_error
from hotswap.entrypoints.sglang_protocol import (
    TENSOR_LOAD_FORMATS,
    DiskBody,
    DistributedBody,
    GroupBody,
    LoRANameBody,
    LoRAPathBody,
    LoRATensorsBody,
    SelectorBody,
    decode_tensors,
)
from hotswap.transfer.cuda_ipc import open_sglang, synchronize
from hotswap.weights.version import parse_version

T = TypeVar("T")

weights_router = APIRouter()
lora_router = APIRouter()


def fail(err: BaseException) -> JSONResponse:
    """SGLang's refusal: a 400 `{"success": false, "message": ...}`."""
    return JSONResponse({"success": False, "message": str(err)}, status_code=400)


def reason(err: BaseException) -> str:
    """What SGLang's refusal says of `err` (an engine error's message as `api_error` words it)."""
    mapped = api_error(err)
    return mapped.message if mapped is not None else str(err)


async def ok_or_400(awaitable: Awaitable[T]) -> tuple[T | None, JSONResponse | None]:
    """Runs an engine call: (its result, None), or (None, a 400 `{"success": false}`) for any refusal or failure
    (weights untouched)."""
    try:
        return await awaitable, None
    except Exception as err:
        return None, fail(Exception(reason(err)))


async def paused(engine: EngineClient, abort: bool) -> bool:
    """Pauses for an update unless already paused (abort: end requests now; else let them finish). Returns
    whether this call paused, so it resumes."""
    if engine.status().paused:
        return False
    await engine.pause_generation("abort" if abort else "wait", clear_cache=False)
    return True


@weights_router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: DiskBody, state: StateDep, engine: EngineDep) -> object:
    if body.load_format not in (None, "auto", "safetensors"):
        return fail(ValueError(f"load_format {body.load_format!r} is not supported (safetensors folders)"))
    try:
        parse_version(body.weight_version)  # checked before anything moves
    except ValueError as err:
        return fail(err)
    resume = await paused(engine, body.abort_all_requests)
    try:
        _, error = await ok_or_400(
            engine.reload_weights(
                weights_path=body.model_path,
                weight_version=body.weight_version,
                encoding=body.encoding,
                base_version=body.base_version,
                checksums=body.checksums,
            )
        )
    finally:
        if resume:
            await engine.resume_generation()
    if error is not None:
        return error
    state.version_changed()
    return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


@weights_router.post("/init_weights_update_group")
async def init_weights_update_group(body: GroupBody, engine: EngineDep) -> object:
    info: dict[str, object] = {
        "backend": "sglang_dist",
        "master_address": body.master_address,
        "master_port": body.master_port,
        "rank_offset": body.rank_offset,
        "world_size": body.world_size,
        "group_name": body.group_name,
        "dist_backend": body.backend,
    }
    _, error = await ok_or_400(engine.init_weight_transfer_engine(info))
    return error or {"success": True, "message": "Succeeded to initialize the weights update group."}


@weights_router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(engine: EngineDep) -> object:
    _, error = await ok_or_400(engine.shutdown_weight_transfer_engine())
    return error or {"success": True, "message": "Succeeded to destroy the weights update group."}


@weights_router.post("/begin_weight_update")
async def begin_weight_update(state: StateDep, engine: EngineDep, body: SelectorBody | None = None) -> object:
    selector = (body or SelectorBody()).selector
    has_draft = engine.config.draft_model_config is not None
    target = {"target": "model", "draft": "draft", "all": "all" if has_draft else "model"}[selector]
    token, error = await ok_or_400(engine.start_weight_update(target))
    if error is not None:
        return error
    state.sglang_token = token
    return {"success": True, "message": "Weight update session started."}


@weights_router.post("/end_weight_update")
async def end_weight_update(state: StateDep, engine: EngineDep) -> object:
    session = state.sglang_session()
    state.sglang_token = None
    if session is None:
        return fail(ValueError("no weight update session is open; call /begin_weight_update first"))
    _, error = await ok_or_400(engine.finish_weight_update(session.version, session.token))
    if error is not None:
        return error
    state.version_changed()
    return {"success": True, "message": "Weight update session ended."}


@weights_router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: DistributedBody, state: StateDep, engine: EngineDep) -> object:
    info: dict[str, object] = {
        "names": body.names,
        "dtypes": body.dtypes,
        "shapes": body.shapes,
        "load_format": body.load_format,
        **{
            k: v
            for k, v in (
                ("encoding", body.encoding),
                ("base_version", body.base_version),
                ("checksums", body.checksums),
            )
            if v is not None
        },
    }
    try:
        parse_version(body.weight_version)  # checked before anything moves
    except ValueError as err:
        return fail(err)
    if not body.names:  # an empty bucket changes nothing (and nothing is broadcast for it)
        return {"success": True, "message": "Nothing to update."}
    session = state.sglang_session()
    if session is not None:  # inside /begin_weight_update: one more update of that session
        _, error = await ok_or_400(engine.update_weights(info, session.token))
        if error is not None:
            state.sglang_token = None  # the failed update ended (and rolled back) the session
        elif body.weight_version is not None:  # the version /end_weight_update commits
            _, error = await ok_or_400(engine.set_change_version(body.weight_version, session.token))
        return error or {"success": True, "message": "Succeeded to update parameter online."}
    resume = await paused(engine, body.abort_all_requests)
    try:
        token, error = await ok_or_400(engine.start_weight_update("model"))
        if error is None:
            _, error = await ok_or_400(engine.update_weights(info, token))
        if error is None:
            _, error = await ok_or_400(engine.finish_weight_update(body.weight_version, token))
    finally:
        change = engine.status().change
        if token is not None and change is not None and change.token == token:  # never leave it open
            await engine.abort_weight_update(token)
        if resume:
            await engine.resume_generation()
    if error is not None:
        return error
    state.version_changed()
    return {"success": True, "message": "Succeeded to update parameter online."}


@weights_router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(body: TensorUpdateBody, state: StateDep, engine: EngineDep) -> object:
    """SGLang's: tensors that stay in a colocated trainer's memory. `serialized_named_tensors` is read by the restricted
    unpickler (hotswap.transfer.safe_pickle) and its handles opened onto the engine's device, all before anything
    pauses: a refused payload is a 400 naming the problem, the weights untouched. The tensors then load as one
    atomic, versioned reload (every value checked before the first write); the trainer's memory is let go, its
    reads finished, before the answer. Outside a /begin_weight_update session only."""
    device = torch.device(engine.config.model_config.device)
    try:
        parse_version(body.weight_version)  # checked before anything moves
        if state.sglang_session() is not None:
            raise ValueError(
                "/update_weights_from_tensor runs an update of its own; call it outside a "
                "/begin_weight_update session (/end_weight_update first)"
            )
        pairs = await asyncio.to_thread(open_sglang, body.serialized_named_tensors, body.load_format, device)
    except ValueError as err:
        return fail(err)
    await asyncio.to_thread(synchronize, device)  # the trainer's writes to what was opened are done
    resume = await paused(engine, body.abort_all_requests)
    try:
        _, error = await ok_or_400(
            engine.reload_weights(
                weights_iterator=pairs,
                weight_version=body.weight_version,
                encoding=body.encoding,
                base_version=body.base_version,
                checksums=body.checksums,
            )
        )
    finally:
        await asyncio.to_thread(synchronize, device)  # the engine's reads of the trainer's memory are done
        pairs.clear()
        if resume:
            await engine.resume_generation()
    if error is not None:
        return error
    state.version_changed()
    return {"success": True, "message": "Succeeded to update model weights from tensors."}


# ---- LoRA adapters (one engine or a fleet) ----------------------------------------------------------------


async def lora_update(state: ServerState, call: Callable[[], Awaitable[object]], message: str) -> JSONResponse:
    """Runs a LoRA load or unload and answers SGLang's LoRAUpdateOutput: 200 `{"success": true, "error_message":
    "", "loaded_adapters": {name: path}}` (a tensor-loaded adapter's path "__tensor__", as SGLang names it), or 400
    with `success: false` and the reason (nothing loaded changes); `message` repeats it, as SGLang's other routes
    answer."""
    try:
        state.check_lora_enabled()
        await call()
    except Exception as err:  # a ValueError above, or any error of the engine's
        why = reason(err)
        return JSONResponse(
            {
                "success": False,
                "error_message": why,
                "message": why,
                "loaded_adapters": await loaded_adapters(state),
            },
            status_code=400,
        )
    return JSONResponse(
        {"success": True, "error_message": "", "message": message, "loaded_adapters": await loaded_adapters(state)}
    )


async def loaded_adapters(state: ServerState) -> dict[str, str]:
    return {name: d["lora_path"] or "__tensor__" for name, d in (await state.loras()).items()}


async def _check_new_name(state: ServerState, name: str, upsert: bool) -> None:
    """Raises ValueError for a missing name, the served model's name, or a loaded one (unless `upsert`)."""
    if not name:
        raise ValueError("lora_name must be given")
    if name == state.served_model_name:
        raise ValueError(f"{name!r} is the served model's name; give the adapter another name")
    if not upsert and name in await state.loras():
        raise ValueError(
            f"LoRA adapter {name!r} is already loaded; unload it first, or send upsert=true to replace its weights"
        )


@lora_router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoRAPathBody, state: StateDep) -> JSONResponse:
    """SGLang's: loads the PEFT folder `lora_path` as adapter `lora_name` (requests name it in `lora_path`, or as
    an OpenAI `model`). `pinned` is recorded (adapters are never evicted here); `upsert` replaces a loaded
    adapter's weights as a new version."""

    async def load() -> object:
        await _check_new_name(state, body.lora_name, body.upsert)
        if not body.lora_path:
            raise ValueError("lora_path must be given")
        return await state.engine.load_lora_adapter(
            body.lora_name, body.lora_path, load_inplace=body.upsert, pinned=body.pinned
        )

    return await lora_update(state, load, f"LoRA adapter {body.lora_name!r} loaded.")


@lora_router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(body: LoRATensorsBody, state: StateDep) -> JSONResponse:
    """SGLang's: loads adapter `lora_name` from its PEFT config (`config_dict`) and tensors, the first entry of
    `serialized_named_tensors` (every TP rank's entry holds the whole adapter here: the engine shards it itself)
    or `serialized_tensors`, each as `sglang_protocol.decode_tensors` reads it."""

    async def load() -> object:
        await _check_new_name(state, body.lora_name, body.upsert)
        if body.load_format not in TENSOR_LOAD_FORMATS:
            raise ValueError(
                f"load_format {body.load_format!r} is not supported; the tensors are one dict of "
                "name -> tensor (load_format null or 'direct')"
            )
        given = [x for x in (body.serialized_named_tensors, body.serialized_tensors) if x is not None]
        if len(given) != 1:
            raise ValueError(
                "give one of serialized_named_tensors (a list, one entry per TP rank) and serialized_tensors"
            )
        entry = given[0][0] if isinstance(given[0], list) and given[0] else given[0]
        if not isinstance(entry, str) or not entry:
            raise ValueError("serialized_named_tensors must hold at least one entry")
        tensors = await asyncio.to_thread(decode_tensors, entry)  # CPU work off the event loop
        return await state.engine.load_lora_adapter(
            body.lora_name, tensors=tensors, peft_config=body.config_dict, load_inplace=body.upsert, pinned=body.pinned
        )

    return await lora_update(state, load, f"LoRA adapter {body.lora_name!r} loaded from tensors.")


@lora_router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: LoRANameBody, state: StateDep) -> JSONResponse:
    """SGLang's: forgets adapter `lora_name` (requests running on it finish on it); 400 for an unknown name."""

    async def unload() -> None:
        if body.lora_name not in await state.loras():
            raise ValueError(f"LoRA adapter {body.lora_name!r} is not loaded; loaded: {sorted(await state.loras())}")
        return await state.engine.unload_lora_adapter(body.lora_name)

    return await lora_update(state, unload, f"LoRA adapter {body.lora_name!r} unloaded.")
