"""Request models of the OpenAI-compatible routes and the conversion to SamplingParams and response JSON."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hotswap.entrypoints.logprobs_wire import entries_compact, json_logprob
from hotswap.entrypoints.replay_wire import forced_routes, mask_lists, npy_base64
from hotswap.outputs import CompletionOutput, Logprob, RequestOutput, WeightVersionSpan
from hotswap.sampling_params import SamplingParams

# Fields that would change what is generated and that hotswap does not implement: refused with a 400 naming the
# field, never silently ignored (a constrained-decoding request answered unconstrained is a wrong answer).
UNSUPPORTED = (
    "guided_whitespace_pattern",
    "suffix",
    "use_beam_search",
    "length_penalty",
    "logits_processors",
    "bad_words",
    "allowed_token_ids",
    "truncate_prompt_tokens",
    "prompt_embeds",
    "logprob_token_ids",
    "functions",
    "function_call",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in UNSUPPORTED:
                if data.get(name) not in (None, False, [], {}):
                    raise ValueError(f"{name!r} is not supported by this server (it would change the output)")
            constraint = constraint_of(data)
            if constraint is not None:
                data = {**data, "structured_outputs": constraint}
            best_of = data.get("best_of")
            if best_of not in (None, 1) and best_of != data.get("n", 1):
                raise ValueError("'best_of' other than n is not supported")
        return data

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
    stop_token_ids: list[int] | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    return_weight_versions: bool = False
    cache_salt: str | None = None
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(None, ge=-1)
    return_routed_experts: bool = False
    return_sampling_mask: bool = False
    on_weight_update: Literal["keep", "recompute"] | None = None  # the KV cache at a weight commit (hotswap's)
    forced_routed_experts: Any = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's, or from response_format / guided_* (see constraint_of)
    # "base64": logprobs and prompt logprobs as little-endian arrays (`logprobs_b64`, `prompt_logprobs_b64`;
    # hotswap/entrypoints/logprobs_wire.py) in place of the JSON form
    logprobs_format: Literal["json", "base64"] = "json"


# vLLM's older per-field names -> StructuredOutputsParams fields
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_of(data: dict[str, Any]) -> dict[str, object] | None:
    """The request's output constraint as StructuredOutputsParams fields, from one of `structured_outputs`,
    OpenAI's `response_format` (json_schema, json_object; text is none) and vLLM's `guided_*`. Raises ValueError
    when more than one is given or a response_format is malformed."""
    found: list[tuple[str, dict[str, Any]]] = []
    if data.get("structured_outputs") not in (None, {}):
        if not isinstance(data["structured_outputs"], dict):
            raise ValueError("'structured_outputs' must be an object")
        found.append(("structured_outputs", data["structured_outputs"]))
    fmt = data.get("response_format")
    if fmt not in (None, {}):
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("response_format.json_schema must be an object with a 'schema' object")
            found.append(("response_format", {"json": spec.get("schema", {})}))
        elif kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind != "text":
            raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    for name, field in _GUIDED.items():
        if data.get(name) not in (None, [], ""):
            found.append((name, {field: data[name]}))
    if len(found) > 1:
        raise ValueError(f"give one output constraint, got {', '.join(name for name, _ in found)}")
    return found[0][1] if found else None


class CompletionRequest(_Request):
    # a text, a list of texts, token ids, or a list of token-id lists (a batch: choices are prompt-major)
    prompt: str | list[str] | list[int] | list[list[int]] = Field(..., min_length=1)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=-1)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one per batch entry."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [cast(Any, p)]
        return list(cast(Any, p))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ... pass to the chat template

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text; content parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    parallel_tool_calls: bool = True

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them: content as text, and an assistant's tool-call arguments as
        objects (OpenAI sends them as JSON text; templates render them with `tojson`)."""
        out = []
        for m in self.messages:
            message = {**m.model_dump(exclude_none=True), "content": m.text()}
            calls = message.get("tool_calls")
            if isinstance(calls, list):
                message["tool_calls"] = [_call_for_template(c) for c in calls]
            out.append(message)
        return out


def _call_for_template(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except json.JSONDecodeError:
            return call
    return call


def sampling_params(
    request: _Request, logprobs: int | None, max_tokens: int | None, vocab: int, prompt_logprobs: int | None = None
) -> SamplingParams:
    """Raises ValueError (a 400) for combinations SamplingParams rejects. A logprobs count of -1 means the whole
    vocabulary (vLLM's convention; the server's --max-logprobs still bounds it)."""
    logprobs = vocab if logprobs == -1 else logprobs
    if prompt_logprobs is None:
        prompt_logprobs = request.prompt_logprobs
    prompt_logprobs = vocab if prompt_logprobs == -1 else prompt_logprobs
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
        prompt_logprobs=prompt_logprobs,
        stop_token_ids=request.stop_token_ids,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=cast(Any, request.logit_bias),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        output_kind="delta" if request.stream else "cumulative",
        return_routed_experts=request.return_routed_experts,
        return_sampling_mask=request.return_sampling_mask,
        on_weight_update=request.on_weight_update,
        forced_routed_experts=forced_routes(request.forced_routed_experts),
        structured_outputs=request.structured_outputs,
    )


def replay_fields(c: CompletionOutput) -> dict[str, object]:
    """A choice's `routed_experts` (once finished) and `sampling_mask`, where the request asked for them."""
    fields: dict[str, object] = {}
    if c.routed_experts is not None:
        fields["routed_experts"] = npy_base64(c.routed_experts)
    if c.sampling_mask is not None:
        fields["sampling_mask"] = mask_lists(c.sampling_mask)
    return fields


def lora_fields(out: RequestOutput, c: CompletionOutput, shape: Shape | None = None) -> dict[str, object]:
    """A choice's `lora_versions` when its request ran with a LoRA adapter (none otherwise): the adapter version
    of each output token as spans [[version, start, end]] over the choice's tokens (the `weight_versions` shape),
    or objects {"version", "start", "end"} with return_weight_versions."""
    if out.lora_name is None:
        return {}
    if shape is not None and shape.vllm_versions:
        return {"lora_versions": [{"version": v, "start": start, "end": end} for v, start, end in c.lora_versions]}
    return {"lora_versions": [[v, start, end] for v, start, end in c.lora_versions]}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Shape:
    """What a response carries beyond the OpenAI basics (vLLM's extensions)."""

    token_ids: bool = False  # choices' token_ids and prompt_token_ids
    as_ids: bool = False  # logprob tokens as "token_id:<id>"
    vllm_versions: bool = False  # weight_versions as vLLM's [{"version", "start", "end"}]
    echo: bool = False  # completions: the prompt before the text, its logprobs before the output's
    drop_output: bool = False  # echo with max_tokens 0: only the prompt
    compact: bool = False  # logprobs_format "base64": logprobs as arrays (logprobs_b64, prompt_logprobs_b64)
    top_k: int = 0  # the top logprobs asked per output token (the compact arrays' K)
    prompt_top_k: int = 0  # and per prompt token

    @classmethod
    def of(
        cls, request: _Request, echo: bool = False, drop_output: bool = False, params: SamplingParams | None = None
    ) -> Shape:
        """The shape `request` asks for; `params` (its SamplingParams) give the compact arrays' top-k counts."""
        return cls(
            request.return_token_ids,
            request.return_tokens_as_token_ids,
            request.return_weight_versions,
            echo,
            drop_output,
            request.logprobs_format == "base64",
            (params.logprobs or 0) if params is not None else 0,
            (params.prompt_logprobs or 0) if params is not None else 0,
        )


def spans(completion: CompletionOutput, shape: Shape | None = None) -> list[object]:
    """The output's weight-version spans: [[label, start, end]], or vLLM's objects with return_weight_versions
    ({"version": label, "start", "end", "version_id": the integer}). Labels are strings, as vLLM's and SGLang's
    clients compare them; two adjacent spans with one label are two versions that carried the same label."""
    if shape is not None and shape.vllm_versions:
        return [span_object(s) for s in completion.weight_versions]
    return [[s.label, s.start_token, s.end_token] for s in completion.weight_versions]


def span_object(span: WeightVersionSpan) -> dict[str, object]:
    """One span in vLLM's and SGLang's object shape, with the version's integer as `version_id`."""
    return {"version": span.label, "start": span.start_token, "end": span.end_token, "version_id": span.version}


def _token(lp: Logprob, token_id: int, shape: Shape) -> str:
    return f"token_id:{token_id}" if shape.as_ids else (lp.decoded_token or "")


def completion_logprobs(
    completion: CompletionOutput,
    offset: int,
    shape: Shape = Shape(),
    prompt: RequestOutput | None = None,
    first_text: str = "",
) -> dict[str, object] | None:
    """The legacy completions logprobs object (tokens, token_logprobs, top_logprobs, text_offset); with `echo`,
    the prompt's tokens first (the first has no logprob)."""
    if completion.logprobs is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    entries: list[tuple[int, dict[int, Logprob] | None]] = []
    if prompt is not None and prompt.prompt_logprobs is not None:
        entries += list(zip(prompt.prompt_token_ids, prompt.prompt_logprobs, strict=True))
    if not shape.drop_output:
        entries += list(zip(completion.token_ids, completion.logprobs, strict=True))
    for token_id, entry in entries:
        if entry is None:  # the first prompt token
            text = first_text
            tokens.append(f"token_id:{token_id}" if shape.as_ids else text)
            token_logprobs.append(None)
            top.append(None)
            offsets.append(offset)
            offset += len(text)
            continue
        chosen = entry[token_id]
        tokens.append(_token(chosen, token_id, shape))
        token_logprobs.append(json_logprob(chosen.logprob))
        top.append({_token(lp, tid, shape): json_logprob(lp.logprob) for tid, lp in entry.items()})
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, object] | None] | None:
    """vLLM's prompt_logprobs: None for the first token, then {"<token id>": {logprob, rank, decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(tid): {"logprob": json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in out.prompt_logprobs
    ]


def prompt_logprobs_fields(out: RequestOutput, shape: Shape) -> dict[str, object]:
    """A response's prompt logprobs where asked: vLLM's `prompt_logprobs` (JSON), or with logprobs_format "base64"
    `prompt_logprobs_b64`, the compact arrays of prompt tokens 1.. (hotswap/entrypoints/logprobs_wire.py)."""
    if out.prompt_logprobs is None:
        return {}
    if shape.compact:
        entries = cast("list[dict[int, Logprob]]", out.prompt_logprobs[1:])
        return {"prompt_logprobs_b64": entries_compact(list(out.prompt_token_ids[1:]), entries, shape.prompt_top_k)}
    return {"prompt_logprobs": prompt_logprobs_json(out)}


def compact_logprobs_fields(completion: CompletionOutput, shape: Shape) -> dict[str, object]:
    """A choice's `logprobs_b64` (the compact arrays of its output tokens, or of this delta's) where logprobs were
    asked with logprobs_format "base64"; {} otherwise."""
    if not shape.compact or completion.logprobs is None or shape.drop_output:
        return {}
    return {"logprobs_b64": entries_compact(list(completion.token_ids), completion.logprobs, shape.top_k)}


def chat_logprobs(completion: CompletionOutput, top_n: int, shape: Shape = Shape()) -> dict[str, object] | None:
    """The chat choice's `logprobs` (OpenAI's content list); None where not asked, or asked in the compact form."""
    if completion.logprobs is None or shape.compact:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        chosen = entry[token_id]
        ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)[:top_n]
        content.append(
            {
                "token": _token(chosen, token_id, shape),
                "logprob": json_logprob(chosen.logprob),
                "bytes": list((chosen.decoded_token or "").encode()),
                "top_logprobs": [
                    {
                        "token": _token(lp, tid, shape),
                        "logprob": json_logprob(lp.logprob),
                        "bytes": list((lp.decoded_token or "").encode()),
                    }
                    for tid, lp in ranked
                ],
            }
        )
    return {"content": content}


def usage(outs: list[RequestOutput]) -> dict[str, object]:
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_choice(
    out: RequestOutput, c: CompletionOutput, index: int, shape: Shape, prompt_text: str, first_text: str = ""
) -> dict[str, object]:
    """One choice of a completions response (or a stream chunk: `c` a delta; `prompt_text` "" after the first).
    `first_text`: the text of the first prompt token (echoed logprobs)."""
    text = "" if shape.drop_output else c.text
    choice: dict[str, object] = {
        "index": index,
        "text": (prompt_text + text) if shape.echo else text,
        "logprobs": None
        if shape.compact
        else completion_logprobs(c, 0, shape, out if shape.echo else None, first_text),
        **compact_logprobs_fields(c, shape),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "weight_versions": spans(c, shape),
        **lora_fields(out, c, shape),
        **replay_fields(c),
    }
    if shape.token_ids:
        choice["token_ids"] = [] if shape.drop_output else list(c.token_ids)
        choice["prompt_token_ids"] = list(out.prompt_token_ids)
    choice.update(prompt_logprobs_fields(out, shape))
    return choice


def completion_response(
    outs: list[RequestOutput],
    model: str,
    request_id: str,
    shape: Shape,
    prompt_texts: list[str],
    first_texts: list[str],
) -> dict[str, object]:
    """Choices prompt-major: prompt i's sample j has index i * n + j."""
    choices = []
    for i, (out, text, first) in enumerate(zip(outs, prompt_texts, first_texts, strict=True)):
        n = len(out.outputs)
        choices += [completion_choice(out, c, i * n + c.index, shape, text, first) for c in out.outputs]
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(outs),
    }


def chat_response(
    out: RequestOutput, model: str, request_id: str, top_n: int, shape: Shape = Shape()
) -> dict[str, Any]:
    response: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, top_n, shape),
                **compact_logprobs_fields(c, shape),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "weight_versions": spans(c, shape),
                **lora_fields(out, c, shape),
                **({"token_ids": list(c.token_ids)} if shape.token_ids else {}),
                **replay_fields(c),
            }
            for c in out.outputs
        ],
        "usage": usage([out]),
    }
    if shape.token_ids:
        response["prompt_token_ids"] = list(out.prompt_token_ids)
    return response


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, object]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
