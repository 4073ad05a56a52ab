"""The per-step data the engine exchanges with its workers: plain, picklable for worker processes. The engine
owns these types; the model runner and the sampler consume them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SampleSpec:
    """How to sample one row of logits."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    sample_index: int = 0
    position: int = 0
    banned_token_ids: list[int] = field(default_factory=list)
    num_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # with a penalty: the sequence's tokens so far (prompt, then the first `len - num_prompt_tokens` outputs)
    seen_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    return_mask: bool = False  # report the token ids left to sample from (SampleResult.kept)
    # a grammar's allowed tokens, packed 32 to an int32 word (hotswap/engine/grammar.py); None: unconstrained
    allowed: torch.Tensor | None = None

    @property
    def adjusts(self) -> bool:
        """Whether its logits are biased or penalized before sampling."""
        return self.logit_bias is not None or self.seen_token_ids is not None


@dataclass
class PromptLogprobs:
    """For prompt tokens 1..L-1: each one's logprob given the tokens before it, its rank, and the top-k."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def extend(self, more: PromptLogprobs) -> None:
        """Appends the entries of the prompt's next chunk."""
        self.logprobs += more.logprobs
        self.ranks += more.ranks
        self.top_ids += more.top_ids
        self.top_logprobs += more.top_logprobs


@dataclass
class SampleResult:
    """The sampled token, its raw logprob and rank, and the top-k (ids, logprobs) when requested."""

    token_id: int
    logprob: float
    rank: int | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    # with SampleSpec.return_mask: the token ids the draw could pick (ascending), None when it could pick any
    # token of the vocabulary (greedy rows, and sampling that filtered nothing out)
    kept: list[int] | None = None


@dataclass
class PromptLogprobsAsk:
    """Sequence `seq` of a step wants the prompt logprobs of its first `len(targets)` query tokens' successors:
    the logprob of `targets[j]` after query token j (the last target may be the first token of the next chunk),
    its rank and the `top_k` most likely tokens (`top_k` = the vocabulary: every token, most likely first).

    `spec` None: the raw distribution (the log-softmax of the logits; vLLM's prompt logprobs). Otherwise the values
    `mode` (a `logprobs_mode`) reports of the distribution `spec` samples from: the logits divided by its
    temperature, then its min-p/top-k/top-p (filtered tokens -inf); see `sampler.prompt_logprobs_of`."""

    seq: int
    top_k: int
    targets: list[int]
    spec: SampleSpec | None = None
    mode: str = "raw_logprobs"


@dataclass
class Samples:
    """A step's result (not speculative): one SampleResult per sample row, and the prompt logprobs asked for,
    by sequence index in the step."""

    samples: list[SampleResult]
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    # sequence index in the step -> its query tokens' routed experts, [query tokens, sparse layers, top_k]
    # (numpy, the smallest integer dtype for the expert count), for the sequences in ModelInput.route_seqs
    routes: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass
class SpecInput:
    """A speculative decode step. Sequence i (one query token, its last, at position context_lens[i] - 1) may
    have up to `num_spec[i]` tokens proposed and verified; `specs[i]` samples each of its num_spec[i] + 1 output
    positions. `proposals` (prompt lookup) are given by the engine; otherwise the draft model proposes, first
    catching up on `draft_tokens[i]`, the tokens from `draft_starts[i]` on that its KV cache lacks (it lags the
    target by one token after a step that accepted every proposal)."""

    num_spec: list[int]
    specs: list[list[SampleSpec]]
    proposals: list[list[int]] | None = None
    draft_tokens: list[list[int]] | None = None
    draft_starts: list[int] | None = None


@dataclass
class SpecOutput:
    """Per sequence of a speculative step: the tokens it emits (accepted proposals, then the target's own) and
    how many were proposed."""

    tokens: list[list[SampleResult]]
    num_proposed: list[int]
    routes: dict[int, np.ndarray] = field(default_factory=dict)  # as Samples.routes, over each verified token


@dataclass
class ModelInput:
    """A flat batch. Sequence i contributes `query_lens[i]` tokens of `input_ids`/`positions`, has
    `context_lens[i]` tokens in total and its KV in `block_tables[i]`. `sample_rows[j]` is the sequence whose
    last-token logits sample row j, following `sample_specs[j]`. `block_copies` run before the forward pass.
    `spec`: a speculative decode step (see SpecInput). `draft_prefill`: the draft model computes its KV for the
    same tokens (a prefill with a draft model). `prompt_logprobs`: the prompt logprobs asked for (see
    PromptLogprobsAsk). `route_seqs`: the sequences whose routed experts come back (Samples.routes).
    `forced_routes`: [len(input_ids), sparse layers, top_k] int64 global expert ids (torch), -1 in a row's first
    column where the router chooses (see hotswap/model/routing.py); None when no token is forced. `lora_rows`:
    (adapter uid, first, end) flat token rows that run with that LoRA adapter version (hotswap/lora)."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    sample_specs: list[SampleSpec]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    spec: SpecInput | None = None
    draft_prefill: bool = False
    prompt_logprobs: list[PromptLogprobsAsk] = field(default_factory=list)
    route_seqs: list[int] = field(default_factory=list)
    forced_routes: torch.Tensor | None = None
    lora_rows: list[tuple[int, int, int]] = field(default_factory=list)


ModelOutput = Samples | SpecOutput
