"""SGLang's HTTP surface, as slime, AReaL and verl call it: native `/generate`, generation control, and the weight
routes (disk, a torch.distributed group, optional begin/end sessions), each validated, atomic and versioned like
hotswap's own routes (they run through the same engine calls). `/generate` and `/health_generate` serve one
engine or a fleet; the admin routes serve one engine (not a fleet). The weight and LoRA routes are in
`sglang_weights`.

`create_app` includes `generate_router` (`/generate`, sessions) behind the user's API key, `public_router`
(`/health_generate`) without one, and `admin_router` (generation control, `/v1/loads`, `/model_info`, memory
release) behind the admin key, when the admin routes are on. `/generate` takes SGLang's
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
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

import hotswap.entrypoints.server.generation as generation
from hotswap.engine.client import EngineClient
from hotswap.entrypoints.replay_wire import forced_routes
from hotswap.entrypoints.server.state import ApiError, ServerState, StateDep, api_error
from hotswap.entrypoints.sglang_protocol import (
    AbortBody,
    CloseSessionBody,
    GenerateBody,
    OpenSessionBody,
    PauseGenerationBody,
    TagsBody,
    response,
    sampling_params,
)
from hotswap.inputs import PromptType
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams

generate_router = APIRouter()
public_router = APIRouter()
admin_router = APIRouter()


def local_engine(state: StateDep) -> EngineClient:
    """The one engine SGLang's admin routes drive (a FastAPI dependency; `create_app` includes them only for one
    engine, a fleet gets a 404)."""
    if state.engine.local is None:
        raise ApiError(404, "SGLang's admin routes are served for one engine, not a fleet", "not_found")
    return state.engine


EngineDep = Annotated[EngineClient, Depends(local_engine)]


# ---- generation ------------------------------------------------------------------------------------------


def error_response(err: BaseException) -> JSONResponse:
    """SGLang's error body for `err`: its status and headers as `api_error` maps it (e.g. 503 with Retry-After
    while the engine is asleep), else 400."""
    mapped = api_error(err)
    if mapped is None:
        return JSONResponse({"error": {"message": str(err)}}, 400)
    return JSONResponse({"error": {"message": mapped.message}}, mapped.status, headers=mapped.headers)


@generate_router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: GenerateBody, state: StateDep, http: Request) -> object:
    engine = state.engine  # one engine or a fleet (its router picks the replica; X-Session-ID keeps it sticky)
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
    entries: list[PromptType] = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    try:
        loras = await request_loras(state, body.lora_path, len(entries), batch)
    except Exception as err:  # an unknown adapter, LoRA off (400), or a failed first load (as `api_error` maps it)
        return error_response(err)
    rid = body.rid or f"sgl-{time.monotonic_ns()}"
    text_of = engine.detokenizer.token_text
    if body.stream:
        if batch:
            return JSONResponse({"error": {"message": "stream takes one prompt per request"}}, 400)
        params.output_kind = "cumulative"
        # an async generator function: its iterator has aclose()
        stream = cast(
            "AsyncGenerator[RequestOutput, None]", engine.generate(entries[0], params, rid, key, lora_request=loras[0])
        )
        try:
            first = await anext(stream)  # a refused prompt is a 400 before any byte is streamed
        except Exception as err:
            await stream.aclose()
            return error_response(err)

        async def sse() -> AsyncIterator[str]:
            try:
                out = first
                while True:
                    label = engine.status().weight_version_label
                    for c in out.outputs:
                        yield f"data: {json.dumps(response(out, c, body, text_of, label))}\n\n"
                    if out.finished:
                        break
                    out = await anext(stream)
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()  # a client that went away aborts its request

        return StreamingResponse(sse(), media_type="text/event-stream")

    watch = generation.ClientWatch(http)

    async def one(entry: PromptType, request_id: str, lora: LoRARequest | None) -> RequestOutput:
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
                group.create_task(one(e, f"{rid}-{i}" if batch else rid, lora))
                for i, (e, lora) in enumerate(zip(entries, loras, strict=True))
            ]
        outs = [task.result() for task in tasks]
    except BaseExceptionGroup as errors:
        return error_response(errors.exceptions[0])
    label = engine.status().weight_version_label
    results = [response(o, c, body, text_of, label) for o in outs for c in o.outputs]
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
async def open_session_route(state: StateDep, body: OpenSessionBody | None = None) -> object:
    """SGLang's: opens a session (its id, or a new one) and answers its id. Requests naming it (session_params.id,
    or the X-Session-ID header) keep their cached prefixes with priority (hotswap/engine/sessions.py)."""
    session_id = (body.session_id if body is not None else None) or uuid.uuid4().hex
    await state.engine.open_session(session_id)
    return session_id


@generate_router.post("/close_session")
async def close_session_route(body: CloseSessionBody, state: StateDep) -> object:
    """SGLang's: closes a session; answers its figures (hotswap's addition), 404 for an unknown one."""
    stats = await state.engine.close_session(body.session_id)
    if stats is None:
        raise ApiError(404, f"no open session {body.session_id!r}", "not_found_error")
    return {"success": True, "session_id": body.session_id, **stats}


@generate_router.get("/v1/sessions/{session_id}")
async def session_stats_route(session_id: str, state: StateDep) -> object:
    """An open session's figures: requests, prompt tokens, prefix-cache hits and the hit rate from its second
    request on; 404 for an unknown one."""
    stats = await state.engine.session_stats(session_id)
    if stats is None:
        raise ApiError(404, f"no open session {session_id!r}", "not_found_error")
    return {"session_id": session_id, **stats}


@public_router.get("/health_generate")
async def health_generate(state: StateDep) -> object:
    """Healthy and able to generate one token (while paused, healthy without generating)."""
    engine = state.engine
    now = engine.status()
    if now.health_problem is not None:
        return JSONResponse({"status": "unhealthy", "reason": now.health_problem}, 503)
    if not now.paused and not now.asleep:
        async for _ in engine.generate({"prompt_token_ids": [0]}, SamplingParams(max_tokens=1), None):
            pass
    return {"status": "ok"}


# ---- generation control (admin) --------------------------------------------------------------------------


@admin_router.post("/pause_generation")
async def pause_generation(engine: EngineDep, body: PauseGenerationBody | None = None) -> object:
    """abort: requests end now; retract: they stop and are recomputed at continue; in_place: they freeze."""
    mode = (body or PauseGenerationBody()).mode
    ours = {"abort": ("abort", True), "retract": ("keep", True), "in_place": ("keep", False)}[mode]
    await engine.pause_generation(*ours)
    return {"message": "Generation paused successfully.", "status": "ok"}


@admin_router.post("/continue_generation")
async def continue_generation(engine: EngineDep) -> object:
    await engine.resume_generation()
    return {"message": "Generation continued successfully.", "status": "ok"}


@admin_router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(engine: EngineDep) -> object:
    if engine.status().requests:
        return PlainTextResponse("Cache not flushed: requests are running or waiting.", status_code=400)
    await engine.reset_prefix_cache()
    return PlainTextResponse("Cache flushed.")


@admin_router.post("/abort_request")
async def abort_request(engine: EngineDep, body: AbortBody | None = None) -> object:
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
async def loads(engine: EngineDep) -> object:
    now = engine.status()
    running, waiting = now.running, now.waiting
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


@admin_router.get("/model_info")
async def model_info(state: StateDep, engine: EngineDep) -> object:
    mc = engine.config.model_config
    return {
        "model_path": mc.model,
        "served_model_name": state.served_model_name,
        "tokenizer_path": mc.tokenizer,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.status().weight_version_label,
        "load_format": "safetensors",
    }


@admin_router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(engine: EngineDep, body: TagsBody | None = None) -> object:
    tags = (body or TagsBody()).tags
    level = 2 if tags is None or "weights" in tags else 1
    await engine.sleep(level)
    return {"success": True}


@admin_router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(engine: EngineDep, body: TagsBody | None = None) -> object:
    await engine.wake_up((body or TagsBody()).tags)
    return {"success": True}
