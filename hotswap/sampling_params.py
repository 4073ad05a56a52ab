"""Per-request sampling settings with vLLM's field names and semantics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hotswap.structured_outputs import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to sample one request.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1 and min_p 0 disable those filters.
    `seed` makes the request reproducible whatever else is batched with it. `stop` strings end generation and
    are cut from the text; `stop_token_ids` end it too (the token is kept in token_ids). EOS ends generation
    unless `ignore_eos`. `min_tokens` suppresses EOS and stop tokens/strings until that many tokens exist.
    `logprobs` k returns the sampled token's logprob plus the top-k; `prompt_logprobs` k returns, for every prompt
    token after the first, its logprob under the model given the tokens before it, plus the top-k (such a request
    does not reuse the prefix cache, whose positions are never computed); -1 for either is the whole vocabulary
    (vLLM's), within the engine's `max_logprobs`. `repetition_penalty` (> 0, 1 off) divides positive and
    multiplies negative logits of every token in the prompt or output; `presence_penalty` and `frequency_penalty`
    ([-2, 2]) subtract per output token seen, once and per occurrence; `logit_bias` maps token ids to values added
    to their logits ([-100, 100]). `include_stop_str_in_output` keeps a matched stop string in the text. Logprobs
    are of the raw distribution, before these, unless the engine's `logprobs_mode` is a processed one (then
    sampled and prompt logprobs are those of the distribution sampled from: docs/teacher-scoring.md).
    `output_kind` says what a streaming consumer gets after each step: the whole output so far ("cumulative"),
    only what is new ("delta"), or nothing until it finishes ("final_only").

    Replay (mixture-of-experts models; see docs/replay.md): `return_routed_experts` returns each token's top-k
    experts per sparse layer (`CompletionOutput.routed_experts`); `forced_routed_experts` ([rows, sparse layers,
    top_k] global expert ids, one row per prompt token from the first, at most one per prompt token) makes the model
    use those experts for those tokens instead of its router's choice (the router's probabilities of the forced
    experts weight them, renormalized where the model renormalizes its top-k). `return_sampling_mask` returns, per
    generated token, the token ids that top-k / top-p / min-p (and banned tokens) left to sample from
    (`CompletionOutput.sampling_mask`).

    `on_weight_update`: what the request does with its KV cache when new weights are committed while it runs:
    "keep" (it goes on with the KV computed so far; its version spans show where the weights changed) or
    "recompute" (its KV is computed again on the new weights, prompt and output so far, in chunks that share steps
    with decoding); None takes the engine's `on_weight_update` (default "keep").

    `structured_outputs` (a `StructuredOutputsParams` or a dict of its fields) constrains the output to a JSON
    schema, regex, choice or grammar (hotswap/engine/grammar.py). Invalid values raise ValueError naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: str = "cumulative"
    return_routed_experts: bool = False
    forced_routed_experts: Any = None
    return_sampling_mask: bool = False
    on_weight_update: str | None = None
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    _stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.on_weight_update not in (None, "keep", "recompute"):
            raise ValueError(f"on_weight_update must be 'keep' or 'recompute', got {self.on_weight_update!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < -1):
                raise ValueError(f"{name} must be an integer >= 0, -1 (the whole vocabulary) or None, got {value!r}")
        for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not (math.isfinite(rp) and rp > 0):
            raise ValueError(f"repetition_penalty must be a positive number, got {rp!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)  # JSON object keys arrive as strings
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
                if (
                    token < 0
                    or isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not -100 <= value <= 100
                ):
                    raise ValueError(f"logit_bias[{key!r}] must be a number in [-100, 100] for a token id >= 0")
                bias[token] = float(value)
            self.logit_bias = bias or None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        self._stop_list = stop
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        for name in ("return_routed_experts", "return_sampling_mask"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.forced_routed_experts is not None:
            self.forced_routed_experts = forced_routes_array(self.forced_routed_experts)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            raise ValueError(f"output_kind must be 'cumulative', 'delta' or 'final_only', got {self.output_kind!r}")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def grammar(self) -> StructuredOutputsParams | None:
        """The structured output asked for (always the parsed form after construction)."""
        assert not isinstance(self.structured_outputs, dict)
        return self.structured_outputs

    @property
    def penalized(self) -> bool:
        """Whether logits depend on the tokens so far (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def forced_routes_array(value: object) -> np.ndarray:
    """`forced_routed_experts` as an int64 array [rows, layers, top_k] (from nested lists or an array). Raises
    ValueError for another shape or non-integers; the engine checks the sizes against the model."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"forced_routed_experts must be an integer array [tokens, layers, top_k]: {err}") from None
    if array.ndim != 3 or 0 in array.shape:
        raise ValueError(
            f"forced_routed_experts must be an integer array [tokens, layers, top_k], got shape {list(array.shape)}"
        )
    if array.dtype.kind not in "iu":
        raise ValueError(f"forced_routed_experts must hold integer expert ids, got {array.dtype}")
    return array.astype(np.int64)
