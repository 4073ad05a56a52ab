"""OpenAI's routes: `/v1/models`, `/v1/completions` and `/v1/chat/completions` (`router`, streaming over SSE),
and `/tokenize` and `/detokenize` (`tokenizer_router`, served only with the admin routes on).

`create_app` includes both behind the user's API key. Client mistakes (a bad value, a limit exceeded, a template
that cannot render) are 400s in OpenAI's error shape. A request's `model` is the served model's name, or a loaded
LoRA adapter's (the request runs with that adapter, as in vLLM); another name is a 404. The request and response
shapes are `openai_protocol`'s."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request

import hotswap.entrypoints.server.generation as generation
from hotswap.entrypoints import openai_protocol as oai
from hotswap.entrypoints.server.bodies import DetokenizeBody, TokenizeBody
from hotswap.entrypoints.server.state import ApiError, StateDep
from hotswap.outputs import RequestOutput

router = APIRouter()
tokenizer_router = APIRouter()


def check_unicode(text: str, what: str) -> None:
    """Raises ValueError when `text` cannot be encoded as UTF-8 (lone surrogates), naming `what`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{what} is not valid Unicode ({err.reason} at character {err.start})") from None


def engine_prompt(prompt: str | list[int], salt: str | None) -> dict[str, Any]:
    """The engine's prompt entry for a text or token ids, with the prefix-cache salt if given."""
    entry: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    if salt is not None:
        entry["cache_salt"] = salt
    return entry


def usage_chunk(model: str, request_id: str, created: int, kind: str, counts: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the token counts."""
    total = counts["prompt"] + counts["completion"]
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [],
        "usage": {
            "prompt_tokens": counts["prompt"],
            "completion_tokens": counts["completion"],
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": counts.get("cached", 0)},
        },
    }


@router.get("/v1/models")
async def models(state: StateDep) -> dict[str, object]:
    """The served model and, as vLLM lists them, each loaded LoRA adapter: `id` its name (what a request's `model`
    names to run with it), `root` its folder (None for one loaded from tensors), `parent` the served model; with
    hotswap's `lora_int_id` and adapter `version`."""
    max_len = state.engine.config.model_config.max_model_len
    created = int(time.time())
    base = state.served_model_name
    cards: list[dict[str, Any]] = [
        {
            "id": base,
            "object": "model",
            "created": created,
            "owned_by": "hotswap",
            "root": state.engine.config.model_config.model,
            "parent": None,
            "max_model_len": max_len,
        }
    ]
    for name, adapter in (await state.loras()).items():
        cards.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "hotswap",
                "root": adapter["lora_path"],
                "parent": base,
                "max_model_len": max_len,
                "lora_int_id": adapter["lora_int_id"],
                "version": adapter["version"],
            }
        )
    return {"object": "list", "data": cards}


@router.post("/v1/completions")
async def completions(body: oai.CompletionRequest, http: Request, state: StateDep) -> object:
    lora = await state.model_lora(body.model)
    engine, name = state.engine, body.model
    prompts = body.prompts()
    echo_only = body.echo and body.max_tokens == 0
    try:
        if body.max_tokens == 0 and not body.echo:
            raise ValueError("max_tokens=0 needs echo=true (the prompt is all there is to return)")
        for p in prompts:
            if isinstance(p, str):
                check_unicode(p, "the prompt")
        echo_logprobs = None
        if body.echo and body.logprobs is not None:  # the prompt's logprobs, in the same top-k shape
            echo_logprobs = body.logprobs if body.prompt_logprobs is None else body.prompt_logprobs  # -1: vocab
        params = oai.sampling_params(
            body, body.logprobs, 1 if echo_only else body.max_tokens, state.vocab_size, echo_logprobs
        )
        state.check_limits(body.stop, params)
        if body.stream and len(prompts) > 1:
            raise ValueError("stream=true takes one prompt per request; send a batch without streaming")
        if body.stream and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs (and echo with logprobs) are not available with stream=true")
    except ValueError as err:
        raise ApiError(400, str(err)) from err
    shape = oai.Shape.of(body, echo=body.echo, drop_output=echo_only, params=params)
    request_id = oai.new_id("cmpl")
    created = int(time.time())
    tok = engine.tokenizer
    texts = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if body.echo else [""] * len(prompts)

    if not body.stream:
        try:
            async with asyncio.TaskGroup() as group:  # one failing prompt cancels the others
                tasks = [
                    group.create_task(
                        generation.generate_full(
                            state, engine_prompt(p, body.cache_salt), params, f"{request_id}-{i}", http, lora
                        )
                    )
                    for i, p in enumerate(prompts)
                ]
        except BaseExceptionGroup as group_error:  # the first prompt's error, as one prompt would give it
            raise group_error.exceptions[0] from None
        outs = [task.result() for task in tasks]
        firsts = [engine.detokenizer.token_text(o.prompt_token_ids[0]) if body.echo else "" for o in outs]
        return oai.completion_response(outs, name, request_id, shape, texts, firsts)

    counts = {"prompt": 0, "completion": 0}
    echoed = [False]

    def chunk(out: RequestOutput) -> dict[str, Any]:
        counts["prompt"], counts["cached"] = len(out.prompt_token_ids), out.num_cached_tokens
        counts["completion"] += sum(len(c.token_ids) for c in out.outputs)
        prefix = texts[0] if not echoed[0] else ""
        echoed[0] = True
        choices = [oai.completion_choice(out, c, c.index, shape, prefix) for c in out.outputs]
        return {"id": request_id, "object": "text_completion", "created": created, "model": name, "choices": choices}

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    running = await generation.start(state, engine_prompt(prompts[0], body.cache_salt), params, request_id, http, lora)
    return running.stream(
        chunk, (lambda: usage_chunk(name, request_id, created, "text_completion", counts)) if include_usage else None
    )


@tokenizer_router.post("/tokenize")
async def tokenize(body: TokenizeBody, state: StateDep) -> dict[str, object]:
    tok = state.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give 'prompt' or 'messages'")
    try:
        if body.messages is not None:
            ids = tok.apply_chat_template(
                body.messages, add_generation_prompt=body.add_generation_prompt, tokenize=True, return_dict=False
            )
        else:
            ids = tok.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
    except Exception as err:
        raise ApiError(400, f"cannot tokenize: {err}") from err
    max_len = state.engine.config.model_config.max_model_len
    return {"tokens": list(ids), "count": len(ids), "max_model_len": max_len}


@tokenizer_router.post("/detokenize")
async def detokenize(body: DetokenizeBody, state: StateDep) -> dict[str, object]:
    vocab_size = int(state.engine.config.model_config.hf_config.get("vocab_size", 0))
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise ApiError(400, f"token ids must be in [0, {vocab_size})")
    return {"prompt": state.engine.tokenizer.decode(body.tokens)}
