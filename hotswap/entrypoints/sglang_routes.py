"""SGLang's HTTP surface, as slime, AReaL and verl call it: native `/generate`, generation control, and the weight
routes (disk, a torch.distributed group, optional begin/end sessions), each validated, atomic and versioned like
hotswap's own routes (they run through the same engine calls).

Shapes follow SGLang 0.5.2x (`sglang/srt/entrypoints/http_server.py`, `io_struct.py`): responses carry
`success` / `message`, weight versions are strings, and a failed update is a 400 with `success: false` (the
weights untouched). `/update_weights_from_distributed` outside a `/begin_weight_update` session opens and commits
one of its own, as the frameworks that never call begin (slime, AReaL, verl) need.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.entrypoints.openai_protocol import span_object
from hotswap.outputs import CompletionOutput, RequestOutput
from hotswap.sampling_params import SamplingParams
from hotswap.weights.version import parse_version


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang bodies carry rid and fields hotswap does not use


class GenerateBody(_Lenient):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0)
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False


class PauseGenerationBody(_Lenient):
    mode: str = Field(default="abort", pattern="^(abort|retract|in_place)$")


class DiskBody(_Lenient):
    model_path: str
    load_format: str | None = None
    weight_version: StrictStr | StrictInt | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class GroupBody(_Lenient):
    master_address: str
    master_port: int | str
    rank_offset: int = 1
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DistributedBody(_Lenient):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: StrictStr | StrictInt | None = None
    load_format: str | None = None


class SelectorBody(_Lenient):
    selector: str = Field(default="all", pattern="^(target|draft|all)$")


class AbortBody(_Lenient):
    rid: str = ""
    abort_all: bool = False


class TagsBody(_Lenient):
    tags: list[str] | None = None


# SGLang sampling keys -> SamplingParams fields (others that change results are refused)
_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
    "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "n": "n", "sampling_seed": "seed", "seed": "seed",
    "logit_bias": "logit_bias",
}
_REFUSED = ("json_schema", "regex", "ebnf", "structural_tag", "custom_params")
_IGNORED = ("spaces_between_special_tokens", "no_stop_trim", "stream_interval")


def sampling_params(raw: dict[str, Any], vocab: int) -> SamplingParams:
    """SGLang's sampling_params as SamplingParams. Raises ValueError naming a field that would change the output
    and is not supported."""
    fields: dict[str, Any] = {"max_tokens": 128}  # SGLang's default max_new_tokens
    for key, value in raw.items():
        if key in _REFUSED and value not in (None, False, {}, ""):
            raise ValueError(f"sampling_params.{key} is not supported by this server (it would change the output)")
        if key in _SAMPLING and value is not None:
            fields[_SAMPLING[key]] = value
    if raw.get("no_stop_trim"):
        fields["include_stop_str_in_output"] = True
    if fields.get("top_k") == 0:
        fields["top_k"] = -1
    return SamplingParams(**fields)


def _finish_reason(c: CompletionOutput) -> dict[str, Any] | None:
    if c.finish_reason is None:
        return None
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return {"type": "stop", "matched": c.stop_reason}


def response(out: RequestOutput, c: CompletionOutput, body: GenerateBody, text_of: Callable[[int], str],
             version: str) -> dict[str, Any]:
    """One SGLang generate result (a request's sample); `version`: the served version's label, for an output with
    no token yet."""
    spans = [span_object(s) for s in c.weight_versions]
    meta: dict[str, Any] = {
        "id": out.request_id,
        "finish_reason": _finish_reason(c),
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(c.token_ids),
        "cached_tokens": out.num_cached_tokens,
        "weight_version": spans[-1]["version"] if spans else version,
        "weight_versions": spans,
    }
    if c.spec_stats is not None:
        meta["spec_accept_rate"] = c.spec_stats.acceptance_rate
        meta["spec_accept_length"] = c.spec_stats.mean_accepted_length

    def text(token: int) -> str | None:
        return text_of(token) if body.return_text_in_logprobs else None

    if body.return_logprob:
        entries = c.logprobs or []
        meta["output_token_logprobs"] = [[e[t].logprob, t, text(t)] for t, e in zip(c.token_ids, entries, strict=True)]
        if body.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [
                [[lp.logprob, tid, text(tid)] for tid, lp in sorted(e.items(), key=lambda kv: kv[1].rank or 0)
                 if lp.rank is not None][: body.top_logprobs_num]
                for e in entries
            ]
        if out.prompt_logprobs is not None:
            start = max(body.logprob_start_len, 0)
            ids, plp = out.prompt_token_ids, out.prompt_logprobs
            meta["input_token_logprobs"] = [
                [None if plp[i] is None else plp[i][ids[i]].logprob, ids[i], text(ids[i])]  # type: ignore[index]
                for i in range(start, len(ids))
            ]
    result: dict[str, Any] = {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}
    if body.return_prompt_token_ids:
        result["prompt_token_ids"] = list(out.prompt_token_ids)
    return result


def add_sglang_routes(
    app: FastAPI,
    engine: AsyncLLMEngine,
    admin: list[Any] | None,
    user: Any,
    guarded: Callable[[Any], Any],
    version_changed: Callable[[], None],
    served_model_name: str,
    check_limits: Callable[[Any, SamplingParams], None],
) -> None:
    """Registers SGLang's routes on `app`: /generate and /health_generate behind `user`; with `admin` (None: the
    admin routes are off) generation control and the weight routes behind it."""
    inner = engine.engine
    vocab = int(inner.config.model_config.hf_config.get("vocab_size", 0))
    # the token of a /begin_weight_update session, and the weight_version its updates gave (committed at the end)
    state: dict[str, Any] = {"session": None, "version": None}

    def fail(err: BaseException) -> JSONResponse:
        return JSONResponse({"success": False, "message": str(err)}, status_code=400)

    async def ok_or_400(coro: Any) -> Any:
        """Runs an engine call; any refusal or failure is a 400 `{"success": false}` (weights untouched)."""
        try:
            return await guarded(coro), None
        except Exception as err:  # an ApiError (mapped by `guarded`) or anything the engine raised
            return None, fail(Exception(getattr(err, "message", str(err))))

    async def paused(abort: bool) -> bool:
        """Pauses for an update unless already paused (abort: end requests now; else let them finish). Returns
        whether this call paused, so it resumes."""
        if inner.is_paused():
            return False
        await engine.pause_generation("abort" if abort else "wait", clear_cache=False)
        return True

    # ---- generation --------------------------------------------------------------------------------------

    @app.api_route("/generate", methods=["POST", "PUT"], dependencies=[Depends(user)])
    async def generate(body: GenerateBody) -> Any:
        if (body.text is None) == (body.input_ids is None):
            return JSONResponse({"error": {"message": "give exactly one of 'text' and 'input_ids'"}}, 400)
        try:
            params = sampling_params(body.sampling_params, vocab)
            if body.return_logprob:
                params.logprobs = body.top_logprobs_num
                if body.logprob_start_len >= 0:
                    params.prompt_logprobs = body.top_logprobs_num
            params.__post_init__()
            check_limits(params.stop, params)
        except (ValueError, TypeError) as err:
            return JSONResponse({"error": {"message": str(err)}}, 400)
        except Exception as err:  # a limit (--max-n, --max-tokens, stop strings): an ApiError
            return JSONResponse({"error": {"message": getattr(err, "message", str(err))}}, getattr(err, "status", 400))
        batch = isinstance(body.text, list) or (bool(body.input_ids) and isinstance(body.input_ids[0], list))  # type: ignore[index]
        raw = body.text if body.text is not None else body.input_ids
        prompts: list[Any] = list(raw) if batch else [raw]  # type: ignore[arg-type]
        entries = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        rid = body.rid or f"sgl-{time.monotonic_ns()}"
        text_of = inner.detokenizer.token_text
        if body.stream:
            if batch:
                return JSONResponse({"error": {"message": "stream takes one prompt per request"}}, 400)
            params.output_kind = "cumulative"
            # an async generator function: its iterator has aclose()
            stream = cast("AsyncGenerator[RequestOutput, None]", engine.generate(entries[0], params, rid))
            try:
                first = await guarded(anext(stream))  # a refused prompt is a 400 before any byte is streamed
            except Exception as err:
                await stream.aclose()
                return JSONResponse({"error": {"message": getattr(err, "message", str(err))}},
                                    getattr(err, "status", 400))

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

        async def one(entry: Any, request_id: str) -> RequestOutput:
            final = None
            async for out in engine.generate(entry, params, request_id):
                final = out
            assert final is not None
            return final

        try:
            async with asyncio.TaskGroup() as group:  # one failing prompt cancels (aborts) the others
                tasks = [group.create_task(guarded(one(e, f"{rid}-{i}" if batch else rid)))
                         for i, e in enumerate(entries)]
            outs = [task.result() for task in tasks]
        except BaseExceptionGroup as errors:
            first = errors.exceptions[0]
            status = getattr(first, "status", 400)
            return JSONResponse({"error": {"message": getattr(first, "message", str(first))}}, status)
        results = [response(o, c, body, text_of, inner.weight_version_label) for o in outs for c in o.outputs]
        return results if batch or params.n > 1 else results[0]

    @app.get("/health_generate")
    async def health_generate() -> Any:
        """Healthy and able to generate one token (while paused, healthy without generating)."""
        problem = inner.health_problem()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": problem}, 503)
        if not inner.is_paused() and not inner.is_asleep():
            async for _ in engine.generate({"prompt_token_ids": [0]}, SamplingParams(max_tokens=1), None):
                pass
        return {"status": "ok"}

    if admin is None:
        return

    @app.post("/pause_generation", dependencies=admin)
    async def pause_generation(body: PauseGenerationBody | None = None) -> Any:
        """abort: requests end now; retract: they stop and are recomputed at continue; in_place: they freeze."""
        mode = (body or PauseGenerationBody()).mode
        ours = {"abort": ("abort", True), "retract": ("keep", True), "in_place": ("keep", False)}[mode]
        await guarded(engine.pause_generation(*ours))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation", dependencies=admin)
    async def continue_generation() -> Any:
        await guarded(engine.resume_generation())
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=admin)
    async def flush_cache() -> Any:
        if inner.requests:
            return PlainTextResponse("Cache not flushed: requests are running or waiting.", status_code=400)
        await guarded(engine.reset_prefix_cache())
        return PlainTextResponse("Cache flushed.")

    @app.post("/abort_request", dependencies=admin)
    async def abort_request(body: AbortBody | None = None) -> Any:
        body = body or AbortBody()
        rid = body.rid
        ids = [r for r in list(inner.requests) if body.abort_all or (rid and (r == rid or r.startswith(f"{rid}-")))]
        for request_id in ids:
            await engine.abort(request_id)
        return {"success": True, "aborted": len(ids)}

    @app.get("/v1/loads", dependencies=admin)
    async def loads() -> Any:
        running, waiting = inner.queue_lengths()
        return {"timestamp": time.time(), "version": "hotswap", "num_accelerators": 0,
                "loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                           "num_reqs": running + waiting, "num_used_tokens": 0}]}

    # ---- weights -----------------------------------------------------------------------------------------

    @app.post("/update_weights_from_disk", dependencies=admin)
    async def update_weights_from_disk(body: DiskBody) -> Any:
        if body.load_format not in (None, "auto", "safetensors"):
            return fail(ValueError(f"load_format {body.load_format!r} is not supported (safetensors folders)"))
        try:
            parse_version(body.weight_version)  # checked before anything moves
        except ValueError as err:
            return fail(err)
        resume = await paused(body.abort_all_requests)
        try:
            _, error = await ok_or_400(engine.reload_weights(weights_path=body.model_path,
                                                             weight_version=body.weight_version))
        finally:
            if resume:
                await engine.resume_generation()
        if error is not None:
            return error
        version_changed()
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.post("/init_weights_update_group", dependencies=admin)
    async def init_weights_update_group(body: GroupBody) -> Any:
        info = {"backend": "sglang_dist", "master_address": body.master_address, "master_port": body.master_port,
                "rank_offset": body.rank_offset, "world_size": body.world_size, "group_name": body.group_name,
                "dist_backend": body.backend}
        _, error = await ok_or_400(engine.init_weight_transfer_engine(info))
        return error or {"success": True, "message": "Succeeded to initialize the weights update group."}

    @app.post("/destroy_weights_update_group", dependencies=admin)
    async def destroy_weights_update_group() -> Any:
        _, error = await ok_or_400(engine.shutdown_weight_transfer_engine())
        return error or {"success": True, "message": "Succeeded to destroy the weights update group."}

    @app.post("/begin_weight_update", dependencies=admin)
    async def begin_weight_update(body: SelectorBody | None = None) -> Any:
        selector = (body or SelectorBody()).selector
        has_draft = inner.config.draft_model_config is not None
        target = {"target": "model", "draft": "draft", "all": "all" if has_draft else "model"}[selector]
        token, error = await ok_or_400(engine.start_weight_update(target))
        if error is not None:
            return error
        state["session"], state["version"] = token, None
        return {"success": True, "message": "Weight update session started."}

    def session_token() -> str | None:
        """The /begin_weight_update session's token while that session is the engine's open one."""
        token = state["session"]
        if token is not None and token != inner.session_token:
            state["session"] = token = None  # it ended another way (abort, destroy, a vLLM-route finish)
            state["version"] = None
        return cast("str | None", token)

    @app.post("/end_weight_update", dependencies=admin)
    async def end_weight_update() -> Any:
        token = session_token()
        version, state["session"], state["version"] = state["version"], None, None
        if token is None:
            return fail(ValueError("no weight update session is open; call /begin_weight_update first"))
        _, error = await ok_or_400(engine.finish_weight_update(version, token))
        if error is not None:
            return error
        version_changed()
        return {"success": True, "message": "Weight update session ended."}

    @app.post("/update_weights_from_distributed", dependencies=admin)
    async def update_weights_from_distributed(body: DistributedBody) -> Any:
        info = {"names": body.names, "dtypes": body.dtypes, "shapes": body.shapes, "load_format": body.load_format}
        try:
            parse_version(body.weight_version)  # checked before anything moves
        except ValueError as err:
            return fail(err)
        if not body.names:  # an empty bucket changes nothing (and nothing is broadcast for it)
            return {"success": True, "message": "Nothing to update."}
        token = session_token()
        if token is not None:  # inside /begin_weight_update: one more update of that session
            _, error = await ok_or_400(engine.update_weights(info, token))
            if error is not None:
                state["session"] = state["version"] = None  # the failed update ended (and rolled back) the session
            elif body.weight_version is not None:  # the version /end_weight_update commits
                state["version"] = body.weight_version
            return error or {"success": True, "message": "Succeeded to update parameter online."}
        resume = await paused(body.abort_all_requests)
        try:
            token, error = await ok_or_400(engine.start_weight_update("model"))
            if error is None:
                _, error = await ok_or_400(engine.update_weights(info, token))
            if error is None:
                _, error = await ok_or_400(engine.finish_weight_update(body.weight_version, token))
        finally:
            if token is not None and inner.session_token == token:  # never leave the implicit session open
                await engine.abort_weight_update(token)
            if resume:
                await engine.resume_generation()
        if error is not None:
            return error
        version_changed()
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.get("/model_info", dependencies=admin)
    async def model_info() -> Any:
        mc = inner.config.model_config
        return {"model_path": mc.model, "served_model_name": served_model_name, "tokenizer_path": mc.tokenizer,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": inner.weight_version_label, "load_format": "safetensors"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"], dependencies=admin)
    async def release_memory_occupation(body: TagsBody | None = None) -> Any:
        tags = (body or TagsBody()).tags
        level = 2 if tags is None or "weights" in tags else 1
        await guarded(engine.sleep(level))
        return {"success": True}

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"], dependencies=admin)
    async def resume_memory_occupation(body: TagsBody | None = None) -> Any:
        await guarded(engine.wake_up((body or TagsBody()).tags))
        return {"success": True}
