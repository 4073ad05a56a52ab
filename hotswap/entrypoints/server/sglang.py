"""SGLang's HTTP surface, as slime, AReaL and verl call it: native `/generate`, generation control, and the weight
routes (disk, a torch.distributed group, optional begin/end sessions), each validated, atomic and versioned like
hotswap's own routes (they run through the same engine calls). `/generate` and `/health_generate` serve one
`AsyncLLMEngine` or a fleet; the admin routes reach into one engine's scheduler and session (not a fleet).

`create_app` includes `generate_router` (`/generate`) behind the user's API key, `public_router`
(`/health_generate`) without one, and `admin_router` (generation control, the weight routes, `/model_info`,
memory release) and `lora_router` (`/load_lora_adapter`, `/load_lora_adapter_from_tensors`, `/unload_lora_adapter`,
for one engine or a fleet) behind the admin key, when the admin routes are on. `/generate` takes SGLang's
per-request `lora_path`.

Shapes follow SGLang 0.5.2x (`sglang/srt/entrypoints/http_server.py`, `io_struct.py`; the models and result
shaping are in `sglang_protocol`): responses carry `success` / `message`, weight versions are strings, and a
failed update is a 400 with `success: false` (the weights untouched). `/update_weights_from_distributed` outside a
`/begin_weight_update` session opens and commits one of its own, as the frameworks that never call begin (slime,
AReaL, verl) need. `/update_weights_from_tensor` (a colocated trainer's CUDA IPC or CPU shared-memory handles) is
read by the restricted unpickler of `hotswap.transfer.safe_pickle`, the only way request data is unpickled.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, TypeVar, cast

import torch
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

import hotswap.entrypoints.server.generation as generation
from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.entrypoints.replay_wire import forced_routes
from hotswap.entrypoints.server.bodies import TensorUpdateBody
from hotswap.entrypoints.server.state import ApiError, ServerState, StateDep
from hotswap.entrypoints.sglang_protocol import (
    TENSOR_LOAD_FORMATS,
    AbortBody,
    CloseSessionBody,
    DiskBody,
    DistributedBody,
    GenerateBody,
    GroupBody,
    LoRANameBody,
    LoRAPathBody,
    LoRATensorsBody,
    OpenSessionBody,
    PauseGenerationBody,
    SelectorBody,
    TagsBody,
    decode_tensors,
    response,
    sampling_params,
)
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams
from hotswap.transfer.cuda_ipc import open_sglang, synchronize
from hotswap.weights.version import parse_version

T = TypeVar("T")

generate_router = APIRouter()
public_router = APIRouter()
admin_router = APIRouter()
lora_router = APIRouter()


def local_engine(state: StateDep) -> AsyncLLMEngine:
    """The one engine SGLang's admin routes drive (a FastAPI dependency; `create_app` includes them only for an
    `AsyncLLMEngine`, a fleet gets a 404)."""
    if not isinstance(state.engine, AsyncLLMEngine):
        raise ApiError(404, "SGLang's admin routes are served for one engine, not a fleet", "not_found")
    return state.engine


EngineDep = Annotated[AsyncLLMEngine, Depends(local_engine)]


def fail(err: BaseException) -> JSONResponse:
    """SGLang's refusal: a 400 `{"success": false, "message": ...}`."""
    return JSONResponse({"success": False, "message": str(err)}, status_code=400)


async def ok_or_400(awaitable: Awaitable[T]) -> tuple[T | None, JSONResponse | None]:
    """Runs an engine call: (its result, None), or (None, a 400 `{"success": false}`) for any refusal or failure
    (weights untouched)."""
    try:
        return await ServerState.guarded(awaitable), None
    except Exception as err:  # an ApiError (mapped by `guarded`) or anything the engine raised
        return None, fail(Exception(getattr(err, "message", str(err))))


async def paused(engine: AsyncLLMEngine, abort: bool) -> bool:
    """Pauses for an update unless already paused (abort: end requests now; else let them finish). Returns
    whether this call paused, so it resumes."""
    if engine.engine.is_paused():
        return False
    await engine.pause_generation("abort" if abort else "wait", clear_cache=False)
    return True


def open_session(state: ServerState, engine: AsyncLLMEngine) -> str | None:
    """The /begin_weight_update session's token while that session is the engine's open one (one that ended
    another way, by abort, destroy or a vLLM-route finish, is forgotten)."""
    session = state.sglang_session
    if session.token is not None and session.token != engine.engine.session_token:
        session.token = session.version = None
    return session.token


# ---- generation ------------------------------------------------------------------------------------------


def error_response(err: BaseException) -> JSONResponse:
    """SGLang's error body for `err`: an ApiError's status and headers (e.g. 503 with Retry-After while the
    engine is asleep), else 400."""
    return JSONResponse(
        {"error": {"message": getattr(err, "message", str(err))}},
        getattr(err, "status", 400),
        headers=getattr(err, "headers", None),
    )


@generate_router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: GenerateBody, state: StateDep, http: Request) -> Any:
    engine = state.engine  # one engine or a fleet (its router picks the replica; X-Session-ID keeps it sticky)
    inner = engine.engine
    key = http.headers.get("x-session-id")
    if body.session_params is not None:
        key = body.session_params.get("id") if isinstance(body.session_params.get("id"), str) else None
        if not key:
            return JSONResponse(
                {"error": {"message": "session_params.id must name a session (see /open_session)"}}, 400
            )
    if (body.text is None) == (body.input_ids is None):
        return JSONResponse({"error": {"message": "give exactly one of 'text' and 'input_ids'"}}, 400)
    try:
        params = sampling_params(body.sampling_params, state.vocab_size)
        if body.return_logprob:
            params.logprobs = body.top_logprobs_num
            if body.logprob_start_len >= 0:
                params.prompt_logprobs = body.top_logprobs_num
        params.return_routed_experts = body.return_routed_experts
        params.return_sampling_mask = params.return_sampling_mask or body.return_sampling_mask
        params.forced_routed_experts = forced_routes(body.forced_routed_experts)
        params.__post_init__()
        state.check_limits(params.stop, params)
    except (ValueError, TypeError) as err:
        return JSONResponse({"error": {"message": str(err)}}, 400)
    except Exception as err:  # a limit (--max-n, --max-tokens, stop strings): an ApiError
        return error_response(err)
    ids = body.input_ids
    batch = isinstance(body.text, list) or (ids is not None and len(ids) > 0 and isinstance(ids[0], list))
    raw = body.text if body.text is not None else ids
    prompts: list[Any] = list(raw or []) if batch else [raw]
    entries = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    try:
        loras = await request_loras(state, body.lora_path, len(entries), batch)
    except Exception as err:  # an unknown adapter, LoRA off (400), or a failed first load (as `guarded` maps it)
        return error_response(err)
    rid = body.rid or f"sgl-{time.monotonic_ns()}"
    text_of = inner.detokenizer.token_text
    if body.stream:
        if batch:
            return JSONResponse({"error": {"message": "stream takes one prompt per request"}}, 400)
        params.output_kind = "cumulative"
        # an async generator function: its iterator has aclose()
        stream = cast(
            "AsyncGenerator[RequestOutput, None]", engine.generate(entries[0], params, rid, key, lora_request=loras[0])
        )
        try:
            first = await state.guarded(anext(stream))  # a refused prompt is a 400 before any byte is streamed
        except Exception as err:
            await stream.aclose()
            return error_response(err)

        async def sse() -> AsyncIterator[str]:
            try:
                out = first
                while True:
                    for c in out.outputs:
                        yield f"data: {json.dumps(response(out, c, body, text_of, inner.weight_version_label))}\n\n"
                    if out.finished:
                        break
                    out = await anext(stream)
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()  # a client that went away aborts its request

        return StreamingResponse(sse(), media_type="text/event-stream")

    watch = generation.ClientWatch(http)

    async def one(entry: Any, request_id: str, lora: LoRARequest | None) -> RequestOutput:
        """The request's final output; its client leaving meanwhile ends it (499, every prompt of a batch)."""
        stream = cast(
            "AsyncGenerator[RequestOutput, None]", engine.generate(entry, params, request_id, key, lora_request=lora)
        )
        try:
            out = await generation.next_output(state, stream, watch)
            while not out.finished:
                out = await generation.next_output(state, stream, watch)
            return out
        finally:
            await stream.aclose()  # an unfinished request is aborted

    try:
        async with asyncio.TaskGroup() as group:  # one failing prompt cancels (aborts) the others
            tasks = [
                group.create_task(state.guarded(one(e, f"{rid}-{i}" if batch else rid, lora)))
                for i, (e, lora) in enumerate(zip(entries, loras, strict=True))
            ]
        outs = [task.result() for task in tasks]
    except BaseExceptionGroup as errors:
        return error_response(errors.exceptions[0])
    results = [response(o, c, body, text_of, inner.weight_version_label) for o in outs for c in o.outputs]
    return results if batch or params.n > 1 else results[0]


async def request_loras(
    state: ServerState, lora_path: str | list[str | None] | None, count: int, batch: bool
) -> list[LoRARequest | None]:
    """The adapter of each of a /generate request's `count` inputs from its `lora_path` (one for all, or a list with
    one entry per input; None: the base model). Each names a loaded adapter. Raises ValueError (LoRA off, a wrong
    count, no such adapter)."""
    if lora_path is None:
        return [None] * count
    if isinstance(lora_path, list) and len(lora_path) != count:
        raise ValueError(
            f"lora_path has {len(lora_path)} entries for {count} input{'s' if batch else ''}; give one "
            "per input (or one string for all)"
        )
    names = lora_path if isinstance(lora_path, list) else [lora_path] * count
    found: dict[str, LoRARequest] = {}
    for name in names:
        if name and name not in found:
            found[name] = await request_lora(state, name)
    return [found[name] if name else None for name in names]


async def request_lora(state: ServerState, name: str) -> LoRARequest:
    """The LoRARequest of loaded adapter `name`. A request never loads a folder itself: that reads the server's
    disk and takes adapter room, which only the admin routes may do (/load_lora_adapter)."""
    state.check_lora_enabled()
    loaded = await state.loras()
    if name not in loaded:
        raise ValueError(
            f"lora_path {name!r} names no loaded LoRA adapter (loaded: {sorted(loaded)}); load it "
            "with /load_lora_adapter first"
        )
    return LoRARequest(name, int(loaded[name]["lora_int_id"]))


@generate_router.post("/open_session")
async def open_session_route(state: StateDep, body: OpenSessionBody | None = None) -> Any:
    """SGLang's: opens a session (its id, or a new one) and answers its id. Requests naming it (session_params.id,
    or the X-Session-ID header) keep their cached prefixes with priority (hotswap/engine/sessions.py)."""
    session_id = (body.session_id if body is not None else None) or uuid.uuid4().hex
    await state.guarded(state.engine.open_session(session_id))
    return session_id


@generate_router.post("/close_session")
async def close_session_route(body: CloseSessionBody, state: StateDep) -> Any:
    """SGLang's: closes a session; answers its figures (hotswap's addition), 404 for an unknown one."""
    stats = await state.guarded(state.engine.close_session(body.session_id))
    if stats is None:
        raise ApiError(404, f"no open session {body.session_id!r}", "not_found_error")
    return {"success": True, "session_id": body.session_id, **stats}


@generate_router.get("/v1/sessions/{session_id}")
async def session_stats_route(session_id: str, state: StateDep) -> Any:
    """An open session's figures: requests, prompt tokens, prefix-cache hits and the hit rate from its second
    request on; 404 for an unknown one."""
    stats = await state.guarded(state.engine.session_stats(session_id))
    if stats is None:
        raise ApiError(404, f"no open session {session_id!r}", "not_found_error")
    return {"session_id": session_id, **stats}


@public_router.get("/health_generate")
async def health_generate(state: StateDep) -> Any:
    """Healthy and able to generate one token (while paused, healthy without generating)."""
    engine = state.engine
    inner = engine.engine
    problem = inner.health_problem()
    if problem is not None:
        return JSONResponse({"status": "unhealthy", "reason": problem}, 503)
    if not inner.is_paused() and not inner.is_asleep():
        async for _ in engine.generate({"prompt_token_ids": [0]}, SamplingParams(max_tokens=1), None):
            pass
    return {"status": "ok"}


# ---- generation control (admin) --------------------------------------------------------------------------


@admin_router.post("/pause_generation")
async def pause_generation(engine: EngineDep, body: PauseGenerationBody | None = None) -> Any:
    """abort: requests end now; retract: they stop and are recomputed at continue; in_place: they freeze."""
    mode = (body or PauseGenerationBody()).mode
    ours = {"abort": ("abort", True), "retract": ("keep", True), "in_place": ("keep", False)}[mode]
    await ServerState.guarded(engine.pause_generation(*ours))
    return {"message": "Generation paused successfully.", "status": "ok"}


@admin_router.post("/continue_generation")
async def continue_generation(engine: EngineDep) -> Any:
    await ServerState.guarded(engine.resume_generation())
    return {"message": "Generation continued successfully.", "status": "ok"}


@admin_router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(engine: EngineDep) -> Any:
    if engine.engine.requests:
        return PlainTextResponse("Cache not flushed: requests are running or waiting.", status_code=400)
    await ServerState.guarded(engine.reset_prefix_cache())
    return PlainTextResponse("Cache flushed.")


@admin_router.post("/abort_request")
async def abort_request(engine: EngineDep, body: AbortBody | None = None) -> Any:
    body = body or AbortBody()
    rid = body.rid
    if body.abort_all:
        ids = await engine.abort_requests()
    elif not rid:
        ids = []
    elif body.prefix:
        ids = await engine.abort_requests(prefix=rid)
    else:  # the request, and the prompts of a /generate batch sent under it ("<rid>-<i>")
        ids = await engine.abort_requests([rid], prefix=f"{rid}-")
    return {"success": True, "aborted": len(ids)}


@admin_router.get("/v1/loads")
async def loads(engine: EngineDep) -> Any:
    running, waiting = engine.engine.queue_lengths()
    return {
        "timestamp": time.time(),
        "version": "hotswap",
        "num_accelerators": 0,
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": running,
                "num_waiting_reqs": waiting,
                "num_reqs": running + waiting,
                "num_used_tokens": 0,
            }
        ],
    }


# ---- weights (admin) -------------------------------------------------------------------------------------


@admin_router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: DiskBody, state: StateDep, engine: EngineDep) -> Any:
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


@admin_router.post("/init_weights_update_group")
async def init_weights_update_group(body: GroupBody, engine: EngineDep) -> Any:
    info = {
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


@admin_router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(engine: EngineDep) -> Any:
    _, error = await ok_or_400(engine.shutdown_weight_transfer_engine())
    return error or {"success": True, "message": "Succeeded to destroy the weights update group."}


@admin_router.post("/begin_weight_update")
async def begin_weight_update(state: StateDep, engine: EngineDep, body: SelectorBody | None = None) -> Any:
    selector = (body or SelectorBody()).selector
    has_draft = engine.engine.config.draft_model_config is not None
    target = {"target": "model", "draft": "draft", "all": "all" if has_draft else "model"}[selector]
    token, error = await ok_or_400(engine.start_weight_update(target))
    if error is not None:
        return error
    state.sglang_session.token, state.sglang_session.version = token, None
    return {"success": True, "message": "Weight update session started."}


@admin_router.post("/end_weight_update")
async def end_weight_update(state: StateDep, engine: EngineDep) -> Any:
    session = state.sglang_session
    token = open_session(state, engine)
    version, session.token, session.version = session.version, None, None
    if token is None:
        return fail(ValueError("no weight update session is open; call /begin_weight_update first"))
    _, error = await ok_or_400(engine.finish_weight_update(version, token))
    if error is not None:
        return error
    state.version_changed()
    return {"success": True, "message": "Weight update session ended."}


@admin_router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: DistributedBody, state: StateDep, engine: EngineDep) -> Any:
    info = {
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
    session = state.sglang_session
    token = open_session(state, engine)
    if token is not None:  # inside /begin_weight_update: one more update of that session
        _, error = await ok_or_400(engine.update_weights(info, token))
        if error is not None:
            session.token = session.version = None  # the failed update ended (and rolled back) the session
        elif body.weight_version is not None:  # the version /end_weight_update commits
            session.version = body.weight_version
        return error or {"success": True, "message": "Succeeded to update parameter online."}
    resume = await paused(engine, body.abort_all_requests)
    try:
        token, error = await ok_or_400(engine.start_weight_update("model"))
        if error is None:
            _, error = await ok_or_400(engine.update_weights(info, token))
        if error is None:
            _, error = await ok_or_400(engine.finish_weight_update(body.weight_version, token))
    finally:
        if token is not None and engine.engine.session_token == token:  # never leave the implicit session open
            await engine.abort_weight_update(token)
        if resume:
            await engine.resume_generation()
    if error is not None:
        return error
    state.version_changed()
    return {"success": True, "message": "Succeeded to update parameter online."}


@admin_router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(body: TensorUpdateBody, state: StateDep, engine: EngineDep) -> Any:
    """SGLang's: tensors that stay in a colocated trainer's memory. `serialized_named_tensors` is read by the restricted
    unpickler (hotswap.transfer.safe_pickle) and its handles opened onto the engine's device, all before anything
    pauses: a refused payload is a 400 naming the problem, the weights untouched. The tensors then load as one
    atomic, versioned reload (every value checked before the first write); the trainer's memory is let go, its
    reads finished, before the answer. Outside a /begin_weight_update session only."""
    device = torch.device(engine.engine.config.model_config.device)
    try:
        parse_version(body.weight_version)  # checked before anything moves
        if open_session(state, engine) is not None:
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


@admin_router.get("/model_info")
async def model_info(state: StateDep, engine: EngineDep) -> Any:
    mc = engine.engine.config.model_config
    return {
        "model_path": mc.model,
        "served_model_name": state.served_model_name,
        "tokenizer_path": mc.tokenizer,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.engine.weight_version_label,
        "load_format": "safetensors",
    }


@admin_router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(engine: EngineDep, body: TagsBody | None = None) -> Any:
    tags = (body or TagsBody()).tags
    level = 2 if tags is None or "weights" in tags else 1
    await ServerState.guarded(engine.sleep(level))
    return {"success": True}


@admin_router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(engine: EngineDep, body: TagsBody | None = None) -> Any:
    await ServerState.guarded(engine.wake_up((body or TagsBody()).tags))
    return {"success": True}


# ---- LoRA adapters (admin; one engine or a fleet) ----------------------------------------------------------


async def lora_update(state: ServerState, call: Callable[[], Awaitable[Any]], message: str) -> JSONResponse:
    """Runs a LoRA load or unload and answers SGLang's LoRAUpdateOutput: 200 `{"success": true, "error_message":
    "", "loaded_adapters": {name: path}}` (a tensor-loaded adapter's path "__tensor__", as SGLang names it), or 400
    with `success: false` and the reason (nothing loaded changes); `message` repeats it, as SGLang's other routes
    answer."""
    try:
        state.check_lora_enabled()
        await state.guarded(call())
    except Exception as err:  # a ValueError above, or an ApiError from `guarded`
        reason = getattr(err, "message", str(err))
        return JSONResponse(
            {
                "success": False,
                "error_message": reason,
                "message": reason,
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

    async def load() -> Any:
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

    async def load() -> Any:
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

    async def unload() -> Any:
        if body.lora_name not in await state.loras():
            raise ValueError(f"LoRA adapter {body.lora_name!r} is not loaded; loaded: {sorted(await state.loras())}")
        return await state.engine.unload_lora_adapter(body.lora_name)

    return await lora_update(state, unload, f"LoRA adapter {body.lora_name!r} unloaded.")
