"""Request models of SGLang's routes (`hotswap.entrypoints.server.sglang`), and the conversion of SGLang's
sampling parameters to SamplingParams and of outputs to SGLang's generate results.

Shapes follow SGLang 0.5.2x (`sglang/srt/entrypoints/http_server.py`, `io_struct.py`).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from hotswap.entrypoints.openai_protocol import span_object
from hotswap.entrypoints.replay_wire import int32_base64, sglang_mask
from hotswap.outputs import CompletionOutput, RequestOutput
from hotswap.sampling_params import SamplingParams


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
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0)  # rows before it are not returned (the caller holds them)
    return_sampling_mask: bool = False
    forced_routed_experts: Any = None
    session_params: dict[str, Any] | None = None  # {"id": <an open session's id>, ...}: a turn of that session
    # a LoRA adapter for every input, or one (or None: the base model) per input: a loaded adapter's name, or a
    # folder, loaded under its path as its name on first use
    lora_path: str | list[str | None] | None = None


class OpenSessionBody(_Lenient):
    capacity_of_str_len: int | None = None  # SGLang's; the cache budget here is --session-cache-fraction
    session_id: str | None = Field(default=None, min_length=1)


class CloseSessionBody(_Lenient):
    session_id: str = Field(min_length=1)


class PauseGenerationBody(_Lenient):
    mode: str = Field(default="abort", pattern="^(abort|retract|in_place)$")


class _Delta(_Lenient):
    """A delta update's fields (hotswap/weights/delta.py), on SGLang's weight routes."""

    encoding: str | None = Field(default=None, pattern="^(full|overwrite|xor|sparse)$")
    base_version: StrictStr | StrictInt | None = None
    checksums: dict[str, str] | None = None


class DiskBody(_Delta):
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


class DistributedBody(_Delta):
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
    prefix: bool = False  # `rid` is a prefix ("group::"): every request whose id starts with it


class TagsBody(_Lenient):
    tags: list[str] | None = None


class LoRAPathBody(_Lenient):
    """SGLang's /load_lora_adapter. `upsert` (SGLang PR #32238): replace a loaded adapter's weights in place."""

    lora_name: str = ""
    lora_path: str = ""
    pinned: bool = False
    upsert: bool = False


class LoRATensorsBody(_Lenient):
    """SGLang's /load_lora_adapter_from_tensors: the adapter's PEFT config (adapter_config.json's fields) and its
    tensors, `serialized_named_tensors` (one entry per TP rank, 0.5.18 on) or `serialized_tensors` (one, earlier);
    each entry is decoded by `decode_tensors`."""

    lora_name: str = ""
    config_dict: dict[str, Any] = Field(default_factory=dict)
    serialized_named_tensors: list[str] | None = None
    serialized_tensors: str | None = None
    load_format: str | None = None
    pinned: bool = False
    upsert: bool = False


class LoRANameBody(_Lenient):
    lora_name: str = ""


TENSOR_LOAD_FORMATS = (None, "direct", "auto", "safetensors", "torch")


def decode_tensors(payload: str) -> dict[str, torch.Tensor]:
    """A base64 string of serialized named tensors, as SGLang's tensor routes carry them, as {name: CPU tensor}:
    the bytes of `safetensors.torch.save(tensors)`, or of `torch.save` of a dict (or of (name, tensor) pairs),
    read with `weights_only=True`. SGLang's own `MultiprocessingSerializer` bytes (a pickle of CUDA-IPC or
    shared-memory handles) are refused: unpickling a request body would run whatever it names. Raises ValueError
    naming the problem."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"serialized tensors are not valid base64 ({err})") from None
    if raw[:2] == b"PK":  # torch.save's zip
        try:
            loaded = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(
                f"serialized tensors: cannot read torch.save bytes with weights_only=True ({err})"
            ) from None
        pairs = list(loaded.items()) if isinstance(loaded, dict) else loaded
        if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in pairs
        ):
            raise ValueError(
                "serialized tensors: torch.save bytes must hold a dict of name -> tensor (or a list of "
                "(name, tensor) pairs)"
            )
        return dict(pairs)
    header = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else 0
    if 0 < header <= len(raw) - 8 and raw[8:9] == b"{":  # safetensors: a u64 header length, then its JSON
        from safetensors import SafetensorError
        from safetensors.torch import load as load_safetensors

        try:
            return load_safetensors(raw)
        except (SafetensorError, ValueError, RuntimeError) as err:
            raise ValueError(f"serialized tensors: unreadable safetensors bytes ({err})") from None
    if raw[:1] == b"\x80":
        raise ValueError(
            "serialized tensors are a pickle (SGLang's MultiprocessingSerializer): refused, since "
            "unpickling a request body runs arbitrary code; send base64 of "
            "safetensors.torch.save(tensors) (or of torch.save(state_dict)) instead"
        )
    raise ValueError("serialized tensors are neither safetensors nor torch.save bytes")


# SGLang sampling keys -> SamplingParams fields (others that change results are refused)
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "n": "n",
    "sampling_seed": "seed",
    "seed": "seed",
    "logit_bias": "logit_bias",
}
_REFUSED = ("structural_tag", "custom_params")
# SGLang's constraint keys -> StructuredOutputsParams fields (at most one per request)
_CONSTRAINTS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
_IGNORED = ("spaces_between_special_tokens", "no_stop_trim", "stream_interval")


def sampling_params(raw: dict[str, Any], vocab: int) -> SamplingParams:
    """SGLang's sampling_params as SamplingParams. Raises ValueError naming a field that would change the output
    and is not supported. `custom_params.return_top_p_token_ids` asks for the sampling mask (slime's key)."""
    fields: dict[str, Any] = {"max_tokens": 128}  # SGLang's default max_new_tokens
    custom = dict(raw.get("custom_params") or {})
    if isinstance(custom, dict) and "return_top_p_token_ids" in custom:
        fields["return_sampling_mask"] = bool(custom.pop("return_top_p_token_ids"))
        raw = {**raw, "custom_params": custom}
    for key, value in raw.items():
        if key in _REFUSED and value not in (None, False, {}, ""):
            raise ValueError(f"sampling_params.{key} is not supported by this server (it would change the output)")
        if key in _SAMPLING and value is not None:
            fields[_SAMPLING[key]] = value
    given = {key: raw[key] for key in _CONSTRAINTS if raw.get(key) not in (None, "")}
    if len(given) > 1:
        raise ValueError(f"sampling_params may hold one of json_schema, regex and ebnf, got {sorted(given)}")
    for key, value in given.items():
        fields["structured_outputs"] = {_CONSTRAINTS[key]: value}
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


def response(
    out: RequestOutput, c: CompletionOutput, body: GenerateBody, text_of: Callable[[int], str], version: str
) -> dict[str, Any]:
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
    if out.lora_name is not None:  # the adapter and its version per output token, spans as weight_versions
        meta["lora_name"] = out.lora_name
        meta["lora_versions"] = [{"version": v, "start": start, "end": end} for v, start, end in c.lora_versions]
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
                [
                    [lp.logprob, tid, text(tid)]
                    for tid, lp in sorted(e.items(), key=lambda kv: kv[1].rank or 0)
                    if lp.rank is not None
                ][: body.top_logprobs_num]
                for e in entries
            ]
        if out.prompt_logprobs is not None:
            start = max(body.logprob_start_len, 0)
            ids, plp = out.prompt_token_ids, out.prompt_logprobs
            meta["input_token_logprobs"] = [
                [None if plp[i] is None else plp[i][ids[i]].logprob, ids[i], text(ids[i])]  # type: ignore[index]
                for i in range(start, len(ids))
            ]
    if c.routed_experts is not None:
        start = min(body.routed_experts_start_len, len(c.routed_experts))
        meta["routed_experts"] = int32_base64(c.routed_experts[start:])
        meta["routed_experts_start_len"] = start
    if c.sampling_mask is not None:
        meta.update(sglang_mask(c.sampling_mask))
    result: dict[str, Any] = {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}
    if body.return_prompt_token_ids:
        result["prompt_token_ids"] = list(out.prompt_token_ids)
    return result
