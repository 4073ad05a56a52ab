"""vLLM's RL and admin API: weight reloads and transfers (init / start / update / finish / abort / shutdown of a
transfer session), LoRA adapters (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), generation control (pause /
resume, sleep / wake_up, the prefix cache, aborting requests), the served weight version (read, rename), and
inspection (`/server_info` in vLLM's `vllm_config` shape, world size, checksums, the allow-listed `/collective_rpc`).

`create_app` includes `router` behind the admin key. Engine errors map to client errors through the app's exception
handlers (`state.api_error`: bad values 400, wrong state 409, timeouts 504); a committed weight change updates the
weight-version metrics and answers the served version(s)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse

from hotswap.entrypoints.server.bodies import (
    AbortBody,
    AbortRequestsBody,
    FinishBody,
    InitBody,
    LoadLoRABody,
    PauseBody,
    ReloadBody,
    RenameBody,
    RpcBody,
    SleepBody,
    StartBody,
    UnloadLoRABody,
    UpdateBody,
    WakeBody,
)
from hotswap.entrypoints.server.state import ENGINE_ERRORS, ApiError, ServerState, StateDep, api_error
from hotswap.weights.version import parse_version

T = TypeVar("T")

# Worker methods `/collective_rpc` may call: read-only inspection.
RPC_ALLOWLIST = frozenset({"weight_checksums", "determine_num_kv_blocks", "shard_plan"})

router = APIRouter()


def vllm_config(config: Any, served_name: str, data_parallel_size: int = 1) -> dict[str, Any]:
    """The fields of vLLM's `vllm_config` that RL clients read, from hotswap's config."""
    mc, pc, cc, lc = config.model_config, config.parallel_config, config.cache_config, config.lora_config
    spec = config.speculative_config
    return {
        "model_config": {
            "model": mc.model,
            "served_model_name": served_name,
            "dtype": str(mc.torch_dtype),
            "max_model_len": mc.max_model_len,
            "max_logprobs": mc.max_logprobs,
            "seed": mc.seed,
        },
        "parallel_config": {
            "tensor_parallel_size": pc.tensor_parallel_size,
            "pipeline_parallel_size": 1,
            "data_parallel_size": data_parallel_size,
            "world_size": pc.tensor_parallel_size * data_parallel_size,
            "enable_expert_parallel": pc.enable_expert_parallel,
        },
        "cache_config": {
            "block_size": cc.block_size,
            "enable_prefix_caching": cc.enable_prefix_caching,
            "num_gpu_blocks": cc.num_kv_blocks,
        },
        # every transport is available on request; clients only check that one is configured
        "weight_transfer_config": {
            "backend": "torch_dist",
            "backends": ["tensors", "shm", "torch_dist", "disk", "cuda_ipc", "ipc"],
            "atomic": config.weight_transfer_config.atomic,
        },
        "speculative_config": None
        if not spec.enabled
        else {"method": spec.method, "model": spec.model, "num_speculative_tokens": spec.num_speculative_tokens},
        "quant_config": {"quantization": config.quant_config.quantization},
        # None unless started with --enable-lora: TRL's AsyncGRPO reads it to choose adapter-only syncs (and checks
        # max_lora_rank and max_loras against its adapter and max_staleness)
        "lora_config": None
        if not lc.enable_lora
        else {
            "max_lora_rank": lc.max_lora_rank,
            "max_loras": lc.max_loras,
            "max_cpu_loras": lc.max_cpu_loras,
            "fully_sharded_loras": False,
            "lora_dtype": "auto",
            "lora_version_policy": lc.lora_version_policy,
        },
    }


# ---- weights ----------------------------------------------------------------------------------------------


@router.post("/reload_weights")
async def reload_weights(state: StateDep, body: ReloadBody | None = None) -> dict[str, object]:
    start = time.perf_counter()
    body = body or ReloadBody()
    await state.engine.reload_weights(
        weights_path=body.weights_path,
        target=body.target,
        weight_version=body.weight_version,
        encoding=body.encoding,
        base_version=body.base_version,
        checksums=body.checksums,
    )
    state.metrics.observe("hotswap_weight_update_seconds", time.perf_counter() - start)
    state.version_changed()
    return state.versions()


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: InitBody, state: StateDep) -> dict[str, str]:
    await state.engine.init_weight_transfer_engine(body.init_info)
    return {"status": "ok"}


@router.post("/start_weight_update")
async def start_weight_update(state: StateDep, body: StartBody | None = None) -> dict[str, str]:
    token = await state.engine.start_weight_update((body or StartBody()).target)
    return {"status": "ok", "session_token": token}


@router.post("/update_weights")
async def update_weights(body: UpdateBody, state: StateDep) -> dict[str, str]:
    await state.engine.update_weights(body.update_info, body.session_token)
    return {"status": "ok"}


@router.post("/finish_weight_update")
async def finish_weight_update(state: StateDep, body: FinishBody | None = None) -> dict[str, object]:
    body = body or FinishBody()
    try:
        parse_version(body.weight_version)  # before anything moves; the session stays open for a retry
    except ValueError as err:
        raise ApiError(400, str(err)) from None
    change = state.engine.status().change  # the session's record: when it started
    await state.engine.finish_weight_update(body.weight_version, body.session_token, body.canary)
    if change is not None and change.token is not None:
        state.metrics.observe("hotswap_weight_update_seconds", time.monotonic() - change.started)
    state.version_changed()
    return state.versions()


@router.post("/abort_weight_update")
async def abort_weight_update(state: StateDep, body: AbortBody | None = None) -> dict[str, str]:
    await state.engine.abort_weight_update((body or AbortBody()).session_token)
    return {"status": "ok"}


@router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(state: StateDep) -> dict[str, str]:
    await state.engine.shutdown_weight_transfer_engine()
    return {"status": "ok"}


# ---- LoRA adapters ----------------------------------------------------------------------------------------


async def _lora_call(state: ServerState, awaitable: Awaitable[T]) -> T:
    """An engine LoRA call: its refusals as vLLM's 400 BadRequestError, as is any other error of reading the
    adapter (a corrupt safetensors file); the engine's state errors as `api_error` maps them (409, 503, 504)."""
    try:
        return await awaitable
    except Exception as err:
        mapped = api_error(err)
        if mapped is not None and mapped.status == 400:
            raise ApiError(400, mapped.message, "BadRequestError") from err
        if mapped is not None:
            raise mapped from err
        # nothing was loaded: the adapter could not be read
        raise ApiError(400, f"cannot load the LoRA adapter: {type(err).__name__}: {err}", "BadRequestError") from err


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRABody, state: StateDep) -> PlainTextResponse:
    """vLLM's: loads the PEFT folder `lora_path` as adapter `lora_name`, which requests then name as their `model`.
    With `load_inplace` a loaded adapter's weights are replaced: a new adapter version, validated and atomic,
    read once (never again per request, unlike vllm#41482); requests already running finish on the version they
    started with (--lora-version-policy finish_on_old) or switch to the new one (switch); KV computed under the
    old version is never reused (vllm#42125). Answers vLLM's plain-text success line; 400 in vLLM's error shape for
    a refusal (nothing loaded changes), 404 for a path that does not exist."""
    name, path = body.lora_name, body.lora_path
    if not name or not path:
        raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    try:
        state.check_lora_enabled()
    except ValueError as err:
        raise ApiError(400, str(err), "BadRequestError") from None
    if name == state.served_model_name:
        raise ApiError(400, f"'{name}' is the served model's name; give the adapter another name", "InvalidUserInput")
    if not body.load_inplace and name in await state.loras():
        raise ApiError(
            400,
            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
            "place, set 'load_inplace' to True.",
            "InvalidUserInput",
        )
    if not os.path.exists(path):
        raise ApiError(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
    await _lora_call(state, state.engine.load_lora_adapter(name, path, load_inplace=body.load_inplace))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRABody, state: StateDep) -> PlainTextResponse:
    """vLLM's: forgets adapter `lora_name` (requests running on it finish on it); 404 for an unknown name."""
    name = body.lora_name
    if not name:
        raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
    try:
        state.check_lora_enabled()
    except ValueError as err:
        raise ApiError(400, str(err), "BadRequestError") from None
    if name not in await state.loras():
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
    await _lora_call(state, state.engine.unload_lora_adapter(name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


# ---- generation control -----------------------------------------------------------------------------------


@router.post("/pause")
async def pause(
    state: StateDep,
    body: PauseBody | None = None,
    mode: str | None = Query(None, pattern="^(abort|wait|keep)$"),
    clear_cache: bool | None = Query(None),
) -> dict[str, object]:
    """Pauses generation; `mode` and `clear_cache` from the query string (vLLM's form) or the JSON body."""
    body = body or PauseBody()
    await state.engine.pause_generation(mode or body.mode, body.clear_cache if clear_cache is None else clear_cache)
    return {"paused": True, "status": "paused"}


@router.post("/resume")
async def resume(state: StateDep) -> dict[str, object]:
    await state.engine.resume_generation()
    return {"paused": False, "status": "resumed"}


@router.get("/is_paused")
async def is_paused(state: StateDep) -> dict[str, bool]:
    return {"is_paused": await state.engine.is_paused()}


@router.post("/sleep")
async def sleep(
    state: StateDep,
    body: SleepBody | None = None,
    level: int | None = Query(None, ge=1, le=2),
    mode: str | None = Query(None, pattern="^(abort|wait)$"),
) -> dict[str, object]:
    """Releases memory (`level` from the query or the body); with `mode`, generation is paused that way first
    (requests in flight otherwise refuse the sleep)."""
    level = level or (body or SleepBody()).level
    if mode is not None:
        await state.engine.pause_generation(mode)
    try:
        await state.engine.sleep(level)
    except ENGINE_ERRORS:
        if mode is not None:
            await state.engine.resume_generation()  # the pause was only for the sleep
        raise
    return {"status": "sleeping", "level": level}


@router.post("/wake_up")
async def wake_up(
    state: StateDep, body: WakeBody | None = None, tags: Annotated[list[str] | None, Query()] = None
) -> dict[str, object]:
    """Re-allocates what sleep released: `tags` (repeatable query parameter, or the body; none: all)."""
    chosen = tags if tags is not None else (body or WakeBody()).tags
    await state.engine.wake_up(chosen)
    return {"status": "sleeping" if state.engine.status().asleep else "awake", "tags": chosen}


@router.get("/is_sleeping")
async def is_sleeping(state: StateDep) -> dict[str, bool]:
    return {"is_sleeping": state.engine.status().asleep}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(state: StateDep) -> dict[str, object]:
    """Drops the prefix cache (query parameters and a body, as vLLM clients send them, are accepted)."""
    await state.engine.reset_prefix_cache()
    return {"status": "ok", "success": True}


@router.post("/abort_requests")
async def abort_requests(state: StateDep, body: AbortRequestsBody | None = None) -> dict[str, object]:
    """Group abort: ends the named requests and those whose id starts with `prefix` (neither: all of them) at
    once, with finish_reason 'abort' and their partial outputs; answers how many, and which."""
    body = body or AbortRequestsBody()
    ids = await state.engine.abort_requests(body.request_ids or None, body.prefix)  # none named (or []): all
    return {"status": "aborted", "aborted": len(ids), "request_ids": ids}


# ---- versions and inspection ------------------------------------------------------------------------------


@router.get("/weight_info")
async def weight_info(state: StateDep) -> dict[str, object]:
    return {"weight_version": state.engine.status().weight_version_label}


@router.post("/update_weight_version")
async def update_weight_version(body: RenameBody, state: StateDep) -> dict[str, object]:
    """Renames the served version (vLLM's and SGLang's route): weights, the integer version and requests stay
    as they are unless `abort_all_requests`, which ends every request with its partial output."""
    label = await state.engine.update_weight_version(body.new_version, body.abort_all_requests)
    state.version_changed()
    return {"success": True, "message": "Weight version updated.", "new_version": label}


@router.get("/server_info")
async def server_info(
    state: StateDep, config_format: str = Query("json", pattern="^(json|text)$")
) -> dict[str, object]:
    """The engine's configuration in vLLM's shape (`vllm_config`), which RL clients read for the dtype, the
    context length and whether a weight transport is configured."""
    engine = state.engine
    config = vllm_config(engine.config, state.served_model_name, engine.data_parallel_size)
    tp = engine.config.parallel_config.tensor_parallel_size
    sglang = {
        "tp_size": tp,
        "tensor_parallel_size": tp,
        "pp_size": 1,
        "dp_size": 1,
        "ep_size": 1,
        "moe_dp_size": 1,
        "num_gpus": 0,
        "disaggregation_mode": "null",
        "encoder_only": False,
        "model_path": engine.config.model_config.model,
        "weight_version": engine.status().weight_version_label,
    }
    return {
        "vllm_config": config if config_format == "json" else json.dumps(config),
        "vllm_env": {},
        "system_env": {},
        **sglang,
    }


@router.get("/get_weight_version")
async def get_weight_version(state: StateDep) -> dict[str, object]:
    return state.versions()


@router.get("/get_world_size")
async def get_world_size(state: StateDep) -> dict[str, int]:
    """Worker processes a torch_dist trainer broadcasts to (the engine's tensor_parallel_size)."""
    return {"world_size": state.engine.world_size}


@router.get("/weight_checksums")
async def weight_checksums(state: StateDep) -> dict[str, object]:
    checksums = (await state.engine.collective_rpc("weight_checksums"))[0]  # rank 0 (of replica 0)
    return {"weight_version": state.engine.status().weight_version_label, "checksums": checksums}


@router.post("/collective_rpc")
async def collective_rpc(body: RpcBody, state: StateDep) -> dict[str, object]:
    if body.method not in RPC_ALLOWLIST:
        raise ApiError(403, f"method {body.method!r} is not allowed; allowed: {sorted(RPC_ALLOWLIST)}", "forbidden")
    try:
        results = await state.engine.collective_rpc(body.method, tuple(body.args), body.kwargs)
    except TypeError as err:  # arguments the method does not take
        raise ApiError(400, f"{body.method}(): {err}") from err
    return {"results": results}
