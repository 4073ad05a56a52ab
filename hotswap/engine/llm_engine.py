"""The step loop: schedule, execute on the workers, append tokens, finish requests."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from transformers import AutoTokenizer

from hotswap.config import EngineConfig
from hotswap.engine.block_manager import BlockManager
from hotswap.engine.detokenizer import Detokenizer, find_stop
from hotswap.engine.scheduler import Scheduler, SchedulerOutput
from hotswap.engine.sequence import Request, Sequence, SequenceStatus
from hotswap.executor.base import Executor
from hotswap.executor.uniproc import UniProcExecutor
from hotswap.model.layers.sampler import SampleResult, SampleSpec
from hotswap.outputs import CompletionOutput, Logprob, RequestOutput, WeightVersionSpan
from hotswap.sampling_params import SamplingParams
from hotswap.worker.model_input import ModelInput


class LLMEngine:
    """Owns the scheduler and block manager; drives the workers through the executor."""

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        if executor_class is None:
            executor_class = UniProcExecutor
            if config.parallel_config.tensor_parallel_size > 1:
                from hotswap.executor.multiproc import MultiprocExecutor

                executor_class = MultiprocExecutor
        mc, cc = config.model_config, config.cache_config
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = _eos_token_ids(mc.hf_config, self.tokenizer, mc.model)
        self.executor = executor_class(config)
        self.executor.collective_rpc("load_model")
        if cc.num_kv_blocks is None:
            cc.num_kv_blocks = min(self.executor.collective_rpc("determine_num_kv_blocks"))
        assert mc.max_model_len is not None
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
        self.weight_version = 0
        self._salts = itertools.count(1)  # prefix-cache salts: private, never reused (unlike user versions)
        self.update_in_progress = False  # a weight-update session is open: no step runs
        self.paused = False
        self.sleeping: set[str] = set()  # what sleep() released: "kv_cache", "weights"

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
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}")
        if params.n > self.config.scheduler_config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.scheduler_config.max_num_seqs}")

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: bool = False,
    ) -> None:
        """Queues a request (it starts when the engine is running and capacity allows). With `stream`, `step`
        returns its output after every step that advanced it; otherwise only when it finishes."""
        self.validate_prompt(prompt_token_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, prompt, list(prompt_token_ids), params, stream=stream)
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
            return None
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
            self.scheduler.remove(seq)
        while len(request.seqs) < request.params.n:  # siblings never forked end empty
            child = Sequence(request, len(request.seqs), request.prompt_token_ids)
            child.finish_reason, child.status = "abort", SequenceStatus.FINISHED
            request.seqs.append(child)
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns the outputs of requests that finished in it (and of streamed requests that
        advanced). Does nothing while paused."""
        if self.sleeping:
            raise RuntimeError(f"the engine is asleep ({sorted(self.sleeping)} released); call wake_up() first")
        if self.paused or self.update_in_progress:
            return []
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.running or (self.scheduler.waiting and self.scheduler.admit_new):
                raise RuntimeError("no sequence can be scheduled although requests are waiting")
            return []
        model_input = self._build_input(batch)
        results = self.executor.collective_rpc("execute_model", (model_input,))[0]
        return self._process(batch, model_input, results)

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
            width = seq.request.params.n if not seq.request.forked else 1
            for index in range(width) if width > 1 else [seq.index]:
                sample_rows.append(i)
                specs.append(self._spec(seq, index))
        return ModelInput(
            input_ids,
            positions,
            query_lens,
            context_lens,
            [s.block_table for s in batch.seqs],
            sample_rows,
            specs,
            batch.block_copies,
        )

    def _spec(self, seq: Sequence, index: int) -> SampleSpec:
        p = seq.request.params
        banned: list[int] = []
        if seq.num_output_tokens < p.min_tokens:
            banned = sorted(set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(self.eos_token_ids)))
        return SampleSpec(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            seed=p.seed,
            sample_index=index,
            position=seq.num_output_tokens,
            banned_token_ids=banned,
            num_logprobs=p.logprobs,
        )

    def _process(
        self, batch: SchedulerOutput, model_input: ModelInput, results: list[SampleResult]
    ) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        row = 0
        for seq in batch.seqs:
            seq.num_computed_tokens = len(seq)
            self.block_manager.commit(seq)
            request = seq.request
            targets = [seq]
            if not request.forked:
                request.forked = True
                for index in range(1, request.params.n):
                    child = seq.fork(index)
                    self.block_manager.fork(seq, child)
                    request.seqs.append(child)
                    self.scheduler.add_running(child)
                targets = list(request.seqs)
            for target in targets:
                self._append(target, results[row])
                row += 1
            for target in targets:
                if target.finish_reason is not None and target.status is SequenceStatus.RUNNING:
                    self.scheduler.finish(target)
            touched[request.request_id] = request
        assert row == len(results)
        outputs = []
        for request in touched.values():
            if request.finished:
                outputs.append(self._output(request))
                del self.requests[request.request_id]
            elif request.stream and request.params.output_kind != "final_only":
                outputs.append(self._output(request))
        return outputs

    def _append(self, seq: Sequence, result: SampleResult) -> None:
        params = seq.request.params
        token = result.token_id
        seq.token_ids.append(token)
        seq.record_version(self.weight_version)
        seq.cumulative_logprob += result.logprob
        if params.logprobs is not None:
            entry = {token: Logprob(result.logprob, result.rank, self.detokenizer.token_text(token))}
            for rank, (tid, lp) in enumerate(
                zip(result.top_ids or [], result.top_logprobs or [], strict=False), start=1
            ):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self.detokenizer.token_text(tid))
            seq.logprobs.append(entry)
        num_out = seq.num_output_tokens
        new_chars = 0
        if params.stop_strings:  # text is kept current so only newly added characters are searched
            old_len = len(seq.text)
            seq.text = self.detokenizer.decode(seq.output_token_ids, params.skip_special_tokens)
            new_chars = len(seq.text) - old_len
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in (params.stop_token_ids or ()):
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if params.stop_strings and new_chars > 0:
                hit = find_stop(seq.text, params.stop_strings, new_chars)
                if hit is not None:
                    seq.finish_reason, seq.stop_reason = "stop", hit[0]
                    seq.text = seq.text[: hit[1]]
                    return
        max_len = self.config.model_config.max_model_len
        assert max_len is not None
        if (params.max_tokens is not None and num_out >= params.max_tokens) or len(seq) >= max_len:
            seq.finish_reason = "length"

    def _output(self, request: Request) -> RequestOutput:
        """The request's output now: everything so far, or for output_kind 'delta' what is new since the last
        output (text held back while it may still change: a partial character or a possible stop string)."""
        params = request.params
        delta = params.output_kind == "delta"
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            text = seq.text if isinstance(seq.stop_reason, str) else None
            if text is None:
                text = self.detokenizer.decode(seq.output_token_ids, params.skip_special_tokens)
            tokens, logprobs = list(seq.output_token_ids), (seq.logprobs if params.logprobs is not None else None)
            if delta:
                ready = len(text)
                if seq.finish_reason is None:
                    ready = len(text.rstrip("\ufffd"))
                    if params.stop_strings:
                        ready = max(min(ready, len(text) - max(map(len, params.stop_strings)) + 1), seq.streamed_text)
                text, seq.streamed_text = text[seq.streamed_text : ready], ready
                start, seq.streamed_tokens = seq.streamed_tokens, len(tokens)
                tokens = tokens[start:]
                logprobs = logprobs[start:] if logprobs is not None else None
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=tokens,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    weight_versions=[WeightVersionSpan(*span) for span in seq.weight_versions],
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            num_cached_tokens=request.seqs[0].num_cached_tokens,
            admission_weight_version=request.admission_weight_version,
        )

    # ---- weights ----------------------------------------------------------------------------------------------

    def weights_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs a weight-lifecycle method on every worker. Starting a change (a session, a reload, a config
        change) is refused while requests are in flight and the engine is not paused; no step runs while a
        session is open. Calls that may change the served weights invalidate the prefix cache."""
        if (
            method in _STARTS_CHANGE
            and not self.paused
            and self.scheduler.num_in_flight() + len(self.scheduler.running)
        ):
            raise RuntimeError(
                f"{method}() while {len(self.requests)} request(s) are being generated; call "
                "pause_generation() first (or let them finish)"
            )
        try:
            result = self.executor.collective_rpc(method, args, kwargs)
            if method == "start_weight_update":
                self.update_in_progress = True
            return result
        except BaseException:
            if method in ("update_weights", "finish_weight_update"):
                self.update_in_progress = False  # a failed update ends the session on the workers
                if self.config.parallel_config.tensor_parallel_size > 1:
                    # a rank that did not fail still has the session open: roll it back too
                    self.executor.collective_rpc(_abort_if_active)
            raise
        finally:
            if method in ("finish_weight_update", "abort_weight_update", "shutdown_weight_transfer_engine"):
                self.update_in_progress = False
            if method in _CHANGES_WEIGHTS:
                self._weights_changed()

    def _weights_changed(self) -> None:
        """After anything that may have changed the served weights, even a failed or aborted update: KV computed
        before it must never be reused (reset policy: drop the cache; salt policy: move to a fresh salt)."""
        self.reset_prefix_cache()
        self.block_manager.salt = next(self._salts)

    def reload_weights(self, weights_path: str | None = None, weights_iterator: Any = None) -> None:
        self.weights_rpc("reload_weights", weights_path=weights_path, weights_iterator=weights_iterator)
        self._advance_version(None)

    def finish_weight_update(self, weight_version: int | None = None) -> None:
        if weight_version is not None and not isinstance(weight_version, int):
            raise ValueError(f"weight_version must be an integer, got {weight_version!r}")
        self.weights_rpc("finish_weight_update")
        self._advance_version(weight_version)

    def _advance_version(self, weight_version: int | None) -> None:
        self.weight_version = self.weight_version + 1 if weight_version is None else weight_version

    # ---- pause and resume -----------------------------------------------------------------------------------

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> list[RequestOutput]:
        """Starts pausing generation. 'abort': every request ends now with finish_reason 'abort' (their final
        outputs are returned). 'keep': requests freeze where they are; with `clear_cache` their KV is dropped
        and recomputed on resume. 'wait': no new request starts; the caller keeps stepping until
        `num_in_flight()` is 0, then the engine is paused. Requests added while paused wait for resume."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        outputs: list[RequestOutput] = []
        if mode == "abort":
            outputs = [out for rid in list(self.requests) if (out := self.abort_request(rid)) is not None]
        elif mode == "keep" and clear_cache:
            self.scheduler.preempt_all()
        self.scheduler.admit_new = False
        self.paused = mode != "wait"
        if clear_cache:
            self.reset_prefix_cache(force=True)
        return outputs

    def finish_pause(self) -> bool:
        """For 'wait' mode: marks the engine paused once nothing is in flight; returns whether it is paused."""
        if not self.paused and not self.scheduler.admit_new and self.scheduler.num_in_flight() == 0:
            self.paused = True
        return self.paused

    def resume(self) -> None:
        self.paused = False
        self.scheduler.admit_new = True

    # ---- sleep and wake -------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Releases memory. Level 1: the KV cache (weights stay in host memory). Level 2: the KV cache and the
        weights' memory (restore them with wake_up(["weights"]) then a reload or a full update)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.scheduler.has_unfinished():
            raise RuntimeError(f"cannot sleep with {len(self.requests)} request(s) in flight; abort or finish them")
        self.executor.collective_rpc("sleep", (level,))
        self.sleeping = {"kv_cache", "weights"} if level == 2 else {"kv_cache"}
        self.reset_prefix_cache(force=True)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocates what sleep released: "weights" and/or "kv_cache" (default: both)."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; expected 'weights' and/or 'kv_cache'")
        self.executor.collective_rpc("wake_up", (tags,))
        if "kv_cache" in tags and "kv_cache" in self.sleeping:
            cc = self.config.cache_config
            assert cc.num_kv_blocks is not None
            self.block_manager = BlockManager(cc.num_kv_blocks, cc.block_size, cc.enable_prefix_caching)
            self.block_manager.salt = next(self._salts)
            self.scheduler.block_manager = self.block_manager
        self.sleeping -= set(tags)

    # ---- maintenance ----------------------------------------------------------------------------------------

    def reset_prefix_cache(self, force: bool = False) -> None:
        """Drops the prefix cache. Weight changes do this under the 'reset' policy; `force` does it always."""
        if force or self.config.cache_config.prefix_cache_policy == "reset":
            self.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the workers (worker processes under tensor parallelism)."""
        self.executor.shutdown()

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_hit_tokens": bm.prefix_hit_tokens,
            "shared_block_refs": bm.shared_block_refs,
            "num_free_blocks": bm.num_free_blocks,
            "num_kv_blocks": len(bm.blocks),
        }


def _abort_if_active(worker: Any) -> None:
    """Ends a worker's open weight-update session (rolling it back), if it has one."""
    if worker.session.state.value == "active":
        worker.abort_weight_update()


# Worker methods that may change the served weights, and those that must not overlap generation.
_CHANGES_WEIGHTS = {"reload_weights", "finish_weight_update", "update_weights", "abort_weight_update"}
_STARTS_CHANGE = {"reload_weights", "start_weight_update", "update_config"}


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
