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

After the workers ran a step, `postprocess` does its bookkeeping: the computed tokens advance and their blocks enter
the prefix cache, a request whose prompt is done forks its siblings onto its blocks, each sampled token is
appended (through the output processor), and finished sequences leave the running queue with their blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hotswap.config import SchedulerConfig
from hotswap.engine.block_manager import BlockManager
from hotswap.engine.sequence import Request, Sequence, SequenceStatus
from hotswap.engine.speculator import Speculator
from hotswap.wire import SampleResult, Samples, SpecOutput

# appends a sampled token to a sequence, setting its finish_reason when a stop condition is met (the engine's
# OutputProcessor.append, at the served weight version)
AppendToken = Callable[[Sequence, SampleResult], None]


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
        """The next step, or None when nothing runs and nothing can start (no request waits, or admissions are
        closed while draining). `mix` False (speculating): a step prefills or decodes. A step that runs LoRA
        adapters has each adapter's sequences consecutive (its products run on a slice of the batch, not gathered
        rows). Raises RuntimeError when requests wait but none can be scheduled."""
        out = self._next_step(mix)
        if out is None:
            if self.running or (self.waiting and self.admit_new):
                raise RuntimeError("no sequence can be scheduled although requests are waiting")
            return None
        if self.max_loras is not None and any(s.request.lora is not None for s in out.seqs):
            out = out.ordered(lambda s: 0 if s.request.lora is None else s.request.lora.uid)
        return out

    def _next_step(self, mix: bool) -> SchedulerOutput | None:
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

    def check_integrity(self, seqs: list[Sequence]) -> None:
        """Asserts the KV block accounting against `seqs` (every sequence of the engine's requests), and that the
        running sequences, each holding blocks, are among them while the waiting ones hold none."""
        self.block_manager.check_integrity(seqs)
        running = {id(seq) for seq in self.running}
        assert all(seq.block_table for seq in self.running), "a running sequence holds no blocks"
        assert all(not seq.block_table for seq in self.waiting), "a waiting sequence holds blocks"
        assert running <= {id(seq) for seq in seqs}, "a running sequence belongs to no request"

    # ---- after a step ---------------------------------------------------------------------------------------

    def postprocess(
        self,
        batch: SchedulerOutput,
        results: Samples | SpecOutput,
        append: AppendToken,
        drafting: bool,
        speculator: Speculator | None = None,
    ) -> list[Request]:
        """The bookkeeping of `batch` once the workers ran it with `results`: each sequence's computed tokens (and
        its recorded routes, its prompt logprobs) advance and its full blocks are committed to the prefix cache
        (where the draft's KV is valid too, when `drafting`: a draft model keeps KV beside the target's); a
        sequence that reached its last token forks its request's siblings (sharing its blocks; they join the
        running queue) and each gets its sampled token through `append`; sequences that finished leave the running
        queue and free their blocks. A speculative step (`SpecOutput`) appends each sequence's emitted tokens and
        records the acceptance with `speculator`. Returns the requests that advanced, each once, in batch order."""
        if isinstance(results, SpecOutput):
            assert speculator is not None
            return self._postprocess_spec(batch, results, append, drafting, speculator)
        touched: dict[str, Request] = {}
        rows = iter(results.samples)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            if drafting and batch.is_prefill and seq.num_draft_computed == seq.num_computed_tokens:
                seq.num_draft_computed += n  # the draft ran these tokens too (not if it missed earlier chunks)
            if seq.routes is not None:
                seq.routes.write(seq.num_computed_tokens, results.routes[i])
            seq.num_computed_tokens += n
            self.block_manager.commit(seq, seq.num_draft_computed if drafting else None)
            request = seq.request
            if i in results.prompt_logprobs:
                request.add_prompt_logprobs(results.prompt_logprobs[i], seq.num_computed_tokens)
            if seq.num_computed_tokens < len(seq):
                continue  # a chunk of its prompt: it samples once the rest has run
            targets = [seq]
            children = request.fork(seq)
            for child in children:
                self.block_manager.fork(seq, child)
                self.add_running(child)
            targets += children
            for target in targets:
                append(target, next(rows))
                if request.lora is not None:
                    target.record_lora_version(request.lora.version)
            for target in targets:
                if target.finish_reason is not None:
                    self.finish(target)
            touched[request.request_id] = request
        assert next(rows, None) is None, "every sampled row belongs to a sequence"
        return list(touched.values())

    def _postprocess_spec(
        self, batch: SchedulerOutput, out: SpecOutput, append: AppendToken, drafting: bool, speculator: Speculator
    ) -> list[Request]:
        """Appends each sequence's emitted tokens (stopping at the first that ends it); the KV of every token but
        the newest is then valid in the target's cache, and in the draft's up to its last pass (see
        hotswap/engine/speculator.py)."""
        touched: dict[str, Request] = {}
        for i, (seq, emitted, proposed) in enumerate(zip(batch.seqs, out.tokens, out.num_proposed, strict=True)):
            length = len(seq)
            if seq.routes is not None:  # the rows of the last token and the accepted proposals (trimmed at output)
                seq.routes.write(length - 1, out.routes[i][: len(emitted)])
            for result in emitted:
                seq.num_computed_tokens = len(seq)
                append(seq, result)
                if seq.finish_reason is not None:
                    break
            accepted = min(len(emitted) - 1, len(seq) - length)  # proposals kept (a finish may cut the rest)
            if drafting:
                seq.num_draft_computed = min(length + max(proposed - 1, 0), length + accepted, len(seq) - 1)
            self.block_manager.commit(seq, seq.num_draft_computed if drafting else None)
            speculator.record(seq, proposed, accepted)
            if seq.finish_reason is not None:
                self.finish(seq)
            touched[seq.request.request_id] = seq.request
        return list(touched.values())
