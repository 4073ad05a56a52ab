"""What generation returns, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hotswap.wire import PromptLogprobs


@dataclass
class Logprob:
    """A token's log-probability under the model's raw distribution, its rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens [start_token, end_token) were produced by weight version `version` (the integer that orders
    versions), shown to clients as `label` (the label given to that version, else the integer as a string; not
    part of equality: a version is its integer)."""

    version: int
    start_token: int
    end_token: int
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", str(self.version))


@dataclass
class SpecStats:
    """Speculation's effect on one completion (or the engine): tokens proposed, tokens the target accepted, and
    verification steps. `acceptance_rate` = accepted / proposed; `mean_accepted_length` = tokens emitted per
    step (accepted + the target's own), 1.0 without speculation."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0


# One dict per generated token: token id -> Logprob (the sampled token plus the requested top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class SamplingMask:
    """Per generated token, the token ids sampling could pick (vLLM's CSR shape): token i's are
    `token_ids[offsets[i]:offsets[i + 1]]`, ascending. `full[i]` marks a token drawn from the whole vocabulary
    (greedy, or sampling that filtered nothing out): its span is empty, meaning every token."""

    token_ids: list[int]
    offsets: list[int]
    full: list[bool]

    @staticmethod
    def of(rows: list[list[int] | None]) -> SamplingMask:
        """From one entry per token: the kept ids, or None for the whole vocabulary."""
        ids: list[int] = []
        offsets = [0]
        for row in rows:
            ids += row or []
            offsets.append(len(ids))
        return SamplingMask(ids, offsets, [row is None for row in rows])

    def row(self, i: int) -> list[int] | None:
        """Token i's kept ids; None for the whole vocabulary."""
        return None if self.full[i] else self.token_ids[self.offsets[i] : self.offsets[i + 1]]


@dataclass
class CompletionOutput:
    """One sampled completion of a request. `finish_reason` is 'stop', 'length', 'abort' or None while running;
    `stop_reason` is the stop string or token id that ended it, None for EOS or length. `weight_versions` are
    spans over `token_ids` (over the whole output, also in a delta) naming the weight version of each token.
    `spec_stats`: with speculative decoding on, the proposals and acceptances behind it. `routed_experts`
    (return_routed_experts, once finished): [prompt + output tokens - 1, sparse layers, top_k] global expert ids
    (numpy, uint8 up to 256 experts, else int16), row p for the pass over token p. `sampling_mask`
    (return_sampling_mask): per output token (of this delta, when streaming deltas), what sampling could pick.
    `lora_versions`: with a LoRA adapter, [version, start, end) spans over `token_ids` naming the adapter version
    of each token."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    spec_stats: SpecStats | None = None  # with speculative decoding on
    routed_experts: np.ndarray | None = None  # [tokens, sparse layers, top_k] (see SamplingParams)
    sampling_mask: SamplingMask | None = None
    lora_versions: list[tuple[int, int, int]] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    admission_weight_version: int = 0
    admission_weight_version_label: str = ""  # the label of admission_weight_version ("" before it is known)
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which has no context)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_name: str | None = None  # the LoRA adapter it ran with


@dataclass
class TokenScores:
    """One sequence scored without generating (`LLM.score_tokens`): for each of its tokens 1..L-1, given the tokens
    before it, under the distribution asked (log_softmax(logits / T) after the filters): `logprobs` [L-1] float32
    its logprob, `ranks` [L-1] int32 its rank (1 = most likely; 1 + the number of tokens more likely), and the K
    most likely tokens, most likely first: `top_ids` [L-1, K] int32 and `top_logprobs` [L-1, K] float32 (K the
    top_logprobs asked, the vocabulary for -1; [L-1, 0] for 0). Values are the engine's float32 bits. Row i is the
    distribution after token i, about token i + 1 (vLLM's prompt_logprobs without the leading None).
    `weight_version` (and its `weight_version_label`): the weights that scored it."""

    token_ids: list[int]
    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    weight_version: int = 0
    weight_version_label: str = ""

    @staticmethod
    def of(token_ids: list[int], scored: PromptLogprobs, k: int, version: int = 0, label: str = "") -> TokenScores:
        """From the worker's prompt logprobs of `token_ids` with `k` top entries per position."""
        rows = len(token_ids) - 1
        return TokenScores(
            token_ids,
            np.asarray(scored.logprobs, dtype=np.float32).reshape(rows),
            np.asarray(scored.ranks, dtype=np.int32).reshape(rows),
            np.asarray(scored.top_ids, dtype=np.int32).reshape(rows, k),
            np.asarray(scored.top_logprobs, dtype=np.float32).reshape(rows, k),
            version,
            label or str(version),
        )
