"""The offline `LLM` entry point, with vLLM's names."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

import torch
from torch import nn
from tqdm.auto import tqdm

from hotswap.config import EngineConfig
from hotswap.engine.async_llm_engine import engine_status
from hotswap.engine.client import EngineStatus, LLMClient
from hotswap.engine.llm_engine import LLMEngine
from hotswap.engine.lora_registry import LoRARegistry
from hotswap.engine.weights_controller import WeightsController
from hotswap.errors import EngineUnavailable, EngineUnresponsive
from hotswap.executor.base import RpcMethod
from hotswap.inputs import PromptType, Tokenizer, chat_prompts, per_prompt, per_prompt_lora, stage
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput, TokenScores
from hotswap.sampling_params import SamplingParams
from hotswap.weights.target import check_target
from hotswap.weights.version import VersionArg

if TYPE_CHECKING:
    from hotswap.fleet import Fleet

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


def _locked(method: Callable[Concatenate[S, P], R], of: Callable[[LLM], S]) -> Callable[Concatenate[LLM, P], R]:
    """`method` of the object `of(llm)` (the engine, or its weights controller) as a method of `LLM`, run under its
    lock (same parameters, result and docstring): a "locked" verb of `hotswap.engine.client.VERBS`."""

    def call(self: LLM, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            return method(of(self), *args, **kwargs)

    functools.update_wrapper(call, method)
    call.__dict__["__verb__"] = "locked"  # its kind in the verb table
    return call


def _weights(llm: LLM) -> WeightsController:
    return llm.llm_engine.weights


def _engine(llm: LLM) -> LLMEngine:
    return llm.llm_engine


def _wants_fleet(kwargs: dict[str, Any]) -> bool:
    """Whether `LLM`'s keyword arguments ask for a fleet of replicas. Raises ValueError for an unknown backend."""
    backend = kwargs.get("distributed_executor_backend")
    if backend not in (None, "mp", "uni", "ray"):
        raise ValueError(f"distributed_executor_backend must be 'mp', 'uni' or 'ray', got {backend!r}")
    return bool(kwargs.get("data_parallel_size", 1) != 1 or backend == "ray")


class _HandoverLock:
    """The `LLM`'s lock: re-entrant, and fair to threads that ask for it while a generate() steps.

    Python's locks are not fair: a step loop that releases the lock after each step and takes it again at once can
    keep another thread (a pause, an update) out until the whole generation ends. So a thread asks through
    `with lock:`, which counts it as waiting, and the step loop takes its turn through `step_turn()`, which hands
    the lock to every waiting thread before it returns."""

    def __init__(self) -> None:
        self.raw = threading.RLock()
        self.changed = threading.Condition(self.raw)  # waits release the lock entirely, as the step loop needs
        self._count = threading.Lock()
        self._waiting = 0  # threads inside __enter__ that have not got the lock yet

    def __enter__(self) -> None:
        with self._count:
            self._waiting += 1
        try:
            self.raw.acquire()
        finally:
            with self._count:
                self._waiting -= 1

    def __exit__(self, *exc: object) -> None:
        self.raw.release()

    def acquire(self, timeout: float) -> bool:
        """`with lock:`'s entry, giving up after `timeout` seconds (False: not taken)."""
        with self._count:
            self._waiting += 1
        try:
            return self.raw.acquire(timeout=timeout)
        finally:
            with self._count:
                self._waiting -= 1

    @property
    def waiting(self) -> int:
        """How many threads are asking for the lock now."""
        return self._waiting

    @contextlib.contextmanager
    def step_turn(self) -> Iterator[None]:
        """Holds the lock for one step of a generate() loop, after every thread that asked for it had its turn."""
        with self.raw:
            while self._waiting:
                self.changed.wait(0.005)
            yield


class LLM:
    """Loads a Hugging Face checkpoint folder and generates from it: one engine in this process.

    Keyword arguments are the fields of the config sections (dtype, max_model_len, block_size,
    enable_prefix_caching, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens, seed, ...); an
    unknown one raises TypeError and an invalid value ValueError. `LLM.create(...)` takes the same arguments and
    builds a `hotswap.fleet.Fleet` when they ask for replicas (`data_parallel_size` > 1, or
    `distributed_executor_backend="ray"`); `LLM(...)` refuses those with a ValueError that names `LLM.create`.
    """

    @staticmethod
    def create(model: str, **kwargs: Any) -> LLMClient:
        """The `LLMClient` a configuration asks for: an `LLM` (one engine), or with `data_parallel_size` > 1 (or
        `distributed_executor_backend` "ray") a `hotswap.fleet.Fleet` of that many replicas on Ray, which has
        `LLM`'s methods; the fleet's own settings (`num_gpus_per_worker`, `ray_init_kwargs`, ...) pass through."""
        if _wants_fleet(kwargs):
            from hotswap.fleet import Fleet

            kwargs.pop("distributed_executor_backend", None)
            return Fleet(model, num_replicas=kwargs.pop("data_parallel_size", 1), **kwargs)
        return LLM(model, **kwargs)

    def __init__(self, model: str, **kwargs: Any) -> None:
        if _wants_fleet(kwargs):
            raise ValueError(
                f"LLM(...) runs one engine; data_parallel_size={kwargs.get('data_parallel_size', 1)!r} with "
                f"distributed_executor_backend={kwargs.get('distributed_executor_backend')!r} asks for a fleet of "
                "replicas: build it with LLM.create(...) (or hotswap.fleet.Fleet(model, num_replicas=N))"
            )
        kwargs.pop("distributed_executor_backend", None)  # one replica runs its workers as local processes
        kwargs.pop("data_parallel_size", None)
        self.config = EngineConfig.from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine(self.config)
        # generate() may run in one thread while another pauses, updates or resumes: engine state is only
        # touched under this lock, and a paused generate() waits on the condition (releasing the lock).
        self._lock = _HandoverLock()
        self._changed = self._lock.changed
        self._finished: dict[str, RequestOutput] = {}  # final outputs not yet taken by their generate() call

    def status(self) -> EngineStatus:
        """The engine's state now (`EngineStatus`: versions, pause, sleep, health, load, the open change); answers
        at once, without the lock."""
        return engine_status(self.llm_engine)

    def shutdown(self) -> None:
        """Stops worker processes (tensor parallelism); also happens when the LLM is garbage-collected."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        tokenizer: Tokenizer = self.llm_engine.tokenizer
        return tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for each prompt (a string or {"prompt_token_ids": [...]}, optionally with a "cache_salt" and a
        "session_id": see hotswap/engine/sessions.py) and
        returns outputs in prompt order. `sampling_params` is one for all prompts or one per prompt. Every prompt
        is validated before any is queued, so a bad one raises ValueError and leaves the engine as it was.
        `lora_request`: the LoRA adapter for all prompts, or one (or None) per prompt; an adapter named for the
        first time is loaded from its `lora_path`.

        Never blocks for ever: on a paused engine a new call raises `EngineUnavailable` at once (resume first);
        a call whose requests a pause (from another thread) freezes waits for the resume at most `rpc_timeout_s`,
        then raises `TimeoutError` and aborts its requests."""
        prompts, params_list = per_prompt(prompts, sampling_params)
        engine = self.llm_engine
        if engine.is_paused() or engine.refusing_new_requests():
            raise EngineUnavailable(
                f"generation is paused ({engine.pause_mode!r}); call resume_generation() before generating"
            )
        staged = [stage(prompt, self.get_tokenizer()) for prompt in prompts]
        for prompt, params in zip(staged, params_list, strict=True):
            engine.validate_prompt(prompt.token_ids, params)
        loras = per_prompt_lora(lora_request, len(staged))
        ids = []
        with self._lock:
            for wanted in {r for r in loras if r is not None}:
                engine.resolve_lora(wanted)  # every adapter is had before any request is queued
            for prompt, params, lora in zip(staged, params_list, loras, strict=True):
                request_id = engine.next_request_id()
                engine.add_request(
                    request_id,
                    prompt.text,
                    prompt.token_ids,
                    params,
                    cache_salt=prompt.cache_salt,
                    validated=True,
                    session_id=prompt.session_id,
                    lora_request=lora,
                )
                ids.append(request_id)
        return self._run(ids, use_tqdm)

    def score_tokens(
        self,
        sequences: list[list[int]],
        *,
        temperature: float = 1.0,
        top_logprobs: int = 0,
        top_k: int = -1,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ) -> list[TokenScores]:
        """Teacher scoring without generating: for each token sequence, each token's logprob given the tokens
        before it under log_softmax(logits / temperature) after top-k/top-p/min-p, its rank, and the
        `top_logprobs` most likely tokens per position (-1: the whole vocabulary; bounded by `max_logprobs`), as
        arrays (`TokenScores`; see `LLMEngine.score_tokens` for the contract). Runs between steps of any
        generate() in other threads (and on a paused engine); bad input raises ValueError and changes nothing;
        an open weight update, sleep or invalid weights RuntimeError."""
        with self._lock:
            return self.llm_engine.score_tokens(sequences, temperature, top_logprobs, top_k, top_p, min_p)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation or a list of them, then generates."""
        prompts = chat_prompts(self.get_tokenizer(), messages, add_generation_prompt, chat_template)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Steps the engine until these requests finish. The lock is held for one step at a time, so other
        threads (another generate, pause, an update) interleave between steps; finished outputs go to a shared
        table from which each caller takes its own."""
        engine = self.llm_engine
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        bound = self.llm_engine.config.parallel_config.rpc_timeout_s
        paused_since: float | None = None
        try:
            while len(done) < len(wanted):
                with self._lock.step_turn():
                    for request_id in wanted & self._finished.keys():
                        done[request_id] = self._finished.pop(request_id)
                        bar.update(1)
                        error = engine.take_error(request_id)
                        if error is not None:  # this request failed on its own; other callers' requests go on
                            raise error
                    if len(done) == len(wanted):
                        break
                    if engine.is_asleep():
                        raise RuntimeError("the engine is asleep; call wake_up() before generating")
                    if not engine.state.steps:
                        now = time.monotonic()  # only a pause is bounded here (an update ends by itself)
                        paused_since = (now if paused_since is None else paused_since) if engine.is_paused() else None
                        if paused_since is not None and now - paused_since > bound:
                            raise TimeoutError(
                                f"generation stayed paused for more than {bound:g} s (rpc_timeout_s)"
                                "; call resume_generation() from another thread"
                            )
                        self._changed.wait(0.05)  # until resume_generation() / the update, from another thread
                        continue
                    paused_since = None
                    for out in engine.step():
                        if out.finished:
                            self._finished[out.request_id] = out
                    self._changed.notify_all()
        except BaseException:
            with self._lock:
                for request_id in wanted:
                    engine.abort_request(request_id)
                    self._finished.pop(request_id, None)
                    engine.take_error(request_id)
            raise
        finally:
            bar.close()
        return [done[r] for r in request_ids]

    # ---- pause, resume, sleep -----------------------------------------------------------------------------------

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pauses generation: 'abort' ends requests now (finish_reason 'abort', partial output kept), 'wait' lets
        requests in flight finish first (returns when they have), 'keep' freezes them until resume (with
        `clear_cache`, their KV is recomputed under the weights live at resume)."""
        with self._lock:
            for out in self.llm_engine.pause(mode, clear_cache):
                self._finished[out.request_id] = out
            while not self.llm_engine.is_paused():  # 'wait': DRAINING until the stepping generate() drains it
                self._changed.wait(0.05)
            self._changed.notify_all()

    def resume_generation(self) -> None:
        with self._lock:
            self.llm_engine.resume()
            self._changed.notify_all()

    def is_paused(self) -> bool:
        return self.llm_engine.is_paused()

    sleep = _locked(LLMEngine.sleep, _engine)

    def wake_up(self, tags: list[str] | None = None) -> None:
        with self._lock:
            self.llm_engine.wake_up(tags)
            self._changed.notify_all()

    def collective_rpc(
        self,
        method: RpcMethod,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Runs a Worker method (by name, or a callable taking the worker first) on every worker."""
        return self.llm_engine.executor.collective_rpc(method, args, kwargs, timeout)

    def apply_model(self, func: Callable[[nn.Module], object]) -> list[Any]:
        """Calls `func(model)` on every worker's `nn.Module`; one result per worker."""
        return self.collective_rpc(_ApplyModel(func))

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache(force=True)

    # ---- the weight lifecycle (see Worker for the contracts) ----------------------------------------------------

    def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        target: str = "model",
        weight_version: VersionArg = None,
        encoding: str | None = None,
        base_version: VersionArg = None,
        checksums: dict[str, str] | None = None,
    ) -> None:
        """Updates the weights in place from a checkpoint folder, from (name, tensor) pairs (e.g. a trainer's
        `model.named_parameters()`), or from the current folder. Advances the weight version on success (or
        takes `weight_version`: an integer or a label).
        `target` "draft": the speculative draft model's weights (its own names) instead. `encoding` "xor",
        "sparse" or "overwrite": the tensors are a delta (docs/weight-sync.md), refused unless `base_version`
        (when given) is the served version; `checksums`: the trainer's SHA-256 of each result, verified before
        the commit (a mismatch rolls back)."""
        with self._lock:
            self.llm_engine.weights.reload_weights(
                weights_path=weights_path,
                weights_iterator=weights_iterator,
                target=target,
                weight_version=weight_version,
                encoding=encoding,
                base_version=base_version,
                checksums=checksums,
            )

    # ---- LoRA adapters (hotswap/lora; enable_lora=True) ----------------------------------------------------------

    def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        load_inplace: bool = False,
        tensors: dict[str, torch.Tensor] | None = None,
        peft_config: dict[str, Any] | None = None,
        lora_int_id: int | None = None,
        pinned: bool = False,
    ) -> dict[str, Any]:
        """Loads adapter `lora_name` from a PEFT folder, or from `tensors` (PEFT names) and `peft_config`
        (adapter_config.json's fields). A loaded name is refused unless `load_inplace`: then the new weights become
        its next version (requests running on the old one finish on it, or switch, per lora_version_policy).
        Returns the adapter's description. Raises ValueError naming the problem; nothing changes then."""
        with self._lock:
            registry = self._registry()
            adapter = registry.load(lora_name, lora_path, tensors, peft_config, lora_int_id, load_inplace, pinned)
            return registry.description(adapter.name)

    def prepare_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        load_inplace: bool = False,
        tensors: dict[str, torch.Tensor] | None = None,
        peft_config: dict[str, Any] | None = None,
        lora_int_id: int | None = None,
        pinned: bool = False,
    ) -> None:
        """Phase one of `load_lora_adapter` (a fleet loads on every replica or on none): the new version is loaded
        on every worker, nothing served changes until `commit_lora_adapter(lora_name)`, or
        `abort_lora_adapter(lora_name)` drops it. Raises ValueError as `load_lora_adapter` does."""
        with self._lock:
            registry = self._registry()
            registry.hold(
                registry.prepare(lora_name, lora_path, tensors, peft_config, lora_int_id, load_inplace, pinned)
            )

    def commit_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Phase two: the prepared version of `lora_name` is served from now on; returns its description."""
        with self._lock:
            registry = self._registry()
            return registry.description(registry.commit_held(lora_name).name)

    def abort_lora_adapter(self, lora_name: str) -> bool:
        """Drops a prepared load of `lora_name`; False if none was prepared."""
        with self._lock:
            return self._registry().abort_held(lora_name)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Forgets adapter `lora_name`; requests running on it finish on their version."""
        with self._lock:
            self._registry().unload(lora_name)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's `add_lora`: loads the adapter a LoRARequest names (from its path) unless it is loaded."""
        with self._lock:
            self.llm_engine.resolve_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's `remove_lora`: unloads the adapter with integer id `lora_id`; False if none has it."""
        with self._lock:
            registry = self._registry()
            for adapter in list(registry.adapters.values()):
                if adapter.int_id == lora_id:
                    registry.unload(adapter.name)
                    return True
        return False

    def list_loras(self) -> list[dict[str, Any]]:
        """Per loaded adapter: lora_name, lora_int_id, version, rank, lora_path, pinned."""
        with self._lock:
            return self._registry().describe()

    def _registry(self) -> LoRARegistry:
        if self.llm_engine.loras is None:
            raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True")
        return self.llm_engine.loras

    def check_liveness(self, timeout_s: float = 5.0) -> float:
        """A no-op round trip through every worker, once the engine is between steps; returns its seconds.
        Raises EngineUnresponsive when that takes longer than `timeout_s` (a worker that misses the deadline is
        declared dead, as any call that outlives its timeout)."""
        start = time.monotonic()
        if not self._lock.acquire(timeout_s):
            raise EngineUnresponsive(f"the engine did not come between steps within {timeout_s:g} s")
        try:
            self.llm_engine.check_liveness(max(1.0, timeout_s - (time.monotonic() - start)))  # a fair round trip
        finally:
            self._lock.raw.release()
        return time.monotonic() - start

    update_config = _locked(LLMEngine.update_config, _engine)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Creates the receiving side of a transport: {"backend": "tensors" | "shm" | "torch_dist" | "disk", ...}.
        Returns once it connected to its trainer; meanwhile the lock is taken only to poll, so other threads'
        calls (generate) go on."""
        with self._lock:
            self.llm_engine.weights.begin_weight_transfer_engine(init_info)
        while True:
            with self._lock:
                if self.llm_engine.weights.weight_transfer_ready():
                    return
            time.sleep(0.005)

    # The transfer session's calls take the lock, so they land between steps of other threads' generate().
    start_weight_update = _locked(WeightsController.start_weight_update, _weights)
    update_weights = _locked(WeightsController.update_weights, _weights)
    finish_weight_update = _locked(WeightsController.finish_weight_update, _weights)
    abort_weight_update = _locked(WeightsController.abort_weight_update, _weights)
    shutdown_weight_transfer_engine = _locked(WeightsController.shutdown_weight_transfer_engine, _weights)

    def get_weight_version(self, target: str = "model") -> int:
        """The served weights' version; `target` "draft": the target version the speculative draft was last
        updated for (it is stale while the two differ)."""
        check_target(target, ("model", "draft"))
        return self.llm_engine.draft_weight_version if target == "draft" else self.llm_engine.weight_version

    def get_weight_version_label(self) -> str:
        """The served version as clients see it: the label given to it, or its integer as a string."""
        return self.llm_engine.weight_version_label

    def update_weight_version(self, new_version: int | str, abort_all_requests: bool = False) -> str:
        """Renames the served version (vLLM's and SGLang's `update_weight_version`): weights and requests are not
        touched unless `abort_all_requests`, which ends every request (finish_reason 'abort', partial output
        returned to its caller). Returns the new label."""
        with self._lock:
            self.llm_engine.weights.rename(new_version)
            if abort_all_requests:
                for request_id in list(self.llm_engine.requests):
                    out = self.llm_engine.abort_request(request_id)
                    if out is not None:
                        self._finished[request_id] = out
                self._changed.notify_all()
            return self.llm_engine.weight_version_label

    def weight_checksums(self, target: str = "model") -> dict[str, str]:
        """SHA-256 of each parameter's bytes (rank 0); `target` "draft" / "all": the draft's too ("draft.<name>")."""
        return cast("dict[str, str]", self.collective_rpc("weight_checksums", (target,))[0])


class _ApplyModel:
    def __init__(self, func: Callable[[nn.Module], object]) -> None:
        self.func = func

    def __call__(self, worker: Any) -> object:
        return self.func(worker.model)


def _implements_llm_client(llm: LLM, fleet: Fleet) -> tuple[LLMClient, LLMClient]:
    """Never called: mypy checks here that both sync front ends implement `LLMClient`."""
    return llm, fleet
