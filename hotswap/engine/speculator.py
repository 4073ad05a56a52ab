"""The engine's side of speculative decoding: how many tokens each sequence may speculate, prompt-lookup
proposals, the draft-staleness policy, and acceptance statistics. The worker's side (the draft's passes, the
target's verification) is hotswap/worker/speculative.py.

KV bookkeeping. A verification pass writes the target's KV for the last token and every proposal; after it, the
KV of the accepted ones is valid, so `num_computed_tokens` stays "every token but the last". The draft's KV
(draft_model method) is written for the tokens its passes saw: up to the last proposal but one, so after a step
that accepted every proposal it lacks one token, which its next step catches up on. `num_draft_computed` tracks
it; prefix-cache blocks are registered only where both caches are valid.
"""

from __future__ import annotations

import logging
from typing import cast

import numpy as np

from hotswap.config import SpeculativeConfig
from hotswap.engine.sequence import Sequence
from hotswap.outputs import SpecStats

logger = logging.getLogger("hotswap.speculative")


def lookup(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Prompt lookup: for n from `hi` down to `lo`, the last n tokens are searched earlier in `tokens`; at the
    latest earlier match, up to `k` tokens that followed it are proposed. [] without a match."""
    if k <= 0 or len(tokens) < lo + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every earlier n-gram start
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return cast("list[int]", arr[start : start + k].tolist())
    return []


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self._warned_version: int | None = None

    @property
    def uses_draft(self) -> bool:
        return self.config.uses_draft

    def active(self, stale: bool, version: int) -> bool:
        """Whether to speculate this step. A stale draft (the target was updated after it) follows
        `draft_staleness`: "disable" stops speculating, "warn" logs once per target version and goes on."""
        if not self.config.enabled:
            return False
        if stale and self.config.draft_staleness == "disable":
            return False
        if stale and self.config.draft_staleness == "warn" and self._warned_version != version:
            self._warned_version = version
            logger.warning(
                "the speculative draft is stale: the target was updated (weight version %s) and the draft was "
                "not; outputs stay exact, acceptance drops. Update it with reload_weights(target='draft') or a "
                "session started with target='all'",
                version,
            )
        return True

    def num_speculative(self, seq: Sequence) -> int:
        """How many tokens `seq` may have proposed now: k, fewer near max_tokens or the model's length (the step
        emits at most that many plus one)."""
        params = seq.request.params
        if params.penalized or params.structured_outputs is not None:
            return 0  # its distribution (penalties, grammar mask) at a proposal's position would depend on the
            # proposals before it
        k = self.config.num_speculative_tokens
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(k, self.max_model_len - len(seq) - 1))

    def proposals(self, seq: Sequence) -> list[int]:
        """Prompt-lookup proposals for `seq` (ngram method)."""
        c = self.config
        return lookup(seq.token_ids, c.prompt_lookup_min, c.prompt_lookup_max, self.num_speculative(seq))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        seq.num_proposed += proposed
        seq.num_accepted += accepted
        seq.num_spec_steps += 1
        self.stats.num_draft_tokens += proposed
        self.stats.num_accepted_tokens += accepted
        self.stats.num_steps += 1
