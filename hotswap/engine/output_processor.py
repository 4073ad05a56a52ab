"""From sampled tokens to what callers see: appending a token (with its logprobs and weight version), the stop
conditions, and building `RequestOutput`s (whole, or as deltas for streaming)."""

from __future__ import annotations

import json
import os
from typing import Any

from hotswap.engine.detokenizer import Detokenizer, find_stop
from hotswap.engine.grammar import advance
from hotswap.engine.sequence import Request, Sequence
from hotswap.outputs import CompletionOutput, Logprob, RequestOutput, SamplingMask, SpecStats, WeightVersionSpan
from hotswap.weights.version import VersionLabels
from hotswap.wire import SampleResult


class OutputProcessor:
    """Stateless across requests: everything it keeps per sequence lives on the `Sequence`."""

    def __init__(self, detokenizer: Detokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.speculative = False  # outputs carry SpecStats
        self.labels = VersionLabels()  # the engine's: how versions are shown in spans

    def append(self, seq: Sequence, result: SampleResult, weight_version: int) -> None:
        """Appends the sampled token, records its logprobs and weight version, and sets `seq.finish_reason` when a
        stop condition is met (EOS, a stop token or string once `min_tokens` are out, max_tokens, the model's
        length). A stop string is cut from the text."""
        params = seq.request.params
        token = result.token_id
        seq.token_ids.append(token)
        if seq.matcher is not None:
            advance(seq.matcher, token)
        seq.record_version(weight_version)
        seq.cumulative_logprob += result.logprob
        if params.return_sampling_mask:
            seq.sampling_mask.append(result.kept)
        if params.logprobs is not None:
            entry = {token: Logprob(result.logprob, result.rank, self.detokenizer.token_text(token))}
            for rank, (tid, lp) in enumerate(
                zip(result.top_ids or [], result.top_logprobs or [], strict=False), start=1
            ):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self.detokenizer.token_text(tid))
            seq.logprobs.append(entry)
        num_out = seq.num_output_tokens
        new_chars = 0
        if params.stop_strings:  # text is kept current so only newly added characters are searched
            old_len = len(seq.text)
            seq.text = self.detokenizer.decode(seq.output_token_ids, params.skip_special_tokens)
            new_chars = len(seq.text) - old_len
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in (params.stop_token_ids or ()):
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if params.stop_strings and new_chars > 0:
                hit = find_stop(seq.text, params.stop_strings, new_chars)
                if hit is not None:
                    seq.finish_reason, seq.stop_reason = "stop", hit[0]
                    seq.text = seq.text[: hit[1] + (len(hit[0]) if params.include_stop_str_in_output else 0)]
                    return
        if (params.max_tokens is not None and num_out >= params.max_tokens) or len(seq) >= self.max_model_len:
            seq.finish_reason = "length"

    def prompt_logprobs(self, request: Request) -> list[dict[int, Logprob] | None] | None:
        """vLLM's shape: None for the first prompt token, then {token: Logprob} with the prompt token first and
        the top-k after it."""
        computed = request.prompt_logprobs
        if computed is None:
            return None
        text = self.detokenizer.token_text
        out: list[dict[int, Logprob] | None] = [None]
        for i, token in enumerate(request.prompt_token_ids[1:]):
            entry = {token: Logprob(computed.logprobs[i], computed.ranks[i], text(token))}
            if computed.top_ids:
                for rank, (tid, lp) in enumerate(zip(computed.top_ids[i], computed.top_logprobs[i], strict=True), 1):
                    entry.setdefault(tid, Logprob(lp, rank, text(tid)))
            out.append(entry)
        return out

    def output(self, request: Request) -> RequestOutput:
        """The request's output now: everything so far, or for output_kind 'delta' what is new since the last
        output (text held back while it may still change: a partial character or a possible stop string)."""
        params = request.params
        delta = params.output_kind == "delta"
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            text = seq.text if isinstance(seq.stop_reason, str) else None
            if text is None:
                text = self.detokenizer.decode(seq.output_token_ids, params.skip_special_tokens)
            tokens, logprobs = list(seq.output_token_ids), (seq.logprobs if params.logprobs is not None else None)
            masks = seq.sampling_mask if params.return_sampling_mask else None
            if delta:
                ready = len(text)
                if seq.finish_reason is None:
                    ready = len(text.rstrip("\ufffd"))
                    if params.stop_strings:
                        ready = max(min(ready, len(text) - max(map(len, params.stop_strings)) + 1), seq.streamed_text)
                text, seq.streamed_text = text[seq.streamed_text : ready], ready
                start, seq.streamed_tokens = seq.streamed_tokens, len(tokens)
                tokens = tokens[start:]
                logprobs = logprobs[start:] if logprobs is not None else None
                masks = masks[start:] if masks is not None else None
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=tokens,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    weight_versions=[
                        WeightVersionSpan(v, start, end, self.labels.label(v)) for v, start, end in seq.weight_versions
                    ],
                    spec_stats=SpecStats(seq.num_proposed, seq.num_accepted, seq.num_spec_steps)
                    if self.speculative
                    else None,
                    routed_experts=seq.routes.array(len(seq) - 1)
                    if seq.routes is not None and seq.finish_reason is not None
                    else None,
                    sampling_mask=SamplingMask.of(masks) if masks is not None else None,
                    lora_versions=[(v, start, end) for v, start, end in seq.lora_versions],
                )
            )
        return RequestOutput(
            prompt_logprobs=self.prompt_logprobs(request),
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            admission_weight_version=request.admission_weight_version,
            admission_weight_version_label=self.labels.label(request.admission_weight_version),
            lora_name=request.lora_name,
        )


def eos_token_ids(hf_config: dict[str, Any], tokenizer: Any, model_dir: str) -> set[int]:
    """EOS ids from config.json, generation_config.json (e.g. Llama 3's end-of-turn) and the tokenizer."""
    generation: dict[str, Any] = {}
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            generation = json.load(f)
    ids: set[int] = set()
    for value in (hf_config.get("eos_token_id"), generation.get("eos_token_id"), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids
