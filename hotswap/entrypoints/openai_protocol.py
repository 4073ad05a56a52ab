"""Request models of the OpenAI-compatible routes and the conversion to SamplingParams and response JSON."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hotswap.outputs import CompletionOutput, RequestOutput
from hotswap.sampling_params import SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)

    model: str
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)


class CompletionRequest(_Request):
    prompt: str | list[int] = Field(..., min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=1)


def sampling_params(request: _Request, logprobs: int | None, max_tokens: int | None) -> SamplingParams:
    """Raises ValueError (a 400) for combinations SamplingParams rejects."""
    return SamplingParams(
        n=request.n,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=request.stop,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        output_kind="delta" if request.stream else "cumulative",
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def spans(completion: CompletionOutput) -> list[list[int]]:
    return [[s.version, s.start_token, s.end_token] for s in completion.weight_versions]


def completion_logprobs(completion: CompletionOutput, offset: int) -> dict[str, Any] | None:
    """The legacy completions logprobs object (tokens, token_logprobs, top_logprobs, text_offset)."""
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token or "")
        token_logprobs.append(chosen.logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(completion: CompletionOutput, top_n: int) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        chosen = entry[token_id]
        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)[:top_n]
        content.append(
            {
                "token": chosen.decoded_token or "",
                "logprob": chosen.logprob,
                "bytes": list((chosen.decoded_token or "").encode()),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token or "",
                        "logprob": lp.logprob,
                        "bytes": list((lp.decoded_token or "").encode()),
                    }
                    for lp in ranked
                ],
            }
        )
    return {"content": content}


def usage(out: RequestOutput) -> dict[str, int]:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_response(out: RequestOutput, model: str, request_id: str) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(c, 0),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "weight_versions": spans(c),
            }
            for c in out.outputs
        ],
        "usage": usage(out),
    }


def chat_response(out: RequestOutput, model: str, request_id: str, top_n: int) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, top_n),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "weight_versions": spans(c),
            }
            for c in out.outputs
        ],
        "usage": usage(out),
    }


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
