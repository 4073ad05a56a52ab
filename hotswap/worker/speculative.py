"""A speculative decode step inside the worker: the draft proposes (or the engine's prompt lookup did), the target
verifies every proposal in one forward pass, and rank 0 decides what is accepted (see rejection_sampler).

The draft has its own paged KV cache, indexed by the target's block tables (same block size and count), so the
engine's block accounting, copy-on-write and prefix caching cover both. Every rank runs the same passes: the
draft's proposals are broadcast from rank 0 after each pass, so a sharded draft's collectives and the target's
verification see the same tokens everywhere.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import torch

from hotswap.distributed import ParallelContext
from hotswap.model.layers.rejection_sampler import propose, verify
from hotswap.wire import ModelInput, SpecInput, SpecOutput
from hotswap.worker.model_runner import ModelRunner


class SpeculativeStep:
    def __init__(
        self,
        target: ModelRunner,
        draft: ModelRunner | None,
        draft_scope: Callable[[], contextlib.AbstractContextManager[object]],
        parallel: ParallelContext,
    ) -> None:
        self.target = target
        self.draft = draft
        self.draft_scope = draft_scope
        self.parallel = parallel

    def prefill_draft(self, mi: ModelInput) -> None:
        """The draft computes its KV for a prefill batch's tokens (no logits; the block copies ran already)."""
        assert self.draft is not None
        with self.draft_scope():
            self.draft.forward(mi.input_ids, mi.positions, mi.query_lens, mi.context_lens, mi.block_tables, None)

    def run(self, mi: ModelInput) -> SpecOutput:
        spec = mi.spec
        assert spec is not None and all(q == 1 for q in mi.query_lens), "a speculative step decodes one token each"
        self.target.copy_blocks(mi.block_copies)
        draft_probs: list[torch.Tensor | None]
        if spec.proposals is not None:
            proposals = [list(p) for p in spec.proposals]
            draft_probs = [None] * len(proposals)
        else:
            proposals, draft_probs = self._draft_proposals(mi, spec)
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        for last, length, props in zip(mi.input_ids, mi.context_lens, proposals, strict=True):
            tokens = [last, *props]
            input_ids += tokens
            positions += range(length - 1, length - 1 + len(tokens))
            query_lens.append(len(tokens))
            context_lens.append(length - 1 + len(tokens))
        rows = list(range(len(input_ids)))
        step_routes = self.target.route_step(mi.route_seqs)  # decodes: past any forced prompt row
        logits = self.target.forward(input_ids, positions, query_lens, context_lens, mi.block_tables, rows, step_routes)
        routes = self.target.recorded(step_routes, mi.route_seqs, query_lens)
        assert logits is not None
        if self.parallel.rank != 0:
            return SpecOutput([], [])
        mode, deterministic = self.target.config.model_config.logprobs_mode, self.target.deterministic
        verified = verify(logits, proposals, draft_probs, spec.specs, mode, deterministic)
        return SpecOutput(verified, [len(p) for p in proposals], routes)

    def _draft_proposals(self, mi: ModelInput, spec: SpecInput) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Runs the draft: one pass over each sequence's catch-up tokens, then one pass per further proposal, for
        the sequences that still propose."""
        assert self.draft is not None and spec.draft_tokens is not None and spec.draft_starts is not None
        n = len(mi.context_lens)
        proposals: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        with self.draft_scope():
            self.draft.copy_blocks(mi.block_copies)
            input_ids = [t for tokens in spec.draft_tokens for t in tokens]
            positions = [
                p for s, length in zip(spec.draft_starts, mi.context_lens, strict=True) for p in range(s, length)
            ]
            query_lens = [len(tokens) for tokens in spec.draft_tokens]
            active = [i for i in range(n) if spec.num_spec[i] > 0]
            ends = list(itertools.accumulate(query_lens))
            rows = [ends[i] - 1 for i in active]
            logits = self.draft.forward(input_ids, positions, query_lens, mi.context_lens, mi.block_tables, rows)
            for j in range(max(spec.num_spec, default=0)):
                if j > 0:
                    active = [i for i in active if spec.num_spec[i] > j]
                    if not active:
                        break
                    logits = self.draft.forward(
                        [proposals[i][-1] for i in active],
                        [mi.context_lens[i] - 1 + j for i in active],
                        [1] * len(active),
                        [mi.context_lens[i] + j for i in active],
                        [mi.block_tables[i] for i in active],
                        list(range(len(active))),
                    )
                assert logits is not None
                drawn: list[int] | None = None
                q = None
                if self.parallel.rank == 0:
                    drawn, q = propose(logits, [spec.specs[i][j] for i in active])
                tokens = broadcast_ids(self.parallel, drawn, len(active))
                for row, i in enumerate(active):
                    proposals[i].append(tokens[row])
                    if q is not None:
                        probs[i].append(q[row])
        # a sampled sequence has q at every proposal (each pass it is in draws from q); greedy ones need none
        draft_probs: list[torch.Tensor | None] = [
            torch.stack(p) if p and len(p) == len(proposals[i]) else None for i, p in enumerate(probs)
        ]
        return proposals, draft_probs


def broadcast_ids(parallel: ParallelContext, ids: list[int] | None, count: int) -> list[int]:
    """Rank 0's `ids` (`count` token ids; None on the other ranks) on every rank. They travel in a host tensor: the
    ids are host values already, and the tensor-parallel group is gloo's (host memory); one rank sends nothing."""
    tokens = torch.zeros(count, dtype=torch.long) if ids is None else torch.tensor(ids, dtype=torch.long)
    return [int(t) for t in parallel.broadcast(tokens).tolist()]
