"""Continuous batching, with prompts prefilled whole or in chunks.

Chunked (the default): each step first gives every decoding sequence its next token, then runs the next chunk of
the prompts part-way through their prefill, then admits new prompts in arrival order, as far as
`max_num_batched_tokens` goes; one prompt's chunk is capped by `long_prefill_token_threshold`. While the engine
speculates (a decode step verifies proposals, a prefill step also feeds the draft model), a step cannot mix the
two, so prefill steps and decode steps alternate. Not chunked: a step either prefills whole prompts (admitted
while `max_num_seqs`, `max_num_batched_tokens` and free KV blocks allow) or decodes.

A sequence admitted gets KV blocks for all its tokens at once (prefix-cache hits included), so a partial prefill
never waits for memory. When a running sequence cannot get a block to decode, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to the front of the queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hotswap.config import SchedulerConfig
from hotswap.engine.block_manager import BlockManager
from hotswap.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step: `seqs[i]` runs its next `num_tokens[i]` tokens (from its `num_computed_tokens` on) and samples
    when they reach its last token. `is_prefill`: a step without decodes (every sequence computes part of its
    prompt, or of a recomputation); the other steps decode, mixed with prefill chunks unless speculating."""

    seqs: list[Sequence]
    num_tokens: list[int]
    is_prefill: bool
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    def ordered(self, key: Callable[[Sequence], int]) -> SchedulerOutput:
        """This step with its sequences in ascending `key` (stable): the same work, in another order."""
        order = sorted(range(len(self.seqs)), key=lambda i: key(self.seqs[i]))
        return SchedulerOutput(
            [self.seqs[i] for i in order], [self.num_tokens[i] for i in order], self.is_prefill, self.block_copies
        )

    def only(self, keep: list[Sequence]) -> SchedulerOutput:
        """The part of this step that runs `keep` (a subset of `seqs`), without the block copies."""
        pairs = [(s, n) for s, n in zip(self.seqs, self.num_tokens, strict=True) if s in keep]
        return SchedulerOutput([s for s, _ in pairs], [n for _, n in pairs], self.is_prefill)


def is_decoding(seq: Sequence) -> bool:
    """Whether `seq`'s next step is a decode: all its tokens but the last computed, and its request forked (before
    that, the step that ends its prompt samples all n first tokens)."""
    return seq.request.forked and seq.num_computed_tokens == len(seq) - 1


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
        self._last_was_prefill = False  # alternation of prefill and decode steps while they cannot mix
        self.max_loras: int | None = None  # LoRA adapter versions the running sequences may use together

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, mix: bool = True) -> SchedulerOutput | None:
        """The next step, or None when nothing can run. `mix` False (speculating): a step prefills or decodes."""
        if not self.config.enable_chunked_prefill:
            return self._prefill_whole() or self._decode()
        if mix:
            return self._chunked(decode=True)
        prefill_first = not self._last_was_prefill or not any(is_decoding(s) for s in self.running)
        out = (
            (self._chunked(decode=False) or self._decode())
            if prefill_first
            else (self._decode() or self._chunked(decode=False))
        )
        self._last_was_prefill = out is not None and out.is_prefill
        return out

    def _prefill_whole(self) -> SchedulerOutput | None:
        """Whole prompts (not chunked), admitted in arrival order while the limits allow."""
        scheduled: list[Sequence] = []
        num_tokens: list[int] = []
        budget = self.config.max_num_batched_tokens
        assert budget is not None
        for seq in self._in_turn(set()):
            if not self._admissible(seq) or (sum(num_tokens) + len(seq) > budget and scheduled):
                break
            self._admit(seq)
            scheduled.append(seq)
            num_tokens.append(len(seq) - seq.num_computed_tokens)
        if not scheduled:
            return None
        return SchedulerOutput(scheduled, num_tokens, True, self.block_manager.take_copies())

    def _in_turn(self, computing: set[int]) -> Iterator[Sequence]:
        """The waiting sequences in arrival order, for admission (the caller admits or stops at each), leaving out
        one whose first KV block another prompt computes now (its hash in `computing`, which admissions add to):
        it waits a step and then finds that prefix in the cache, so samples of one prompt, sent as separate
        requests, compute its KV once. While draining (`admit_new` False) only sequences with output are
        offered."""
        skipped = 0
        while skipped < len(self.waiting):
            seq = self.waiting[skipped]
            if not self.admit_new and not seq.started:
                skipped += 1  # draining: a preempted sequence with output may sit behind one without
                continue
            key = self.block_manager.uncached_first_block(seq)
            if key is not None and key in computing:
                skipped += 1
                continue
            yield seq
            if seq.status is SequenceStatus.WAITING:
                return  # not admitted: the caller stopped
            if key is not None:
                computing.add(key)

    def _decode(self) -> SchedulerOutput | None:
        """A step of decodes only (every decoding sequence's next token)."""
        scheduled = self._decodes()
        if not scheduled:
            return None
        return SchedulerOutput(scheduled, [1] * len(scheduled), False, self.block_manager.take_copies())

    def _decodes(self) -> list[Sequence]:
        """Gives every decoding sequence a writable slot for its next token (and its speculative lookahead),
        preempting the most recently admitted sequences where blocks run out; returns those that got one."""
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or not is_decoding(seq):
                continue  # preempted earlier in this loop, or still prefilling
            lookahead = self.lookahead(seq)
            while not self.block_manager.can_append(seq, lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append_slot(seq, lookahead)
                scheduled.append(seq)
        return scheduled

    def _chunked(self, decode: bool) -> SchedulerOutput | None:
        """Decodes first (when `decode`), then chunks of the prompts part-way through, then new prompts, within
        the token budget. A prompt that cannot finish in this step is a partial prefill; at most
        `max_num_partial_prefills` are at once."""
        budget = self.config.max_num_batched_tokens
        assert budget is not None
        cap = self.config.chunk_cap
        scheduled = self._decodes() if decode else []
        num_tokens = [1 + self.lookahead(s) for s in scheduled]
        budget -= sum(num_tokens)
        prefilling = [s for s in self.running if not is_decoding(s)]
        partial = 0
        for seq in prefilling:
            if budget <= 0:
                partial += 1
                continue
            remaining = len(seq) - seq.num_computed_tokens
            chunk = min(remaining, cap, budget)
            scheduled.append(seq)
            num_tokens.append(chunk)
            budget -= chunk
            partial += chunk < remaining
        computing = {key for s in prefilling if (key := self.block_manager.uncached_first_block(s)) is not None}
        for seq in self._in_turn(computing):
            if budget <= 0 or not self._admissible(seq):
                break
            remaining = len(seq) - self.block_manager.num_cached_tokens(seq)
            chunk = min(remaining, cap, budget)
            if chunk < remaining and partial >= self.config.max_num_partial_prefills:
                break
            self._admit(seq)
            scheduled.append(seq)
            num_tokens.append(chunk)
            budget -= chunk
            partial += chunk < remaining
        if not scheduled:
            return None
        return SchedulerOutput(scheduled, num_tokens, not decode, self.block_manager.take_copies())

    def _admissible(self, seq: Sequence) -> bool:
        """Whether the waiting `seq` may start now: new prompts are admitted (or it is in flight already), its
        sequences fit in `max_num_seqs` (a request with n > 1 forks its siblings after its prefill) and its
        blocks in the free KV cache."""
        if not self.admit_new and not seq.started:
            return False
        if self.running and sum(s.request.width for s in self.running) + seq.request.width > self.config.max_num_seqs:
            return False  # a request still in its prompt counts the n sequences it forks into
        lora = seq.request.lora
        if self.max_loras is not None and lora is not None:
            using = {s.request.lora.uid for s in self.running if s.request.lora is not None}
            if lora.uid not in using and len(using) >= self.max_loras:
                return False  # it waits for a running adapter version to finish
        return self.block_manager.can_allocate(seq)

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.block_manager.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_draft_computed = 0
        seq.request.drop_partial_prompt_logprobs()  # recomputed with the prompt (on the weights of then)
        seq.drop_routes_before_output()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def restart_prefills(self) -> None:
        """Sends every sequence part-way through its prefill (or the recomputation of a preempted one) back to
        start it again: called when the weights change, so that no prefill straddles two weight versions."""
        for seq in reversed([s for s in self.running if not is_decoding(s) and s.num_computed_tokens > 0]):
            self._preempt(seq)

    def recompute(self, wants: Callable[[Sequence], bool]) -> int:
        """Sends every running sequence for which `wants` is true back to be recomputed, prompt and output so far
        (its KV is dropped): at a weight commit, those whose request asked for "recompute". Returns how many."""
        chosen = [s for s in self.running if wants(s)]
        for seq in reversed(chosen):
            self._preempt(seq)
        return len(chosen)

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
