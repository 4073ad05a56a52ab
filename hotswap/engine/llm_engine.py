"""The step loop: schedule a batch, run it on the workers, let the scheduler do its bookkeeping, return the outputs.
Around it, the engine's front: requests (validated in `validation.py`), the weights (`weights_controller.py`), the
lifecycle (state, pause, sleep: `lifecycle.py`), teacher scoring (`scoring.py`); the batch the workers run is built
in `batch.py`."""

from __future__ import annotations

import itertools
import time
from typing import Any

from hotswap.config import EngineConfig, apply_overrides, live_overrides
from hotswap.engine.batch import BatchBuilder
from hotswap.engine.block_manager import BlockManager
from hotswap.engine.detokenizer import Detokenizer
from hotswap.engine.grammar import Grammars
from hotswap.engine.lifecycle import Lifecycle
from hotswap.engine.lora_registry import Adapter, AdapterVersion, LoRARegistry
from hotswap.engine.lora_updates import LoRAUpdates
from hotswap.engine.output_processor import OutputProcessor, eos_token_ids
from hotswap.engine.scheduler import Scheduler, SchedulerOutput
from hotswap.engine.scoring import Scorer
from hotswap.engine.sequence import Request, Sequence
from hotswap.engine.sessions import Sessions
from hotswap.engine.speculator import Speculator
from hotswap.engine.state import EngineState
from hotswap.engine.tokenizer import load_tokenizer
from hotswap.engine.validation import validate_prompt
from hotswap.engine.weights_controller import WeightsController
from hotswap.errors import EngineUnresponsive
from hotswap.executor.base import Executor
from hotswap.executor.uniproc import UniProcExecutor
from hotswap.lora.request import LoRARequest
from hotswap.model.registry import model_class
from hotswap.outputs import RequestOutput, TokenScores
from hotswap.sampling_params import SamplingParams
from hotswap.weights.version import VersionLabels
from hotswap.wire import SampleResult, Samples, SpecOutput


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
            Detokenizer(self.tokenizer), eos_token_ids(mc.hf_config, self.tokenizer, mc.model), mc.max_model_len
        )
        self.grammars = Grammars(self.tokenizer, mc.hf_config["vocab_size"], self.outputs.eos_token_ids)
        # (sparse layers, top_k, experts) of a mixture-of-experts model, None for a dense one
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
        self.lifecycle = Lifecycle(self)  # the engine state, pause and sleep
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
        spec = config.speculative_config
        self.speculator = Speculator(spec, mc.max_model_len) if spec.enabled else None
        self._speculating = False  # in the current step
        if self.speculator is not None:
            self.scheduler.lookahead = self._lookahead
            self.outputs.speculative = True
        self.batches = BatchBuilder(
            config, self.grammars, self.outputs.eos_token_ids, self.routing_shape, self.speculator
        )
        self.scorer = Scorer(config, self.executor, self.batches)

    def _new_block_manager(self) -> BlockManager:
        """An empty block manager for the configured cache; the open sessions keep their priority in it."""
        cc = self.config.cache_config
        assert cc.num_kv_blocks is not None
        bm = BlockManager(
            cc.num_kv_blocks, cc.block_size, cc.enable_prefix_caching, int(cc.num_kv_blocks * cc.session_cache_fraction)
        )
        self.sessions.attach(bm)
        return bm

    def renew_kv_cache(self) -> None:
        """After the workers re-allocated their KV cache (wake_up): an empty block manager, on a fresh prefix-cache
        salt, for the scheduler and the engine."""
        self.block_manager = self._new_block_manager()
        self.block_manager.salt = self.weights.next_salt()
        self.scheduler.block_manager = self.block_manager

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
        """Raises ValueError for a prompt the engine cannot serve (see validation.py)."""
        validate_prompt(self.config, self.routing_shape, self.grammars, prompt_token_ids, params)

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
        self.lifecycle.settle_drain()
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
        outputs = self._run_batch(batch) if batch is not None else []
        self.lifecycle.settle_drain()
        return outputs

    def _run_batch(self, batch: SchedulerOutput) -> list[RequestOutput]:
        """Executes `batch`. Should it fail while the workers are healthy, each request is run on its own, so that
        only the requests that fail by themselves end (finish_reason 'abort', the error in `failed`); the other
        requests in flight go on. A failure of the workers themselves raises."""
        try:
            results = self.executor.collective_rpc("execute_model", (self.batches.build(batch, self._speculating),))[0]
        except Exception:
            if self.executor.health_problem() is not None:
                raise
            return self._run_isolated(batch)
        return self._postprocess(batch, results)

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
                results = self.executor.collective_rpc(
                    "execute_model", (self.batches.build(single, self._speculating),)
                )[0]
            except Exception as err:
                if self.executor.health_problem() is not None:
                    raise
                self.failed[request_id] = err
                out = self.abort_request(request_id)
                if out is not None:
                    outputs.append(out)
                continue
            outputs += self._postprocess(single, results)
        return outputs

    def take_error(self, request_id: str) -> BaseException | None:
        """The error that ended `request_id` (run on its own, it failed), once; None if it did not fail."""
        return self.failed.pop(request_id, None)

    def _postprocess(self, batch: SchedulerOutput, results: Samples | SpecOutput) -> list[RequestOutput]:
        """The scheduler's bookkeeping of a step that ran (tokens appended, forks, finishes), then the outputs of
        the requests it advanced."""
        drafting = self._speculating and self.config.speculative_config.uses_draft
        touched = self.scheduler.postprocess(batch, results, self._append, drafting, self.speculator)
        return self._outputs_of(touched)

    def _append(self, seq: Sequence, result: SampleResult) -> None:
        self.outputs.append(seq, result, self.weights.version)

    def _outputs_of(self, touched: list[Request]) -> list[RequestOutput]:
        outputs = []
        for request in touched:
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

    # ---- scoring (scoring.py) -------------------------------------------------------------------------------

    def score_probes(self, probes: list[list[int]]) -> list[list[float]]:
        """Each probe's logprobs of its tokens 1.. under the weights the workers hold now, in one forward pass,
        through KV blocks taken from the free ones and given back (nothing enters the prefix cache). Raises
        RuntimeError when the free KV cache cannot hold the probes. The post-update canary scores through it."""
        return self.scorer.probes(self.block_manager, probes)

    def score_tokens(
        self,
        sequences: list[list[int]],
        temperature: float = 1.0,
        top_logprobs: int = 0,
        top_k: int = -1,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ) -> list[TokenScores]:
        """Teacher scoring between steps, under the weights served now: see `Scorer.score_tokens` (scoring.py) for
        what it gives and refuses. A paused engine scores (its weights are valid); an engine updating its weights,
        asleep, or with invalid weights does not."""
        problem = self.health_problem()
        if problem is None and (self.is_asleep() or self.state is EngineState.UPDATING):
            problem = f"the engine is {self.state.value}"
        version = self.weights.version
        label = self.weights.labels.label(version)
        args = (sequences, temperature, top_logprobs, top_k, top_p, min_p)
        return self.scorer.score_tokens(self.block_manager, *args, problem=problem, version=version, label=label)

    # ---- health, config ------------------------------------------------------------------------------------

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

    # ---- the lifecycle (lifecycle.py), under the names the weights controller and the front ends use ---------

    @property
    def state(self) -> EngineState:
        """The engine state (state.py), moved by the lifecycle's transitions."""
        return self.lifecycle.state

    @property
    def released(self) -> set[str]:
        """While ASLEEP: what sleep() released, "kv_cache" and/or "weights"."""
        return self.lifecycle.released

    @property
    def pause_mode(self) -> str:
        """The latest pause's mode."""
        return self.lifecycle.pause_mode

    def enter_state(self, state: EngineState) -> None:
        self.lifecycle.enter_state(state)

    def leave_state(self, state: EngineState) -> None:
        self.lifecycle.leave_state(state)

    def serving_state(self) -> EngineState:
        return self.lifecycle.serving_state()

    def is_asleep(self) -> bool:
        return self.lifecycle.is_asleep()

    def refusing_new_requests(self) -> bool:
        return self.lifecycle.refusing_new_requests()

    def is_paused(self) -> bool:
        return self.lifecycle.is_paused()

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> list[RequestOutput]:
        """See `Lifecycle.pause`."""
        return self.lifecycle.pause(mode, clear_cache)

    def resume(self) -> None:
        self.lifecycle.resume()

    def sleep(self, level: int = 1) -> None:
        """See `Lifecycle.sleep`."""
        self.lifecycle.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """See `Lifecycle.wake_up`."""
        self.lifecycle.wake_up(tags)

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
        self.scheduler.check_integrity([seq for request in self.requests.values() for seq in request.seqs])

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
