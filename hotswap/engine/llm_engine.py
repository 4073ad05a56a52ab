"""The step loop: schedule, execute on the workers, append tokens, finish requests; and the engine's lifecycle
(pause, weight changes, sleep) as one state machine (see `state.py`)."""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from typing import Any

import numpy as np
import torch

from hotswap.config import EngineConfig, apply_overrides, live_overrides
from hotswap.engine.block_manager import BlockManager
from hotswap.engine.detokenizer import Detokenizer
from hotswap.engine.grammar import Grammars
from hotswap.engine.lora_registry import Adapter, AdapterVersion, LoRARegistry
from hotswap.engine.lora_updates import LoRAUpdates
from hotswap.engine.output_processor import OutputProcessor
from hotswap.engine.scheduler import Scheduler, SchedulerOutput
from hotswap.engine.sequence import Request, Sequence
from hotswap.engine.sessions import Sessions
from hotswap.engine.speculator import Speculator
from hotswap.engine.state import EngineState
from hotswap.engine.tokenizer import load_tokenizer
from hotswap.engine.weights_controller import WeightsController
from hotswap.errors import EngineUnresponsive
from hotswap.executor.base import Executor
from hotswap.executor.uniproc import UniProcExecutor
from hotswap.lora.request import LoRARequest
from hotswap.model.registry import model_class
from hotswap.outputs import RequestOutput, TokenScores
from hotswap.sampling_params import SamplingParams
from hotswap.weights.version import VersionLabels
from hotswap.wire import ModelInput, PromptLogprobs, PromptLogprobsAsk, Samples, SampleSpec, SpecInput, SpecOutput


class LLMEngine:
    """Owns the scheduler and block manager; drives the workers through the executor. Not thread-safe: callers
    serialize access (`LLM` and `AsyncLLMEngine` hold a lock)."""

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        if executor_class is None:
            executor_class = UniProcExecutor
            if config.parallel_config.tensor_parallel_size > 1:
                from hotswap.executor.multiproc import MultiprocExecutor

                executor_class = MultiprocExecutor
        mc, cc = config.model_config, config.cache_config
        assert mc.tokenizer is not None  # EngineConfig defaults it to the model's folder
        self.tokenizer = load_tokenizer(mc.tokenizer)
        assert mc.max_model_len is not None
        self.outputs = OutputProcessor(
            Detokenizer(self.tokenizer), _eos_token_ids(mc.hf_config, self.tokenizer, mc.model), mc.max_model_len
        )
        # (sparse layers, top_k, experts) of a mixture-of-experts model, None for a dense one
        self.grammars = Grammars(self.tokenizer, mc.hf_config["vocab_size"], self.outputs.eos_token_ids)
        self.routing_shape = model_class(mc.architecture).routing_shape(mc.hf_config)  # type: ignore[attr-defined]
        self.executor = executor_class(config)
        self.executor.collective_rpc("load_model")
        if cc.num_kv_blocks is None:
            cc.num_kv_blocks = min(self.executor.collective_rpc("determine_num_kv_blocks"))
        if cc.num_kv_blocks * cc.block_size < mc.max_model_len:
            raise ValueError(
                f"the KV cache holds {cc.num_kv_blocks * cc.block_size} tokens, fewer than max_model_len="
                f"{mc.max_model_len}; raise kv_cache_memory_bytes / memory_fraction or lower max_model_len"
            )
        self.executor.collective_rpc("initialize_cache", (cc.num_kv_blocks,))
        self.sessions = Sessions()
        self.block_manager = self._new_block_manager()
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self.state = EngineState.RUNNING
        self._return_to: list[EngineState] = []  # where UPDATING / ASLEEP go back to, innermost last
        self.released: set[str] = set()  # while ASLEEP: what sleep() released, "kv_cache" and/or "weights"
        self.failed: dict[str, BaseException] = {}  # request id -> the error that ended it (see _run_batch)
        self.weights = WeightsController(self)  # everything that changes the weights, and their versions
        self.loras = LoRARegistry(config.lora_config, self.executor) if config.lora_config.enable_lora else None
        self.lora_updates = (
            None
            if self.loras is None
            else LoRAUpdates(self.loras, self.executor, config.parallel_config.tensor_parallel_size)
        )
        if self.loras is not None:
            self.loras.on_superseded = self._lora_committed
            self.scheduler.max_loras = config.lora_config.max_loras
        self.outputs.labels = self.weights.labels
        self.pause_mode = "keep"  # of the latest pause (the server refuses new requests during abort / wait ones)
        spec = config.speculative_config
        self.speculator = Speculator(spec, mc.max_model_len) if spec.enabled else None
        self._speculating = False  # in the current step
        if self.speculator is not None:
            self.scheduler.lookahead = self._lookahead
            self.outputs.speculative = True

    def _new_block_manager(self) -> BlockManager:
        """An empty block manager for the configured cache; the open sessions keep their priority in it."""
        cc = self.config.cache_config
        assert cc.num_kv_blocks is not None
        bm = BlockManager(
            cc.num_kv_blocks, cc.block_size, cc.enable_prefix_caching, int(cc.num_kv_blocks * cc.session_cache_fraction)
        )
        self.sessions.attach(bm)
        return bm

    # ---- what the front ends read (an `AsyncFleet`'s view answers the same names) ---------------------------

    @property
    def weight_version(self) -> int:
        """The served weights' version (the integer that orders versions)."""
        return self.weights.version

    @property
    def draft_weight_version(self) -> int:
        """The target version the speculative draft was last updated for."""
        return self.weights.draft_version

    @property
    def draft_stale(self) -> bool:
        return self.weights.draft_stale

    @property
    def weight_version_label(self) -> str:
        return self.weights.current_label

    @property
    def version_labels(self) -> VersionLabels:
        return self.weights.labels

    @property
    def session_token(self) -> str | None:
        """The open update session's token (None when no session is open)."""
        return self.weights.token

    def _lookahead(self, seq: Sequence) -> int:
        return self.speculator.num_speculative(seq) if self._speculating and self.speculator is not None else 0

    @property
    def eos_token_ids(self) -> set[int]:
        return self.outputs.eos_token_ids

    @property
    def detokenizer(self) -> Detokenizer:
        return self.outputs.detokenizer

    # ---- requests -------------------------------------------------------------------------------------------

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a prompt the engine cannot serve."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        max_len = self.config.model_config.max_model_len
        assert max_len is not None
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; max_model_len={max_len} leaves no room to generate"
            )
        vocab = self.config.model_config.hf_config["vocab_size"]
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:10]}")
        if any(t >= vocab for t in params.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}")
        if any(t >= vocab for t in params.logit_bias or {}):
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab}")
        limit = self.config.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = self._num_logprobs(getattr(params, name))
            if value is not None and value > (vocab if limit == -1 else min(limit, vocab)):
                raise ValueError(
                    f"{name}={value} exceeds max_logprobs={limit} (vocabulary: {vocab}); raise it with "
                    "LLM(max_logprobs=...) or --max-logprobs (-1: the whole vocabulary)"
                )
        if params.top_k > vocab:
            raise ValueError(f"top_k={params.top_k} exceeds the vocabulary size {vocab} (use -1 to disable top-k)")
        if params.n > self.config.scheduler_config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.scheduler_config.max_num_seqs}")
        if (params.return_routed_experts or params.forced_routed_experts is not None) and self.routing_shape is None:
            name = "return_routed_experts" if params.return_routed_experts else "forced_routed_experts"
            raise ValueError(
                f"{name} needs a mixture-of-experts model; {self.config.model_config.architecture} routes no token"
            )
        if params.forced_routed_experts is not None:
            self._check_forced_routes(params.forced_routed_experts, len(prompt_token_ids))
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # an invalid schema, regex or grammar is refused here

    def _check_forced_routes(self, forced: np.ndarray, num_prompt_tokens: int) -> None:
        assert self.routing_shape is not None
        layers, top_k, experts = self.routing_shape
        rows = forced.shape[0]
        if forced.shape[1:] != (layers, top_k):
            raise ValueError(
                f"forced_routed_experts has shape {list(forced.shape)}; this model needs [tokens, "
                f"{layers}, {top_k}] (sparse layers, experts per token)"
            )
        if rows > num_prompt_tokens:
            raise ValueError(
                f"forced_routed_experts has {rows} rows for a prompt of {num_prompt_tokens} tokens; give "
                "at most one row per prompt token, from the first"
            )
        if forced.min() < 0 or forced.max() >= experts:
            raise ValueError(
                f"forced_routed_experts holds expert ids outside [0, {experts}): "
                f"{int(forced.min())}..{int(forced.max())}"
            )
        if any(len(set(row)) != top_k for row in forced.reshape(-1, top_k).tolist()):
            raise ValueError("forced_routed_experts names an expert twice for one token and layer")

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: bool = False,
        cache_salt: str | None = None,
        validated: bool = False,
        session_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queues a request (it starts when the engine is running and capacity allows). With `stream`, `step`
        returns its output after every step that advanced it; otherwise only when it finishes. Requests with
        different `cache_salt`s never share prefix-cache blocks (vLLM's per-user isolation). `validated`: the
        caller already ran `validate_prompt` on this prompt and params (and checked the salt's type), as
        `LLM.generate` does for every prompt before it queues any. `session_id` makes it a turn of that session
        (opened if it is not; see hotswap/engine/sessions.py). `lora_request`: the LoRA adapter it runs with (loaded
        from its path on first use; see `resolve_lora`)."""
        if not validated:
            if cache_salt is not None and not isinstance(cache_salt, str):
                raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
            self.validate_prompt(prompt_token_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter = self.resolve_lora(lora_request) if lora_request is not None else None
        if session_id is not None:
            self.sessions.open(session_id)
        request = Request(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            stream=stream,
            cache_salt=cache_salt,
            session_id=session_id,
        )
        request.record_routes = self.routing_shape is not None and (
            params.return_routed_experts or self.config.model_config.enable_return_routed_experts
        )
        request.admission_weight_version = self.weights.version
        if adapter is not None:
            assert self.loras is not None  # resolve_lora needs them
            request.lora, request.lora_name = self.loras.acquire(adapter), adapter.name
        seq = Sequence(request, 0, prompt_token_ids)
        if params.grammar is not None:
            seq.matcher = self.grammars.matcher(params.grammar)
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def resolve_lora(self, lora_request: LoRARequest) -> Adapter:
        """The adapter a request names (loaded from its path on first use). Raises ValueError when LoRA is not
        enabled or the adapter cannot be had."""
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True")
        return self.loras.resolve(lora_request)

    def _lora_committed(self, adapter: Adapter, superseded: list[AdapterVersion]) -> None:
        """A new version of `adapter` is current while requests run on `superseded` ones: under the "switch"
        policy they go on with the new one (their KV so far stays), else they finish on theirs."""
        if self.config.lora_config.lora_version_policy != "switch":
            return
        assert self.loras is not None  # an adapter was committed
        for request in self.requests.values():
            if request.lora is not None and any(request.lora is v for v in superseded):
                self.loras.release(request.lora)
                request.lora = self.loras.acquire(adapter)

    def _release(self, request: Request) -> None:
        """A request left the engine: its adapter version is no longer held for it."""
        if request.lora is not None and self.loras is not None:
            self.loras.release(request.lora)
            request.lora = None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request with finish_reason 'abort', keeping its partial output, and frees its KV blocks.
        Returns its final output, or None for an unknown id."""
        request = self.requests.pop(request_id, None)
        if request is None:
            self.failed.pop(request_id, None)
            return None
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
            self.scheduler.remove(seq)
        request.fill_unforked("abort")
        self._release(request)
        self._settle_drain()
        return self.outputs.output(request)

    def abort_requests(self, request_ids: list[str] | None = None, prefix: str | None = None) -> list[RequestOutput]:
        """Group abort: ends every request named in `request_ids` and every one whose id starts with `prefix`
        (neither given: all of them) as `abort_request` does, at once; returns their final outputs (the partial
        tokens, logprobs, version spans). Unknown ids are skipped."""
        if request_ids is None and prefix is None:
            chosen = list(self.requests)
        else:
            wanted = set(request_ids or ())
            chosen = [r for r in self.requests if r in wanted or (prefix is not None and r.startswith(prefix))]
        return [out for rid in chosen if (out := self.abort_request(rid)) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns the outputs of requests that finished in it (and of streamed requests that
        advanced). Does nothing while PAUSED or UPDATING; raises while ASLEEP."""
        if self.is_asleep():
            raise RuntimeError(f"the engine is asleep ({sorted(self.released)} released); call wake_up() first")
        if not self.state.steps:
            return []
        self._speculating = self.speculator is not None and self.speculator.active(
            self.weights.draft_stale, self.weights.version
        )
        batch = self.scheduler.schedule(mix=not self._speculating)
        if batch is None:
            if self.scheduler.running or (self.scheduler.waiting and self.scheduler.admit_new):
                raise RuntimeError("no sequence can be scheduled although requests are waiting")
            self._settle_drain()
            return []
        if self.loras is not None and any(s.request.lora is not None for s in batch.seqs):
            # each adapter's rows consecutive: its products run on a slice of the batch, not gathered rows
            batch = batch.ordered(lambda s: 0 if s.request.lora is None else s.request.lora.uid)
        outputs = self._run_batch(batch)
        self._settle_drain()
        return outputs

    def _run_batch(self, batch: SchedulerOutput) -> list[RequestOutput]:
        """Executes `batch`. Should it fail while the workers are healthy, each request is run on its own, so that
        only the requests that fail by themselves end (finish_reason 'abort', the error in `failed`); the other
        requests in flight go on. A failure of the workers themselves raises."""
        try:
            results = self.executor.collective_rpc("execute_model", (self._build_input(batch),))[0]
        except Exception:
            if self.executor.health_problem() is not None:
                raise
            return self._run_isolated(batch)
        return self._process(batch, results)

    def _run_isolated(self, batch: SchedulerOutput) -> list[RequestOutput]:
        by_request: dict[str, list[Sequence]] = {}
        for seq in batch.seqs:
            by_request.setdefault(seq.request.request_id, []).append(seq)
        outputs: list[RequestOutput] = []
        copies = batch.block_copies  # run (idempotently) before the first forward pass
        for request_id, seqs in by_request.items():
            single = batch.only(seqs)
            single.block_copies, copies = copies, []
            try:
                results = self.executor.collective_rpc("execute_model", (self._build_input(single),))[0]
            except Exception as err:
                if self.executor.health_problem() is not None:
                    raise
                self.failed[request_id] = err
                out = self.abort_request(request_id)
                if out is not None:
                    outputs.append(out)
                continue
            outputs += self._process(single, results)
        return outputs

    def take_error(self, request_id: str) -> BaseException | None:
        """The error that ended `request_id` (run on its own, it failed), once; None if it did not fail."""
        return self.failed.pop(request_id, None)

    def _build_input(self, batch: SchedulerOutput) -> ModelInput:
        """Sequence i runs its tokens num_computed_tokens .. + num_tokens[i]; it samples (all n first tokens before
        its request forked) when they reach its last token."""
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
                    specs.append(self._spec(seq, index))
            request = seq.request
            if request.needs_prompt_logprobs and seq.index == 0 and start < seq.num_prompt_tokens:
                # the prompt runs from its start (no prefix-cache hit), chunk after chunk, each asking once
                assert request.num_prompt_logprobs() == start, "prompt logprobs cover the chunks before this one"
                targets = seq.token_ids[start + 1 : min(end + 1, seq.num_prompt_tokens)]
                spec, mode = self._prompt_processing(request.params)
                top = self._num_logprobs(request.params.prompt_logprobs) or 0
                prompt_logprobs.append(PromptLogprobsAsk(i, top, targets, spec, mode))
        drafting = self._speculating and self.config.speculative_config.uses_draft
        return ModelInput(
            input_ids,
            positions,
            query_lens,
            context_lens,
            [s.block_table for s in batch.seqs],
            sample_rows,
            specs,
            batch.block_copies,
            spec=self._spec_input(batch) if self._speculating and not batch.is_prefill else None,
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
                [self._spec(seq, seq.index, j) for j in range(k + 1)]
                for seq, k in zip(batch.seqs, num_spec, strict=True)
            ],
            proposals=proposals,
            draft_tokens=None if ngram else [seq.token_ids[seq.num_draft_computed :] for seq in batch.seqs],
            draft_starts=None if ngram else [seq.num_draft_computed for seq in batch.seqs],
        )

    def _num_logprobs(self, value: int | None) -> int | None:
        """A logprobs count as the workers take it: -1 (vLLM's "the whole vocabulary") as the vocabulary size."""
        return int(self.config.model_config.hf_config["vocab_size"]) if value == -1 else value

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

    def _spec(self, seq: Sequence, index: int, ahead: int = 0) -> SampleSpec:
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

    def _process(self, batch: SchedulerOutput, results: Samples | SpecOutput) -> list[RequestOutput]:
        if isinstance(results, SpecOutput):
            return self._process_spec(batch, results)
        touched: dict[str, Request] = {}
        rows = iter(results.samples)
        drafting = self._speculating and self.config.speculative_config.uses_draft
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
                self.scheduler.add_running(child)
            targets += children
            for target in targets:
                self.outputs.append(target, next(rows), self.weights.version)
                if request.lora is not None:
                    target.record_lora_version(request.lora.version)
            for target in targets:
                if target.finish_reason is not None:
                    self.scheduler.finish(target)
            touched[request.request_id] = request
        assert next(rows, None) is None, "every sampled row belongs to a sequence"
        return self._outputs_of(touched)

    def _process_spec(self, batch: SchedulerOutput, out: SpecOutput) -> list[RequestOutput]:
        """Appends each sequence's emitted tokens (stopping at the first that ends it); the KV of every token but
        the newest is then valid in the target's cache, and in the draft's up to its last pass (see
        hotswap/engine/speculator.py)."""
        assert self.speculator is not None
        drafting = self.speculator.uses_draft
        touched: dict[str, Request] = {}
        for i, (seq, emitted, proposed) in enumerate(zip(batch.seqs, out.tokens, out.num_proposed, strict=True)):
            length = len(seq)
            if seq.routes is not None:  # the rows of the last token and the accepted proposals (trimmed at output)
                seq.routes.write(length - 1, out.routes[i][: len(emitted)])
            for result in emitted:
                seq.num_computed_tokens = len(seq)
                self.outputs.append(seq, result, self.weights.version)
                if seq.finish_reason is not None:
                    break
            accepted = min(len(emitted) - 1, len(seq) - length)  # proposals kept (a finish may cut the rest)
            if drafting:
                seq.num_draft_computed = min(length + max(proposed - 1, 0), length + accepted, len(seq) - 1)
            self.block_manager.commit(seq, seq.num_draft_computed if drafting else None)
            self.speculator.record(seq, proposed, accepted)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            touched[seq.request.request_id] = seq.request
        return self._outputs_of(touched)

    def _outputs_of(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            if request.finished:
                outputs.append(self.outputs.output(request))
                del self.requests[request.request_id]
                self._release(request)
                if request.session_id is not None:
                    self.sessions.finished(
                        request.session_id, len(request.prompt_token_ids), request.seqs[0].num_cached_tokens
                    )
            elif request.stream and request.params.output_kind != "final_only":
                outputs.append(self.outputs.output(request))
        return outputs

    # ---- health, config ------------------------------------------------------------------------------------

    def score_probes(self, probes: list[list[int]]) -> list[list[float]]:
        """Each probe's logprobs of its tokens 1.. under the weights the workers hold now, in one forward pass,
        through KV blocks taken from the free ones and given back (nothing enters the prefix cache). Raises
        RuntimeError when the free KV cache cannot hold the probes."""
        if self._blocks_for(probes) > self.block_manager.num_free_blocks:
            raise RuntimeError(
                "the free KV cache cannot hold the canary probes (requests held by a 'keep' pause "
                "occupy it); use shorter probes or pause with clear_cache"
            )
        return [scored.logprobs for scored in self._score_pass(probes, 0, None, "raw_logprobs")]

    def score_tokens(
        self,
        sequences: list[list[int]],
        temperature: float = 1.0,
        top_logprobs: int = 0,
        top_k: int = -1,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ) -> list[TokenScores]:
        """Teacher scoring: for each token sequence, the logprob of each of its tokens 1.. given the tokens
        before it under log_softmax(logits / temperature) after min-p/top-k/top-p (a filtered token's logprob is
        -inf), its rank, and the `top_logprobs` most likely tokens per position (-1: the whole vocabulary), without
        generating. Whatever the engine's `logprobs_mode`, these are the processed distribution's logprobs (at
        temperature 1 without filters: the raw ones); in deterministic mode the same bits as
        `hotswap.train.token_logprobs(model, ids, temperature=temperature)` and `sequence_logprobs`.

        The sequences run in as few forward passes as the free KV cache and `max_num_batched_tokens` allow,
        through blocks given back afterwards (no prefix cache either way), between steps. Raises ValueError for
        bad input (no sequence, an empty one, one longer than max_model_len, token ids outside the vocabulary,
        top_logprobs above max_logprobs, a temperature that is not positive, bad filters) and RuntimeError when the
        weights cannot score now (a weight update open, asleep, invalid weights) or the free KV cache cannot hold
        one sequence; the engine is unchanged by any of these. A paused engine scores (its weights are valid)."""
        vocab = int(self.config.model_config.hf_config["vocab_size"])
        k = self._check_scoring(sequences, temperature, top_logprobs, top_k, top_p, min_p, vocab)
        problem = self.health_problem()
        if problem is None and (self.is_asleep() or self.state is EngineState.UPDATING):
            problem = f"the engine is {self.state.value}"
        if problem is not None:
            raise RuntimeError(f"cannot score now: {problem}")
        spec = SampleSpec(temperature=float(temperature), top_k=top_k, top_p=float(top_p), min_p=float(min_p))
        budget = self.config.scheduler_config.max_num_batched_tokens or len(max(sequences, key=len))
        free = self.block_manager.num_free_blocks  # the same before every pass: each gives its blocks back
        groups: list[list[list[int]]] = []  # one forward pass each: within the token budget and the free blocks
        for ids in sequences:
            last = groups[-1] if groups else None
            if last and sum(map(len, last)) + len(ids) <= budget and self._blocks_for([*last, ids]) <= free:
                last.append(ids)
            else:
                groups.append([ids])
        results: list[PromptLogprobs] = []
        for group in groups:
            if self._blocks_for(group) > free:
                raise RuntimeError(
                    f"the free KV cache cannot hold a sequence of {len(group[0])} tokens (requests "
                    "in flight or held by a 'keep' pause occupy it); score it when they finished"
                )
            results += self._score_pass(group, k, spec, "processed_logprobs")
        version = self.weights.version
        return [
            TokenScores.of(list(ids), scored, k, version, self.weights.labels.label(version))
            for ids, scored in zip(sequences, results, strict=True)
        ]

    def _check_scoring(
        self, sequences: Any, temperature: Any, top_logprobs: Any, top_k: Any, top_p: Any, min_p: Any, vocab: int
    ) -> int:
        """Raises ValueError naming what is wrong with a `score_tokens` call; returns its top-k count (-1 resolved
        to the vocabulary)."""
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

    def _blocks_for(self, sequences: list[list[int]]) -> int:
        """KV blocks `sequences` take, each in blocks of its own."""
        size = self.config.cache_config.block_size
        return sum(-(-len(ids) // size) for ids in sequences)

    def _score_pass(
        self, sequences: list[list[int]], top_k: int, spec: SampleSpec | None, mode: str
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
        bm = self.block_manager
        taken: list[Sequence] = []
        try:
            for seq in seqs:
                bm.allocate(seq)
                taken.append(seq)
            speculating, self._speculating = self._speculating, False
            try:
                batch = SchedulerOutput(seqs, [len(s) for s in seqs], True)  # pending copies stay for the next step
                model_input = self._build_input(batch)
                for ask in model_input.prompt_logprobs:
                    ask.top_k, ask.spec, ask.mode = top_k, spec, mode
                results = self.executor.collective_rpc("execute_model", (model_input,))[0]
            finally:
                self._speculating = speculating
        finally:
            for seq in taken:
                bm.free_seq(seq)
        assert isinstance(results, Samples)
        return [results.prompt_logprobs[i] for i in range(len(seqs))]

    def health_problem(self) -> str | None:
        """Why the engine cannot serve now (a dead worker; weights left invalid by a failed update), or None.
        Answers at once: no worker call, no lock needed."""
        problem = self.executor.health_problem()
        if problem is None and not self.weights.valid and not self.is_asleep():
            problem = "the weights are invalid (a failed update, or sleep(2)); reload_weights() restores them"
        return problem

    def check_liveness(self, timeout_s: float) -> float:
        """A no-op round trip through every worker (`weight_state`), bounded by `timeout_s` where the executor can
        bound it (worker processes); returns its seconds. Raises EngineUnresponsive when a worker does not answer
        in time (the executor is then broken: `health_problem` says so)."""
        start = time.monotonic()
        try:
            self.executor.collective_rpc("weight_state", timeout=timeout_s)
        except Exception as err:
            raise EngineUnresponsive(f"a worker did not answer a liveness round trip: {err}") from err
        return time.monotonic() - start

    def update_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        """Applies a live config change to the engine and every worker together: validated here first (the same
        deterministic checks each worker runs), then applied by the workers, then to the engine's config."""
        self.weights.check_can_change("update_config")
        new_sections = live_overrides(self.config, overrides)
        self.executor.collective_rpc("update_config", (overrides,))
        apply_overrides(self.config, new_sections)
        if "speculative_config" in new_sections:  # blocks cached while not speculating lack the draft's KV
            self.reset_prefix_cache(force=True)

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) sequences in the scheduler."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    # ---- the state machine ----------------------------------------------------------------------------------

    def enter_state(self, state: EngineState) -> None:
        """Enters UPDATING or ASLEEP, remembering the state to return to."""
        self._return_to.append(self.state)
        self.state = state

    def leave_state(self, state: EngineState) -> None:
        """Leaves UPDATING or ASLEEP (no-op when not in it) for the state it was entered from."""
        if self.state is state:
            self.state = self._return_to.pop()
            self._settle_drain()

    def serving_state(self) -> EngineState:
        """RUNNING, DRAINING or PAUSED: the current state, or the one UPDATING / ASLEEP return to."""
        return self._return_to[0] if self._return_to else self.state

    def _set_serving_state(self, state: EngineState) -> None:
        if self._return_to:
            self._return_to[0] = state
        else:
            self.state = state

    def _settle_drain(self) -> None:
        """DRAINING becomes PAUSED once nothing is in flight (called wherever requests end)."""
        if self.serving_state() is EngineState.DRAINING and self.scheduler.num_in_flight() == 0:
            self._set_serving_state(EngineState.PAUSED)

    def is_asleep(self) -> bool:
        """Whether sleep() released something not woken yet (also while an update runs on top of it)."""
        return self.state is EngineState.ASLEEP or EngineState.ASLEEP in self._return_to

    def refusing_new_requests(self) -> bool:
        """Whether generation is paused (or draining) in 'abort' or 'wait' mode, in which vLLM's server answers
        new requests 503 rather than queueing them ('keep' queues them)."""
        state = self.serving_state()
        return state in (EngineState.PAUSED, EngineState.DRAINING) and self.pause_mode in ("abort", "wait")

    def is_paused(self) -> bool:
        """Whether generation is paused (also while an update runs or the engine sleeps on top of a pause)."""
        return self.serving_state() is EngineState.PAUSED

    # ---- pause and resume -----------------------------------------------------------------------------------

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> list[RequestOutput]:
        """Pauses generation. 'abort': every request ends now with finish_reason 'abort' (their final outputs are
        returned). 'keep': requests freeze where they are; with `clear_cache` their KV is dropped and recomputed
        on resume. 'wait': DRAINING: no new request starts, and the engine becomes PAUSED once the requests in
        flight finished (the caller keeps stepping). Requests added while paused wait for resume."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        self.pause_mode = mode
        outputs: list[RequestOutput] = []
        if mode == "abort":
            outputs = self.abort_requests()
        elif mode == "keep" and clear_cache:
            self.scheduler.preempt_all()
        self.scheduler.admit_new = False
        if self.serving_state() is not EngineState.PAUSED:
            self._set_serving_state(EngineState.DRAINING if mode == "wait" else EngineState.PAUSED)
        self._settle_drain()
        if clear_cache:
            self.reset_prefix_cache(force=True)
        return outputs

    def resume(self) -> None:
        self._set_serving_state(EngineState.RUNNING)
        self.scheduler.admit_new = True

    # ---- sleep and wake -------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Releases memory. Level 1: the KV cache (weights stay in host memory; a GPU's move there, and
        wake_up(["weights"]) brings them back). Level 2: the KV cache and the weights' memory (restore them with
        wake_up(["weights"]) then a reload or a full update). Refused while a
        sequence holds KV cache; requests that hold none (queued, or frozen by a 'keep' pause that cleared the
        cache) stay and run after wake_up and resume."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.state not in (EngineState.RUNNING, EngineState.PAUSED, EngineState.ASLEEP):
            raise RuntimeError(f"cannot sleep while {self.state.value}")
        if self.scheduler.running:  # requests held without KV (queued, or frozen by 'keep') wait for wake_up
            raise RuntimeError(
                f"cannot sleep while {len(self.scheduler.running)} sequence(s) hold KV cache; finish or abort them, "
                "or pause first (mode 'abort', 'wait', or 'keep' with clear_cache)"
            )
        self.executor.collective_rpc("sleep", (level,))
        if level == 2:
            self.weights.valid = False  # their memory was returned; a reload or full update restores them
        on_gpu = self.config.model_config.device != "cpu"  # level 1 moves a GPU's weights to the host (vLLM's way)
        self.released |= {"kv_cache", "weights"} if level == 2 or on_gpu else {"kv_cache"}
        if self.state is not EngineState.ASLEEP:  # sleeping deeper while asleep stays in ASLEEP
            self.enter_state(EngineState.ASLEEP)
        self.reset_prefix_cache(force=True)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocates what sleep released: "weights" and/or "kv_cache" (default: both); the engine leaves ASLEEP
        once nothing released remains."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; expected 'weights' and/or 'kv_cache'")
        self.executor.collective_rpc("wake_up", (tags,))
        if "kv_cache" in tags and "kv_cache" in self.released:
            cc = self.config.cache_config
            assert cc.num_kv_blocks is not None
            self.block_manager = self._new_block_manager()
            self.block_manager.salt = self.weights.next_salt()
            self.scheduler.block_manager = self.block_manager
        self.released -= set(tags)
        if not self.released:
            if self.state is EngineState.ASLEEP:
                self.leave_state(EngineState.ASLEEP)
            elif EngineState.ASLEEP in self._return_to:  # woken during an update: it returns to the state before
                self._return_to.remove(EngineState.ASLEEP)

    # ---- maintenance ----------------------------------------------------------------------------------------

    def reset_prefix_cache(self, force: bool = False) -> None:
        """Drops the prefix cache. Weight changes do this under the 'reset' policy; `force` does it always."""
        if force or self.config.cache_config.prefix_cache_policy == "reset":
            self.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the workers (worker processes under tensor parallelism)."""
        self.executor.shutdown()

    def check_integrity(self) -> None:
        """Asserts the KV block accounting against every sequence the engine holds (tests call it after every
        scenario)."""
        seqs = [seq for request in self.requests.values() for seq in request.seqs]
        self.block_manager.check_integrity(seqs)
        running = {id(seq) for seq in self.scheduler.running}
        assert all(seq.block_table for seq in self.scheduler.running), "a running sequence holds no blocks"
        assert all(not seq.block_table for seq in self.scheduler.waiting), "a waiting sequence holds blocks"
        assert running <= {id(seq) for seq in seqs}, "a running sequence belongs to no request"

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_hit_tokens": bm.prefix_hit_tokens,
            "shared_block_refs": bm.shared_block_refs,
            "num_free_blocks": bm.num_free_blocks,
            "num_kv_blocks": len(bm.blocks),
            **self.sessions.totals(),
            **(self._spec_stats() if self.speculator is not None else {}),
        }

    def _spec_stats(self) -> dict[str, Any]:
        assert self.speculator is not None
        st = self.speculator.stats
        return {
            "spec_draft_tokens": st.num_draft_tokens,
            "spec_accepted_tokens": st.num_accepted_tokens,
            "spec_steps": st.num_steps,
            "spec_acceptance_rate": st.acceptance_rate,
            "spec_mean_accepted_length": st.mean_accepted_length,
            "draft_weight_version": self.draft_weight_version,
            "draft_stale": self.draft_stale,
        }


# what a scored sequence's request carries: its one sampled token (greedy, never drawn from the process's generator)
# is dropped; prompt_logprobs makes it ask its prompt logprobs (PromptLogprobsAsk set by `_score_pass`)
_SCORE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)


def _eos_token_ids(hf_config: dict[str, Any], tokenizer: Any, model_dir: str) -> set[int]:
    """EOS ids from config.json, generation_config.json (e.g. Llama 3's end-of-turn) and the tokenizer."""
    generation: dict[str, Any] = {}
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            generation = json.load(f)
    ids: set[int] = set()
    for value in (hf_config.get("eos_token_id"), generation.get("eos_token_id"), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids
