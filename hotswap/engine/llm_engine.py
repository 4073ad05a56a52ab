"""The step loop: schedule, execute on the workers, append tokens, finish requests; and the engine's lifecycle
(pause, weight changes, sleep) as one state machine (see `state.py`)."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import time
from typing import Any

import torch
from transformers import AutoTokenizer

from hotswap.config import EngineConfig, apply_overrides, live_overrides
from hotswap.engine.block_manager import BlockManager
from hotswap.engine.detokenizer import Detokenizer
from hotswap.engine.model_input import ModelInput, SampleResult, SampleSpec, SpecInput, SpecOutput
from hotswap.engine.output_processor import OutputProcessor
from hotswap.engine.scheduler import Scheduler, SchedulerOutput
from hotswap.engine.sequence import Request, Sequence
from hotswap.engine.speculator import Speculator
from hotswap.engine.state import EngineState
from hotswap.executor.base import Executor
from hotswap.executor.uniproc import UniProcExecutor
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams
from hotswap.weights.version import VersionArg, VersionLabels, parse_version


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
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
        assert mc.max_model_len is not None
        self.outputs = OutputProcessor(
            Detokenizer(self.tokenizer), _eos_token_ids(mc.hf_config, self.tokenizer, mc.model), mc.max_model_len
        )
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
        self.block_manager = BlockManager(cc.num_kv_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self.weight_version = 0  # orders versions; the label a client gave is kept beside it
        self.version_labels = VersionLabels()
        self.outputs.labels = self.version_labels
        self._salts = itertools.count(1)  # prefix-cache salts: private, never reused (unlike user versions)
        self.state = EngineState.RUNNING
        self._connect_deadline = 0.0  # monotonic time by which a transport being connected must be ready
        self._return_to: list[EngineState] = []  # where UPDATING / ASLEEP go back to, innermost last
        self.released: set[str] = set()  # while ASLEEP: what sleep() released, "kv_cache" and/or "weights"
        self.failed: dict[str, BaseException] = {}  # request id -> the error that ended it (see _run_batch)
        self.weights_valid = True  # every worker's, as of the last weight change
        self._session_token: str | None = None  # of the open update session
        self._session_target = "model"
        self._last_update_info: dict[str, Any] | None = None  # the declaration an empty one repeats
        # a prepared (phase-one) change awaiting commit_weight_update(): ("session" | "reload", folder or None)
        self._prepared: tuple[str, str | None] | None = None
        self.pause_mode = "keep"  # of the latest pause (the server refuses new requests during abort / wait ones)
        # speculative decoding: the draft's version is the target version it was last updated for, so the draft
        # is stale exactly while the two differ
        spec = config.speculative_config
        self.speculator = Speculator(spec, mc.max_model_len) if spec.enabled else None
        self.draft_weight_version = 0
        self._speculating = False  # in the current step
        if self.speculator is not None:
            self.scheduler.lookahead = self._lookahead
            self.outputs.speculative = True

    @property
    def draft_stale(self) -> bool:
        """Whether the target was updated after the draft model (never, without one)."""
        return self.config.speculative_config.uses_draft and self.draft_weight_version != self.weight_version

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
            value = getattr(params, name)
            if value is not None and value > (vocab if limit == -1 else min(limit, vocab)):
                raise ValueError(
                    f"{name}={value} exceeds max_logprobs={limit} (vocabulary: {vocab}); raise it with "
                    "LLM(max_logprobs=...) or --max-logprobs (-1: the whole vocabulary)"
                )
        if params.top_k > vocab:
            raise ValueError(f"top_k={params.top_k} exceeds the vocabulary size {vocab} (use -1 to disable top-k)")
        if params.n > self.config.scheduler_config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.scheduler_config.max_num_seqs}")

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: bool = False,
        cache_salt: str | None = None,
    ) -> None:
        """Queues a request (it starts when the engine is running and capacity allows). With `stream`, `step`
        returns its output after every step that advanced it; otherwise only when it finishes. Requests with
        different `cache_salt`s never share prefix-cache blocks (vLLM's per-user isolation)."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        self.validate_prompt(prompt_token_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, prompt, list(prompt_token_ids), params, stream=stream, cache_salt=cache_salt)
        request.admission_weight_version = self.weight_version
        seq = Sequence(request, 0, prompt_token_ids)
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

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
        self._settle_drain()
        return self.outputs.output(request)

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
            self.draft_stale, self.weight_version
        )
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.running or (self.scheduler.waiting and self.scheduler.admit_new):
                raise RuntimeError("no sequence can be scheduled although requests are waiting")
            self._settle_drain()
            return []
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
            single = SchedulerOutput(seqs, batch.is_prefill, copies)
            copies = []
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
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        specs: list[SampleSpec] = []
        for i, seq in enumerate(batch.seqs):
            start = seq.num_computed_tokens if batch.is_prefill else len(seq) - 1
            input_ids.extend(seq.token_ids[start:])
            positions.extend(range(start, len(seq)))
            query_lens.append(len(seq) - start)
            context_lens.append(len(seq))
            for index in seq.request.sample_indices(seq):
                sample_rows.append(i)
                specs.append(self._spec(seq, index))
        drafting = self._speculating and self.config.speculative_config.uses_draft
        prompt_logprobs = [
            (i, seq.request.params.prompt_logprobs or 0)
            for i, seq in enumerate(batch.seqs)
            if batch.is_prefill and seq.request.needs_prompt_logprobs and seq.num_computed_tokens == 0
        ]
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
        )

    def _spec_input(self, batch: SchedulerOutput) -> SpecInput:
        assert self.speculator is not None
        ngram = not self.speculator.uses_draft
        proposals = [self.speculator.proposals(seq) for seq in batch.seqs] if ngram else None
        num_spec = [len(p) for p in proposals] if proposals is not None else [
            self.speculator.num_speculative(seq) for seq in batch.seqs
        ]
        return SpecInput(
            num_spec=num_spec,
            specs=[[self._spec(seq, seq.index, j) for j in range(k + 1)] for seq, k in zip(batch.seqs, num_spec,
                                                                                          strict=True)],
            proposals=proposals,
            draft_tokens=None if ngram else [seq.token_ids[seq.num_draft_computed :] for seq in batch.seqs],
            draft_starts=None if ngram else [seq.num_draft_computed for seq in batch.seqs],
        )

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
            num_logprobs=p.logprobs,
            logit_bias=p.logit_bias,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            seen_token_ids=seq.token_ids if p.penalized else None,
            num_prompt_tokens=seq.num_prompt_tokens,
        )

    def _process(self, batch: SchedulerOutput, results: list[SampleResult] | SpecOutput) -> list[RequestOutput]:
        if isinstance(results, SpecOutput):
            return self._process_spec(batch, results)
        touched: dict[str, Request] = {}
        rows = iter(results)
        drafting = self._speculating and self.config.speculative_config.uses_draft
        for seq in batch.seqs:
            seq.num_computed_tokens = len(seq)
            if drafting and batch.is_prefill:
                seq.num_draft_computed = len(seq)
            self.block_manager.commit(seq, seq.num_draft_computed if drafting else None)
            request = seq.request
            targets = [seq]
            children = request.fork(seq)
            for child in children:
                self.block_manager.fork(seq, child)
                self.scheduler.add_running(child)
            targets += children
            for target in targets:
                result = next(rows)
                if result.prompt_logprobs is not None:
                    request.prompt_logprobs = result.prompt_logprobs
                self.outputs.append(target, result, self.weight_version)
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
        for seq, emitted, proposed in zip(batch.seqs, out.tokens, out.num_proposed, strict=True):
            length = len(seq)
            for result in emitted:
                seq.num_computed_tokens = len(seq)
                self.outputs.append(seq, result, self.weight_version)
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
            elif request.stream and request.params.output_kind != "final_only":
                outputs.append(self.outputs.output(request))
        return outputs

    # ---- weights ----------------------------------------------------------------------------------------------

    def _check_can_change(self, method: str) -> None:
        if self._prepared is not None:
            raise RuntimeError(f"{method}() while a prepared change awaits commit_weight_update() or "
                               "abort_weight_update()")
        if self._serving_state().steps and self.scheduler.num_in_flight() + len(self.scheduler.running):
            raise RuntimeError(
                f"{method}() while {len(self.requests)} request(s) are being generated; call "
                "pause_generation() first (or let them finish)"
            )

    _SESSION_METHODS = frozenset(
        {"init_weight_transfer_engine", "start_weight_update", "update_weights", "abort_weight_update",
         "shutdown_weight_transfer_engine"}
    )

    def weights_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs a transfer-session method on every worker (one of `_SESSION_METHODS`; reloads, config changes and
        finish have methods of their own) and moves the engine state with it. A failed update ends the session on
        every rank (rolled back in atomic mode). Calls that may have changed the served weights invalidate the
        prefix cache, even when they fail."""
        if method not in self._SESSION_METHODS:
            raise ValueError(f"weights_rpc() runs {sorted(self._SESSION_METHODS)}, not {method!r}")
        if method == "start_weight_update":
            self._check_can_change(method)
        changed = method == "update_weights"
        ok = False
        try:
            result = self.executor.collective_rpc(method, args, kwargs)
            changed = changed or (method == "abort_weight_update" and any(result))
            ok = True
        except BaseException:
            if method == "update_weights":
                try:
                    self._abort_on_every_rank()
                finally:
                    self._leave(EngineState.UPDATING)
            raise
        finally:
            if changed:
                self._weights_changed(failed=not ok)
        if method == "start_weight_update":
            self._enter(EngineState.UPDATING)
        elif method in ("abort_weight_update", "shutdown_weight_transfer_engine"):
            self._leave(EngineState.UPDATING)
        return result

    def begin_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Creates the receiving side of a transport on every worker without waiting for its trainer; the caller
        polls `weight_transfer_ready` (between steps, with its lock released in between), bounded by the
        transport's timeout."""
        self.weights_rpc("init_weight_transfer_engine", init_info)
        # the store connection and the group's rendezvous may each take up to timeout_s
        self._connect_deadline = time.monotonic() + 2 * self.config.weight_transfer_config.timeout_s + 10

    def weight_transfer_ready(self) -> bool:
        """Whether every worker's transport has connected. If one failed (or the engine-side deadline passed),
        every worker drops its transport and the error is raised: init_weight_transfer_engine() again."""
        try:
            ready = all(self.executor.collective_rpc("weight_transfer_ready"))
            if not ready and time.monotonic() > self._connect_deadline:
                raise TimeoutError("the weight transfer engine did not connect to its trainer in time")
        except BaseException:
            self.executor.collective_rpc("shutdown_weight_transfer_engine")  # ranks still connecting drop theirs
            raise
        return ready

    def start_weight_update(self, target: str = "model") -> str:
        """Opens an update session on every worker and returns its token: calls that carry another token are
        refused (a second trainer cannot feed, finish or abort this one's session); calls without a token are
        accepted, as clients of the vLLM API send none. `target`: "model", "draft" (the speculative draft alone)
        or "all" (both, committed or rolled back together)."""
        self.weights_rpc("start_weight_update", target)
        self._session_target = target
        self._session_token = secrets.token_hex(16)
        return self._session_token

    def check_session(self, session_token: str | None, ending: bool = False) -> None:
        """Raises RuntimeError when `session_token` names a session other than the open one. `ending` (an abort):
        with no session open there is nothing to protect, whatever the token."""
        if ending and self._session_token is None:
            return
        if session_token is not None and session_token != self._session_token:
            raise RuntimeError(
                "this weight-update session belongs to another caller (its session_token differs); wait for it, "
                "or abort it without a token"
            )

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]], session_token: str | None = None
                       ) -> None:
        """One update of the open session, if `session_token` (when given) is that session's. vLLM's forms are
        accepted: a list with one update_info per worker (identical declarations), and an empty declaration
        meaning the previous update's (a trainer that sends the same tensors every step declares them once)."""
        self.check_session(session_token)
        if self._prepared is not None:
            raise RuntimeError("update_weights() after the update was prepared; call commit_weight_update() or "
                               "abort_weight_update()")
        if isinstance(update_info, list):
            if not update_info or any(entry != update_info[0] for entry in update_info):
                self.weights_rpc("abort_weight_update")  # like any failed update, it ends the session
                raise ValueError("update_info given per worker must hold one identical declaration per worker "
                                 "(the session was rolled back)")
            update_info = update_info[0]
        if isinstance(update_info, dict) and self._last_update_info is not None and _empty_declaration(update_info):
            update_info = {**self._last_update_info, **{k: v for k, v in update_info.items() if v}}
        self.weights_rpc("update_weights", update_info)
        if isinstance(update_info, dict) and "names" in update_info:
            self._last_update_info = {k: v for k, v in update_info.items() if k in _DECLARATION}

    def abort_weight_update(self, session_token: str | None = None) -> None:
        """Ends the open session (rolled back); with no session open, nothing happens whatever the token."""
        self.check_session(session_token, ending=True)
        self.weights_rpc("abort_weight_update")

    def _abort_on_every_rank(self) -> None:
        """After a failure on some ranks: the others still hold their update open; roll it back there too (a
        no-op on ranks without one)."""
        if self.config.parallel_config.tensor_parallel_size > 1:
            self.executor.collective_rpc("abort_weight_update")

    def _two_phase(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Runs `method` on every worker so that they all change or none does: with worker processes, first with
        commit=False (everything that can fail, rollback copies kept), then, if every rank succeeded, the commit
        (`finish_weight_update`); on any failure every rank rolls back. One worker commits in one call."""
        if self.config.parallel_config.tensor_parallel_size == 1:
            self.executor.collective_rpc(method, args, kwargs)
            return
        try:
            self.executor.collective_rpc(method, args, {**kwargs, "commit": False})
        except BaseException:
            self._abort_on_every_rank()
            raise
        self.executor.collective_rpc("finish_weight_update")

    def _weights_changed(self, failed: bool = False) -> None:
        """After anything that may have changed the served weights, even a failed or aborted update: KV computed
        before it must never be reused (reset policy: drop the cache; salt policy: move to a fresh salt). After a
        failure, or while they are known invalid, the workers are asked whether their weights are valid (for
        `health_problem`); a success cannot invalidate them, so steady-state updates make no extra call."""
        self.reset_prefix_cache()
        self.block_manager.salt = next(self._salts)
        if failed or not self.weights_valid:
            try:
                self.weights_valid = all(self.executor.collective_rpc(_weights_valid))
            except Exception:  # the workers are gone: health_problem reports the executor's reason
                pass

    def health_problem(self) -> str | None:
        """Why the engine cannot serve now (a dead worker; weights left invalid by a failed update), or None.
        Answers at once: no worker call, no lock needed."""
        problem = self.executor.health_problem()
        if problem is None and not self.weights_valid and not self.is_asleep():
            problem = "the weights are invalid (a failed update, or sleep(2)); reload_weights() restores them"
        return problem

    def reload_weights(self, weights_path: str | None = None, weights_iterator: Any = None,
                       target: str = "model", weight_version: VersionArg = None) -> None:
        """Reloads in place on every worker (see `Worker.reload_weights`), all of them or none; an iterator is read
        once, here, so a generator works with worker processes too. The engine's config (and every worker's)
        records a new folder only after every worker loaded it. Advances the weight version on success; `target`
        "draft" reloads the speculative draft instead, which then counts as updated for the current version.
        `weight_version` (an integer or a label, see `hotswap.weights.version`) names the new version."""
        self._check_can_change("reload_weights")
        if target not in ("model", "draft"):
            raise ValueError(f"reload_weights target must be 'model' or 'draft', got {target!r}")
        parse_version(weight_version)
        if target == "draft" and weight_version is not None:
            raise ValueError("weight_version names a new version of the model; a draft reload keeps the current one")
        if target == "draft" and self.config.draft_model_config is None:
            raise ValueError("reload_weights(target='draft') needs a draft model (speculative_config 'draft_model')")
        if weights_iterator is not None:
            weights_iterator = list(weights_iterator)
        ok = False
        try:
            self._two_phase("reload_weights", weights_path=weights_path, weights_iterator=weights_iterator,
                            target=target)
            ok = True
        finally:
            self._weights_changed(failed=not ok)
        if target == "draft":
            if weights_path is not None:
                if self.config.parallel_config.tensor_parallel_size > 1:
                    self.executor.collective_rpc(_record_draft_folder, (str(weights_path),))
                assert self.config.draft_model_config is not None
                self.config.speculative_config.model = self.config.draft_model_config.model = str(weights_path)
            self.draft_weight_version = self.weight_version
            return
        if weights_path is not None:
            self._record_model_folder(str(weights_path))
        self._advance_version(weight_version)

    def update_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        """Applies a live config change to the engine and every worker together: validated here first (the same
        deterministic checks each worker runs), then applied by the workers, then to the engine's config."""
        self._check_can_change("update_config")
        new_sections = live_overrides(self.config, overrides)
        self.executor.collective_rpc("update_config", (overrides,))
        apply_overrides(self.config, new_sections)
        if "speculative_config" in new_sections:  # blocks cached while not speculating lack the draft's KV
            self.reset_prefix_cache(force=True)

    def finish_weight_update(self, weight_version: VersionArg = None, session_token: str | None = None) -> None:
        """Closes the session on every worker, all of them or none (a failure rolls every rank back); the prefix
        cache is invalidated and the version advances (or takes `weight_version`: an integer or a label)."""
        self.check_session(session_token)
        parse_version(weight_version)
        if self._prepared is not None:
            raise RuntimeError("this update was prepared for a two-phase commit; call commit_weight_update()")
        ok = False
        try:
            self._two_phase("finish_weight_update")
            ok = True
        finally:
            self._leave(EngineState.UPDATING)
            self._weights_changed(failed=not ok)
        self._versions_after_commit(weight_version)

    # ---- two-phase changes for a fleet of engines ------------------------------------------------------------

    def prepare_weight_update(self, session_token: str | None = None) -> None:
        """Phase one of finishing the open session: every worker post-processes what it received and keeps its
        rollback copies (nothing can fail after this but the process itself). The session stays open, serving
        nothing new, until `commit_weight_update()` or `abort_weight_update()`. A failure rolls every rank back
        and ends the session."""
        self.check_session(session_token)
        if self.state is not EngineState.UPDATING:
            raise RuntimeError("prepare_weight_update() needs an open session; call start_weight_update() first")
        if self._prepared is not None:
            raise RuntimeError("the update is already prepared; call commit_weight_update() or abort_weight_update()")
        self._prepare("finish_weight_update", {})
        self._prepared = ("session", None)

    def prepare_reload(self, weights_path: str | None = None, weights_iterator: Any = None) -> None:
        """Phase one of a reload (see `reload_weights`): every worker loads and post-processes the new weights in
        place but keeps its rollback copies; the engine is UPDATING (no step runs) until `commit_weight_update()`
        or `abort_weight_update()`. A failure rolls every rank back."""
        self._check_can_change("reload_weights")
        if self.state is EngineState.UPDATING:
            raise RuntimeError("a weight-update session is open; finish or abort it before a reload")
        if weights_iterator is not None:
            weights_iterator = list(weights_iterator)
        self._enter(EngineState.UPDATING)
        self._prepare("reload_weights", {"weights_path": weights_path, "weights_iterator": weights_iterator})
        self._prepared = ("reload", None if weights_path is None else str(weights_path))

    def _prepare(self, method: str, kwargs: dict[str, Any]) -> None:
        try:
            self.executor.collective_rpc(method, (), {**kwargs, "commit": False})
        except BaseException:
            try:
                self.executor.collective_rpc("abort_weight_update")  # ranks that prepared roll back too
            finally:
                self._leave(EngineState.UPDATING)
                self._weights_changed(failed=True)
            raise

    def commit_weight_update(self, weight_version: VersionArg = None, label: str | None = None) -> None:
        """Phase two: every worker commits the prepared change (it drops its rollback copies); the prefix cache is
        invalidated and the version advances (or takes `weight_version`, as a fleet gives every replica one, with
        `label` if given)."""
        parse_version(weight_version)
        parse_version(label, "label")
        if self._prepared is None:
            raise RuntimeError("nothing is prepared; call prepare_weight_update() or prepare_reload() first")
        kind, folder = self._prepared
        ok = False
        try:
            self.executor.collective_rpc("finish_weight_update")
            ok = True
        finally:
            self._leave(EngineState.UPDATING)
            self._weights_changed(failed=not ok)
        if kind == "reload":
            if folder is not None:
                self._record_model_folder(folder)
            self._advance_version(weight_version, label)
        else:
            self._versions_after_commit(weight_version, label)

    def _versions_after_commit(self, weight_version: VersionArg, label: str | None = None) -> None:
        """Advances the versions of what the committed session wrote (the model's, and the draft's)."""
        parts = {"model"} if self._session_target == "model" else {"draft"} if self._session_target == "draft" else (
            set(self.executor.collective_rpc(_last_update_parts)[0]) or {"model"}
        )
        if "model" in parts:
            self._advance_version(weight_version, label)
        if "draft" in parts:
            self.draft_weight_version = self.weight_version

    def _record_model_folder(self, folder: str) -> None:
        change = {"model_config": {"model": folder}}
        if self.config.parallel_config.tensor_parallel_size > 1:
            self.executor.collective_rpc("update_config", (change,))
        apply_overrides(self.config, live_overrides(self.config, change))

    # ---- copying weights between engines of the same config (a fleet's restarted replica) --------------------

    def export_weights(self) -> list[dict[str, torch.Tensor]]:
        """Copies of every worker's parameters and persistent buffers (the draft's prefixed "draft."), in rank
        order: what `adopt_weights` of an engine with the same config takes. Raises RuntimeError while the weights
        are invalid or released (a failed update, sleep(2))."""
        if not self.weights_valid or "weights" in self.released:
            raise RuntimeError("the weights are invalid or released; there is nothing to export")
        return self.executor.collective_rpc(_export_state)

    def adopt_weights(self, states: list[dict[str, torch.Tensor]], weight_version: int,
                      draft_weight_version: int | None = None) -> None:
        """Copies weights exported by an engine with the same config into this one's storage (no parameter is
        rebound) and serves them as `weight_version` (the draft's as `draft_weight_version`, default the same).
        Raises ValueError, changing nothing, when the ranks, names, shapes or dtypes differ."""
        self._check_can_change("adopt_weights")
        if parse_version(weight_version)[0] is None:
            raise ValueError(f"adopt_weights takes an integer weight_version, got {weight_version!r}")
        if self.state is EngineState.UPDATING:
            raise RuntimeError("adopt_weights() while a weight update is open; finish or abort it first")
        if len(states) != self.config.parallel_config.tensor_parallel_size:
            raise ValueError(f"got the weights of {len(states)} ranks for "
                             f"{self.config.parallel_config.tensor_parallel_size}")
        ok = False
        try:
            self.executor.collective_rpc(_import_state, (states,))
            ok = True
        finally:
            self._weights_changed(failed=not ok)
        self.weight_version = weight_version
        self.draft_weight_version = weight_version if draft_weight_version is None else draft_weight_version

    def _advance_version(self, weight_version: VersionArg, label: str | None = None) -> None:
        """The committed change's version: `weight_version`'s integer (else the next), labelled by `label`, else
        by `weight_version`'s label (else unlabelled)."""
        number, given = parse_version(weight_version)
        self.weight_version = self.weight_version + 1 if number is None else number
        self.version_labels.set(self.weight_version, label if label is not None else given)

    @property
    def session_token(self) -> str | None:
        """The open update session's token (None when no session is open)."""
        return self._session_token

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) sequences in the scheduler."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    @property
    def weight_version_label(self) -> str:
        """The served version as clients see it: the label given to it, or its integer as a string."""
        return self.version_labels.label(self.weight_version)

    def label_weight_version(self, label: VersionArg) -> str:
        """Renames the served version (weights, requests and the integer untouched): `label` is a string label,
        or an integer shown as itself. Returns the new label. Raises ValueError for an invalid label."""
        if label is None:
            raise ValueError("new_version must be a non-empty label")
        parse_version(label, "new_version")
        self.version_labels.set(self.weight_version, str(label))
        return self.weight_version_label

    # ---- the state machine ----------------------------------------------------------------------------------

    def _enter(self, state: EngineState) -> None:
        """Enters UPDATING or ASLEEP, remembering the state to return to."""
        self._return_to.append(self.state)
        self.state = state

    def _leave(self, state: EngineState) -> None:
        """Leaves UPDATING or ASLEEP (no-op when not in it) for the state it was entered from."""
        if state is EngineState.UPDATING:
            self._session_token = None
            self._prepared = None
        if self.state is state:
            self.state = self._return_to.pop()
            self._settle_drain()

    def _serving_state(self) -> EngineState:
        """RUNNING, DRAINING or PAUSED: the current state, or the one UPDATING / ASLEEP return to."""
        return self._return_to[0] if self._return_to else self.state

    def _set_serving_state(self, state: EngineState) -> None:
        if self._return_to:
            self._return_to[0] = state
        else:
            self.state = state

    def _settle_drain(self) -> None:
        """DRAINING becomes PAUSED once nothing is in flight (called wherever requests end)."""
        if self._serving_state() is EngineState.DRAINING and self.scheduler.num_in_flight() == 0:
            self._set_serving_state(EngineState.PAUSED)

    def is_asleep(self) -> bool:
        """Whether sleep() released something not woken yet (also while an update runs on top of it)."""
        return self.state is EngineState.ASLEEP or EngineState.ASLEEP in self._return_to

    def refusing_new_requests(self) -> bool:
        """Whether generation is paused (or draining) in 'abort' or 'wait' mode, in which vLLM's server answers
        new requests 503 rather than queueing them ('keep' queues them)."""
        state = self._serving_state()
        return state in (EngineState.PAUSED, EngineState.DRAINING) and self.pause_mode in ("abort", "wait")

    def is_paused(self) -> bool:
        """Whether generation is paused (also while an update runs or the engine sleeps on top of a pause)."""
        return self._serving_state() is EngineState.PAUSED

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
            outputs = [out for rid in list(self.requests) if (out := self.abort_request(rid)) is not None]
        elif mode == "keep" and clear_cache:
            self.scheduler.preempt_all()
        self.scheduler.admit_new = False
        if self._serving_state() is not EngineState.PAUSED:
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
        """Releases memory. Level 1: the KV cache (weights stay in host memory). Level 2: the KV cache and the
        weights' memory (restore them with wake_up(["weights"]) then a reload or a full update)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.state not in (EngineState.RUNNING, EngineState.PAUSED, EngineState.ASLEEP):
            raise RuntimeError(f"cannot sleep while {self.state.value}")
        if self.scheduler.has_unfinished():
            raise RuntimeError(f"cannot sleep with {len(self.requests)} request(s) in flight; abort or finish them")
        self.executor.collective_rpc("sleep", (level,))
        if level == 2:
            self.weights_valid = False  # their memory was returned; a reload or full update restores them
        self.released |= {"kv_cache", "weights"} if level == 2 else {"kv_cache"}
        if self.state is not EngineState.ASLEEP:  # sleeping deeper while asleep stays in ASLEEP
            self._enter(EngineState.ASLEEP)
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
            self.block_manager = BlockManager(cc.num_kv_blocks, cc.block_size, cc.enable_prefix_caching)
            self.block_manager.salt = next(self._salts)
            self.scheduler.block_manager = self.block_manager
        self.released -= set(tags)
        if not self.released:
            if self.state is EngineState.ASLEEP:
                self._leave(EngineState.ASLEEP)
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


def _worker_state(worker: Any) -> dict[str, torch.Tensor]:
    """The worker's parameters and persistent buffers by name, the draft's under "draft." (tensors, not copies)."""
    state = dict(worker.model.state_dict())
    if worker.draft_model is not None:
        state.update({f"draft.{k}": v for k, v in worker.draft_model.state_dict().items()})
    return state


def _export_state(worker: Any) -> dict[str, torch.Tensor]:
    """Host copies (a live replica on a GPU does not double its device memory)."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in _worker_state(worker).items()}


def _import_state(worker: Any, states: list[dict[str, torch.Tensor]]) -> None:
    """Copies `states[rank]` into the worker's tensors in place, after checking every name, shape and dtype."""
    given, mine = states[worker.rank], _worker_state(worker)
    if given.keys() != mine.keys():
        missing, extra = sorted(mine.keys() - given.keys()), sorted(given.keys() - mine.keys())
        raise ValueError(f"the weights name other tensors (missing {missing[:5]}, unexpected {extra[:5]})")
    for name, tensor in given.items():
        if tensor.shape != mine[name].shape or tensor.dtype != mine[name].dtype:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the engine holds "
                             f"{tuple(mine[name].shape)} {mine[name].dtype}")
    with torch.no_grad():
        for name, tensor in given.items():
            mine[name].copy_(tensor)




_DECLARATION = ("names", "dtypes", "dtype_names", "shapes", "bucket_size_bytes", "load_format")


def _empty_declaration(update_info: dict[str, Any]) -> bool:
    """{} or {"names": [], "dtype_names": [], "shapes": []} (vLLM 0.33: "the same as last time")."""
    return all(not update_info.get(k) for k in _DECLARATION) and not any(
        isinstance(v, (list, dict)) and v for k, v in update_info.items() if k not in _DECLARATION and k != "target"
    )


def _weights_valid(worker: Any) -> bool:
    return bool(worker.session.weights_valid)


def _last_update_parts(worker: Any) -> list[str]:
    """Which models ("model", "draft") the worker's last committed update wrote."""
    return list(worker.last_update_parts)


def _record_draft_folder(worker: Any, folder: str) -> None:
    worker._record_folder(folder, "draft")


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
