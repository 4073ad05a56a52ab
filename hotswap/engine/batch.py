"""From a scheduled step to the workers' `ModelInput`: the flat tokens, positions and block tables, how each sampled
row is drawn (`SampleSpec`), the prompt logprobs asked for, the routes to record or force, the LoRA rows, and a
speculative step's proposals."""

from __future__ import annotations

import numpy as np
import torch

from hotswap.config import EngineConfig
from hotswap.engine.grammar import Grammars
from hotswap.engine.scheduler import SchedulerOutput
from hotswap.engine.sequence import Sequence
from hotswap.engine.speculator import Speculator
from hotswap.sampling_params import SamplingParams
from hotswap.wire import ModelInput, PromptLogprobsAsk, SampleSpec, SpecInput


def num_logprobs(value: int | None, vocab: int) -> int | None:
    """A logprobs count as the workers take it: -1 (vLLM's "the whole vocabulary") as the vocabulary size."""
    return vocab if value == -1 else value


class BatchBuilder:
    """Builds the input of a step. Holds no state between steps: everything comes from the sequences."""

    def __init__(
        self,
        config: EngineConfig,
        grammars: Grammars,
        eos_token_ids: set[int],
        routing_shape: tuple[int, int, int] | None,
        speculator: Speculator | None,
    ) -> None:
        self.config = config
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids  # the engine's set (shared, not copied)
        self.routing_shape = routing_shape  # (sparse layers, top_k, experts) of a mixture-of-experts model
        self.speculator = speculator
        self.vocab = int(config.model_config.hf_config["vocab_size"])

    def _num_logprobs(self, value: int | None) -> int | None:
        """`num_logprobs` under this model's vocabulary."""
        return num_logprobs(value, self.vocab)

    def build(self, batch: SchedulerOutput, speculating: bool) -> ModelInput:
        """Sequence i runs its tokens num_computed_tokens .. + num_tokens[i]; it samples (all n first tokens before
        its request forked) when they reach its last token. `speculating`: this step speculates (a decode step
        verifies proposals; with a draft model, a prefill step feeds the draft too)."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        specs: list[SampleSpec] = []
        prompt_logprobs: list[PromptLogprobsAsk] = []
        route_seqs: list[int] = []
        forced: list[tuple[int, np.ndarray, int, int]] = []  # (flat offset, forced rows, first, last position)
        lora_rows: list[tuple[int, int, int]] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if seq.request.lora is not None:
                lora_rows.append((seq.request.lora.uid, len(input_ids), len(input_ids) + n))
            if seq.routes is not None:
                route_seqs.append(i)
            rows = seq.request.params.forced_routed_experts
            if rows is not None and start < len(rows):
                forced.append((len(input_ids), rows, start, min(end, len(rows))))
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            if end == len(seq):
                for index in seq.request.sample_indices(seq):
                    sample_rows.append(i)
                    specs.append(self.sample_spec(seq, index))
            request = seq.request
            if request.needs_prompt_logprobs and seq.index == 0 and start < seq.num_prompt_tokens:
                # the prompt runs from its start (no prefix-cache hit), chunk after chunk, each asking once
                assert request.num_prompt_logprobs() == start, "prompt logprobs cover the chunks before this one"
                targets = seq.token_ids[start + 1 : min(end + 1, seq.num_prompt_tokens)]
                spec, mode = self._prompt_processing(request.params)
                top = self._num_logprobs(request.params.prompt_logprobs) or 0
                prompt_logprobs.append(PromptLogprobsAsk(i, top, targets, spec, mode))
        drafting = speculating and self.config.speculative_config.uses_draft
        return ModelInput(
            input_ids,
            positions,
            query_lens,
            context_lens,
            [s.block_table for s in batch.seqs],
            sample_rows,
            specs,
            batch.block_copies,
            spec=self._spec_input(batch) if speculating and not batch.is_prefill else None,
            draft_prefill=drafting and batch.is_prefill,
            prompt_logprobs=prompt_logprobs,
            route_seqs=route_seqs,
            forced_routes=self._forced_tensor(forced, len(input_ids)) if forced else None,
            lora_rows=lora_rows,
        )

    def _forced_tensor(self, forced: list[tuple[int, np.ndarray, int, int]], num_tokens: int) -> torch.Tensor:
        """ModelInput.forced_routes for a step's flat tokens: the given rows where a sequence forces them, -1
        elsewhere."""
        assert self.routing_shape is not None
        layers, top_k, _ = self.routing_shape
        out = torch.full((num_tokens, layers, top_k), -1, dtype=torch.long)
        for offset, rows, first, last in forced:
            out[offset : offset + last - first] = torch.from_numpy(rows[first:last])
        return out

    def _spec_input(self, batch: SchedulerOutput) -> SpecInput:
        assert self.speculator is not None
        ngram = not self.speculator.uses_draft
        proposals = [self.speculator.proposals(seq) for seq in batch.seqs] if ngram else None
        num_spec = (
            [len(p) for p in proposals]
            if proposals is not None
            else [self.speculator.num_speculative(seq) for seq in batch.seqs]
        )
        return SpecInput(
            num_spec=num_spec,
            specs=[
                [self.sample_spec(seq, seq.index, j) for j in range(k + 1)]
                for seq, k in zip(batch.seqs, num_spec, strict=True)
            ],
            proposals=proposals,
            draft_tokens=None if ngram else [seq.token_ids[seq.num_draft_computed :] for seq in batch.seqs],
            draft_starts=None if ngram else [seq.num_draft_computed for seq in batch.seqs],
        )

    def _prompt_processing(self, params: SamplingParams) -> tuple[SampleSpec | None, str]:
        """How a request's prompt logprobs are computed (PromptLogprobsAsk's `spec` and `mode`): under a raw
        `logprobs_mode` the raw log-softmax (vLLM's prompt logprobs); under "processed_logprobs" /
        "processed_logits" the distribution its sampled tokens are drawn from at a prompt position: the logits
        divided by its temperature, then its min-p/top-k/top-p (logit bias, penalties and min_tokens depend on the
        output and apply to sampled tokens only)."""
        mode = self.config.model_config.logprobs_mode
        if mode.startswith("raw"):
            return None, "raw_logprobs"
        spec = SampleSpec(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
        return spec, mode

    def sample_spec(self, seq: Sequence, index: int, ahead: int = 0) -> SampleSpec:
        """How to sample `seq`'s next token, or (speculation) the one `ahead` positions after it."""
        p = seq.request.params
        banned: list[int] = []
        if seq.num_output_tokens + ahead < p.min_tokens:
            banned = sorted(set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(self.eos_token_ids)))
        return SampleSpec(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            seed=p.seed,
            sample_index=index,
            position=seq.num_output_tokens + ahead,
            banned_token_ids=banned,
            num_logprobs=self._num_logprobs(p.logprobs),
            logit_bias=p.logit_bias,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            seen_token_ids=seq.token_ids if p.penalized else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            return_mask=p.return_sampling_mask,
            allowed=self.grammars.mask(seq.matcher) if seq.matcher is not None else None,
        )
