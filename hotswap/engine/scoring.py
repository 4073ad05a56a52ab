"""Scoring token sequences without generating: teacher scoring (`LLMEngine.score_tokens`) and the post-update
canary's probes (`LLMEngine.score_probes`). A scoring pass is one forward pass over whole sequences asking their
prompt logprobs, through KV blocks taken from the free ones and given back; nothing enters the prefix cache, and
the requests in flight (and the step loop's state) are untouched, so it runs between two steps."""

from __future__ import annotations

import math

from hotswap.config import EngineConfig
from hotswap.engine.batch import BatchBuilder
from hotswap.engine.block_manager import BlockManager
from hotswap.engine.scheduler import SchedulerOutput
from hotswap.engine.sequence import Request, Sequence
from hotswap.executor.base import Executor
from hotswap.outputs import TokenScores
from hotswap.sampling_params import SamplingParams
from hotswap.wire import PromptLogprobs, Samples, SampleSpec

# what a scored sequence's request carries: its one sampled token (greedy, never drawn from the process's generator)
# is dropped; prompt_logprobs makes it ask its prompt logprobs (PromptLogprobsAsk set by `Scorer.run`)
_SCORE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)


class Scorer:
    """Runs scoring passes on the engine's workers, with its batch builder."""

    def __init__(self, config: EngineConfig, executor: Executor, builder: BatchBuilder) -> None:
        self.config = config
        self.executor = executor
        self.builder = builder

    def blocks_for(self, sequences: list[list[int]]) -> int:
        """KV blocks `sequences` take, each in blocks of its own."""
        size = self.config.cache_config.block_size
        return sum(-(-len(ids) // size) for ids in sequences)

    def probes(self, block_manager: BlockManager, probes: list[list[int]]) -> list[list[float]]:
        """Each probe's raw logprobs of its tokens 1.., in one pass. Raises RuntimeError when the free KV cache
        cannot hold the probes."""
        if self.blocks_for(probes) > block_manager.num_free_blocks:
            raise RuntimeError(
                "the free KV cache cannot hold the canary probes (requests held by a 'keep' pause "
                "occupy it); use shorter probes or pause with clear_cache"
            )
        return [scored.logprobs for scored in self.run(block_manager, probes, 0, None, "raw_logprobs")]

    def score_tokens(
        self,
        block_manager: BlockManager,
        sequences: list[list[int]],
        temperature: float,
        top_logprobs: int,
        top_k: int,
        top_p: float,
        min_p: float,
        *,
        problem: str | None,
        version: int,
        label: str,
    ) -> list[TokenScores]:
        """Teacher scoring: for each token sequence, the logprob of each of its tokens 1.. given the tokens
        before it under log_softmax(logits / temperature) after min-p/top-k/top-p (a filtered token's logprob is
        -inf), its rank, and the `top_logprobs` most likely tokens per position (-1: the whole vocabulary), without
        generating; each result carries the served weights' `version` and its `label`. Whatever the engine's
        `logprobs_mode`, these are the processed distribution's logprobs (at temperature 1 without filters: the raw
        ones); in deterministic mode the same bits as `hotswap.train.token_logprobs(model, ids,
        temperature=temperature)` and `sequence_logprobs`.

        The sequences run in as few forward passes as the free KV cache and `max_num_batched_tokens` allow,
        through blocks given back afterwards (no prefix cache either way), between steps. Raises ValueError for
        bad input (no sequence, an empty one, one longer than max_model_len, token ids outside the vocabulary,
        top_logprobs above max_logprobs, a temperature that is not positive, bad filters), then RuntimeError when
        the weights cannot score now (`problem`: why, e.g. a weight update open, asleep, invalid weights) or the
        free KV cache cannot hold one sequence; the engine is unchanged by any of these."""
        vocab = int(self.config.model_config.hf_config["vocab_size"])
        k = self.check(sequences, temperature, top_logprobs, top_k, top_p, min_p, vocab)
        if problem is not None:
            raise RuntimeError(f"cannot score now: {problem}")
        spec = SampleSpec(temperature=float(temperature), top_k=top_k, top_p=float(top_p), min_p=float(min_p))
        budget = self.config.scheduler_config.max_num_batched_tokens or len(max(sequences, key=len))
        free = block_manager.num_free_blocks  # the same before every pass: each gives its blocks back
        groups: list[list[list[int]]] = []  # one forward pass each: within the token budget and the free blocks
        for ids in sequences:
            last = groups[-1] if groups else None
            if last and sum(map(len, last)) + len(ids) <= budget and self.blocks_for([*last, ids]) <= free:
                last.append(ids)
            else:
                groups.append([ids])
        results: list[PromptLogprobs] = []
        for group in groups:
            if self.blocks_for(group) > free:
                raise RuntimeError(
                    f"the free KV cache cannot hold a sequence of {len(group[0])} tokens (requests "
                    "in flight or held by a 'keep' pause occupy it); score it when they finished"
                )
            results += self.run(block_manager, group, k, spec, "processed_logprobs")
        return [
            TokenScores.of(list(ids), scored, k, version, label) for ids, scored in zip(sequences, results, strict=True)
        ]

    def run(
        self, block_manager: BlockManager, sequences: list[list[int]], top_k: int, spec: SampleSpec | None, mode: str
    ) -> list[PromptLogprobs]:
        """One forward pass over `sequences` (each of at least one token; their blocks must be free) asking each
        one's prompt logprobs as PromptLogprobsAsk(top_k, spec, mode) says; blocks taken from the free ones and
        given back, nothing cached. Its sampled tokens (greedy) are dropped."""
        seqs = []
        for i, ids in enumerate(sequences):
            request = Request(f"score-{i}", None, list(ids), _SCORE_PARAMS)
            seq = Sequence(request, 0, ids)
            request.seqs.append(seq)
            seqs.append(seq)
        taken: list[Sequence] = []
        try:
            for seq in seqs:
                block_manager.allocate(seq)
                taken.append(seq)
            batch = SchedulerOutput(seqs, [len(s) for s in seqs], True)  # pending copies stay for the next step
            model_input = self.builder.build(batch, speculating=False)
            for ask in model_input.prompt_logprobs:
                ask.top_k, ask.spec, ask.mode = top_k, spec, mode
            results = self.executor.collective_rpc("execute_model", (model_input,))[0]
        finally:
            for seq in taken:
                block_manager.free_seq(seq)
        assert isinstance(results, Samples)
        return [results.prompt_logprobs[i] for i in range(len(seqs))]

    def check(
        self,
        sequences: list[list[int]],
        temperature: float,
        top_logprobs: int,
        top_k: int,
        top_p: float,
        min_p: float,
        vocab: int,
    ) -> int:
        """Raises ValueError naming what is wrong with a `score_tokens` call, whatever the types its caller was
        given (a client's JSON); returns its top-k count (-1 resolved to the vocabulary)."""
        if not isinstance(sequences, list) or not sequences:
            raise ValueError("give at least one token sequence (a list of lists of token ids)")
        max_len = self.config.model_config.max_model_len
        assert max_len is not None
        for i, ids in enumerate(sequences):
            if not isinstance(ids, list) or not ids:
                raise ValueError(f"sequence {i} is empty or not a list of token ids")
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError(f"sequence {i} holds values that are not integer token ids")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"sequence {i} has token ids out of range [0, {vocab}): {bad[:10]}")
            if len(ids) > max_len:
                raise ValueError(f"sequence {i} has {len(ids)} tokens; max_model_len={max_len}")
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not (math.isfinite(temperature) and temperature > 0)
        ):
            raise ValueError(f"temperature must be a positive number, got {temperature!r}")
        SamplingParams(temperature=float(temperature), top_k=top_k, top_p=top_p, min_p=min_p)  # checks the filters
        if top_k > vocab:
            raise ValueError(f"top_k={top_k} exceeds the vocabulary size {vocab} (use -1 to disable top-k)")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < -1:
            raise ValueError(f"top_logprobs must be an integer >= -1 (-1: the whole vocabulary), got {top_logprobs!r}")
        k = vocab if top_logprobs == -1 else top_logprobs
        limit = self.config.model_config.max_logprobs
        if k > (vocab if limit == -1 else min(limit, vocab)):
            raise ValueError(
                f"top_logprobs={top_logprobs} exceeds max_logprobs={limit} (vocabulary: {vocab}); raise "
                "it with LLM(max_logprobs=...) or --max-logprobs (-1: the whole vocabulary)"
            )
        return k
