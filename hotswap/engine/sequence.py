"""Requests and their sequences, with named states."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hotswap.engine.routes import RouteLog
from hotswap.outputs import Logprob
from hotswap.sampling_params import SamplingParams
from hotswap.wire import PromptLogprobs

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from hotswap.engine.lora_registry import AdapterVersion

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)computation of its prompt and any output so far
    RUNNING = "running"  # holds KV blocks; decodes one token per step
    FINISHED = "finished"


class Sequence:
    """One completion being generated. `token_ids` holds prompt then output; KV exists for the first
    `num_computed_tokens` of them."""

    def __init__(self, request: Request, index: int, token_ids: list[int]) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of the leading full, computed blocks
        self.num_computed_tokens = 0
        self.num_draft_computed = 0  # tokens a speculative draft model holds KV for (may lag by one)
        self.num_proposed = 0  # speculative tokens proposed for it, and how many the target accepted
        self.num_accepted = 0
        self.num_spec_steps = 0
        self.num_cached_tokens = 0  # prefix-cache hits at its latest allocation
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, Logprob]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""  # detokenized output, kept current only where stop strings need it
        self.weight_versions: list[list[int]] = []  # [version, start, end) spans over the output tokens
        self.lora_versions: list[list[int]] = []  # the same for its LoRA adapter's versions
        self.cache_salt: int | None = None  # prefix-cache salt of its block hash chain (salt policy)
        self.streamed_tokens = 0  # output tokens already delivered as deltas
        self.streamed_text = 0  # characters of text already delivered as deltas
        self.routes: RouteLog | None = RouteLog() if request.record_routes else None
        # [start, end) of the positions whose rows came from an earlier allocation's passes while this one's KV is
        # recomputed (perhaps on other weights): those rows never go into the prefix cache with the new blocks
        self.route_stale = (0, 0)
        self.sampling_mask: list[list[int] | None] = []  # per output token, with return_sampling_mask
        self.matcher: LLMatcher | None = (
            None  # its grammar's state (structured outputs): has consumed exactly its outputs
        )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def record_version(self, version: int) -> None:
        """Attributes the newest output token to weight `version`."""
        _extend(self.weight_versions, version, self.num_output_tokens)

    def record_lora_version(self, version: int) -> None:
        """Attributes the newest output token to version `version` of its LoRA adapter."""
        _extend(self.lora_versions, version, self.num_output_tokens)

    def drop_routes_before_output(self) -> None:
        """On preemption: routes recorded by passes that sampled nothing yet (a prompt part-way through, or whole
        but not sampled) are recomputed with the prompt, on the weights of then; once a token is out, the rows
        that led to it stay (see hotswap/engine/routes.py)."""
        if self.routes is not None and not self.started:
            self.routes = RouteLog()

    @property
    def started(self) -> bool:
        """Whether it has produced output (so it is in flight, even if preempted)."""
        return self.num_output_tokens > 0

    def fork(self, index: int) -> Sequence:
        """A sibling with the same tokens and output state; the block manager shares its blocks separately."""
        child = Sequence(self.request, index, self.token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_draft_computed = self.num_draft_computed
        child.block_hashes = list(self.block_hashes)
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = list(self.logprobs)
        child.weight_versions = [list(span) for span in self.weight_versions]
        child.lora_versions = [list(span) for span in self.lora_versions]
        child.cache_salt = self.cache_salt
        child.routes = self.routes.copy() if self.routes is not None else None
        child.route_stale = self.route_stale
        child.sampling_mask = list(self.sampling_mask)
        child.matcher = self.matcher.deep_copy() if self.matcher is not None else None
        return child


@dataclass
class Request:
    """A prompt and its `params.n` sequences. Every n>1 rule lives here: sequence 0 is prefilled alone and samples
    all n first tokens; then `fork` creates its n-1 siblings, which share its KV blocks."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    admission_weight_version: int = 0
    stream: bool = False  # deliver an output after every step, not only at the end
    prompt_logprobs: PromptLogprobs | None = None  # complete, once its prompt ran (when asked for)
    partial_prompt_logprobs: PromptLogprobs | None = None  # those of the prompt's chunks that ran so far
    cache_salt: str | None = None  # requests with different salts share no prefix-cache blocks
    record_routes: bool = False  # its sequences keep their routed experts (a mixture-of-experts model)
    session_id: str | None = None  # the conversation it is a turn of (hotswap/engine/sessions.py)
    lora: AdapterVersion | None = None  # the LoRA adapter version it runs on, held for it
    lora_name: str | None = None

    @property
    def forced_routes(self) -> bool:
        """Whether some of its tokens run on given experts: its KV is its own, never shared through the prefix
        cache in either direction."""
        return self.params.forced_routed_experts is not None

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    def add_prompt_logprobs(self, chunk: PromptLogprobs, num_computed: int) -> None:
        """Appends a chunk's prompt logprobs; complete once `num_computed` tokens cover the prompt."""
        if self.partial_prompt_logprobs is None:
            self.partial_prompt_logprobs = chunk
        else:
            self.partial_prompt_logprobs.extend(chunk)
        if num_computed >= len(self.prompt_token_ids):
            self.prompt_logprobs, self.partial_prompt_logprobs = self.partial_prompt_logprobs, None

    def num_prompt_logprobs(self) -> int:
        """Prompt positions whose logprobs are computed so far (tokens 1.. of the prompt)."""
        partial = self.partial_prompt_logprobs
        return 0 if partial is None else len(partial.logprobs)

    def drop_partial_prompt_logprobs(self) -> None:
        """Forgets the chunks computed so far (the prompt is recomputed from its start)."""
        self.partial_prompt_logprobs = None

    @property
    def width(self) -> int:
        """Running sequences that scheduling `seqs[0]` now will produce (n before forking, then 1 each)."""
        return 1 if self.forked else self.params.n

    def sample_indices(self, seq: Sequence) -> list[int]:
        """The sample indices drawn from `seq`'s logits this step: all n before forking, else its own."""
        return list(range(self.params.n)) if not self.forked else [seq.index]

    def fork(self, seq: Sequence) -> list[Sequence]:
        """After the first prefill: creates `seq`'s n-1 siblings (the caller shares its blocks with them) and
        returns them; afterwards every sequence samples for itself. Returns [] once forked."""
        if self.forked:
            return []
        self.forked = True
        children = [seq.fork(index) for index in range(1, self.params.n)]
        self.seqs.extend(children)
        return children

    def fill_unforked(self, finish_reason: str) -> None:
        """Ends a request before it forked: its n-1 siblings are added, empty, with `finish_reason`."""
        while len(self.seqs) < self.params.n:
            child = Sequence(self, len(self.seqs), self.prompt_token_ids)
            child.finish_reason, child.status = finish_reason, SequenceStatus.FINISHED
            first = self.seqs[0].routes
            if first is not None:  # the prompt's rows computed so far, as each sibling would have had them
                child.routes = first.copy()
            self.seqs.append(child)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.status is SequenceStatus.FINISHED for s in self.seqs)


def _extend(spans: list[list[int]], version: int, end: int) -> None:
    """Attributes output token end - 1 to `version` in [version, start, end) `spans`."""
    if spans and spans[-1][0] == version and spans[-1][2] == end - 1:
        spans[-1][2] = end
    else:
        spans.append([version, end - 1, end])
