"""Continuous batching: each step is either a prefill batch (new or preempted sequences) or a decode batch.

Prefills are admitted in arrival order while `max_num_seqs`, `max_num_batched_tokens` and free KV blocks allow.
When a running sequence cannot get a block to decode, the most recently admitted running sequence is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hotswap.config import SchedulerConfig
from hotswap.engine.block_manager import BlockManager
from hotswap.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    is_prefill: bool
    block_copies: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.admit_new = True  # False while pausing in 'wait' mode: only sequences already in flight run
        # positions beyond its last token a decoding sequence needs slots for (speculative tokens to verify)
        self.lookahead: Callable[[Sequence], int] = lambda seq: 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput | None:
        """The next batch, or None when nothing can run."""
        scheduled: list[Sequence] = []
        num_tokens = 0
        assert self.config.max_num_batched_tokens is not None
        while self.waiting:
            seq = self.waiting[0]
            if not self.admit_new and not seq.started:
                break
            # A request with n > 1 forks its siblings after this prefill; they count against max_num_seqs.
            if self.running and len(self.running) + seq.request.width > self.config.max_num_seqs:
                break
            if num_tokens + len(seq) > self.config.max_num_batched_tokens and scheduled:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
            num_tokens += len(seq) - seq.num_computed_tokens
        if scheduled:
            return SchedulerOutput(scheduled, True, self.block_manager.take_copies())

        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            lookahead = self.lookahead(seq)
            while not self.block_manager.can_append(seq, lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append_slot(seq, lookahead)
                scheduled.append(seq)
        if not scheduled:
            return None
        return SchedulerOutput(scheduled, False, self.block_manager.take_copies())

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_draft_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def preempt_all(self) -> None:
        """Sends every running sequence back to be recomputed (its KV is dropped)."""
        for seq in reversed(list(self.running)):
            self._preempt(seq)

    def num_in_flight(self) -> int:
        """Sequences that have started generating, running or preempted."""
        return len(self.running) + sum(1 for s in self.waiting if s.started)

    def add_running(self, seq: Sequence) -> None:
        """Adds a forked sequence that already shares its parent's blocks."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes `seq` out of the queues (whatever its state) and frees its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.FINISHED

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
