"""The worker owns the model and its KV cache. The engine reaches it only through `collective_rpc`.

Every public method runs inside `use_config(self.config)` and `use_parallel(self.parallel)` (`scope.py`), restored
on return and on error: the contract of every entry point that loads, reloads or updates weights. The model's
layers do not read that scope: they take their settings when they are built (`hotswap/model/settings.py`) and a
pass's per-step data in a `StepContext` (`hotswap/model/step.py`). Within it, a transport that is not told its
device takes the engine's (`current_config_or_none`).

Weight lifecycle (hotswap/weights): every load, reload and transport update is a `WeightSource` applied by one
`WeightUpdate` through the worker's `WeightSession`.
- `load_model()` is always a full load.
- `reload_weights(...)` and the transfer session update parameters in place (storage never rebound), validate
  before they mutate, and in atomic mode roll back bit for bit on any failure. With atomic off, a failed update
  leaves the worker refusing to execute until a successful full reload.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hotswap.config import (
    EngineConfig,
    ParallelConfig,
    SpeculativeConfig,
    apply_overrides,
    available_memory_bytes,
    live_overrides,
    use_config,
)
from hotswap.device import cuda_kv_budget
from hotswap.distributed import SINGLE, ParallelContext, use_parallel
from hotswap.kernels import ops
from hotswap.kernels import packed as packing
from hotswap.kernels import policy as kernel_policy
from hotswap.lora.manager import LoRAManager
from hotswap.model.layers.fused_moe import FusedMoE
from hotswap.model.registry import build_model
from hotswap.model.settings import LayerSettings
from hotswap.weights.index import WeightIndex
from hotswap.weights.shadow import check_room
from hotswap.weights.update import folder_source, prefixed_source, random_source
from hotswap.wire import ModelInput, ModelOutput
from hotswap.worker.memory import discard_pages, huge_page_tensors, place_in_huge_pages
from hotswap.worker.model_runner import ModelRunner
from hotswap.worker.offload import Offloaded, offload, restore
from hotswap.worker.scope import in_config_scope
from hotswap.worker.session import SessionState, WeightSession
from hotswap.worker.speculative import SpeculativeStep
from hotswap.worker.weight_changes import DRAFT_PREFIX, WeightChanges, WeightState

__all__ = ["DRAFT_PREFIX", "WeightState", "Worker", "in_config_scope"]


class Worker(WeightChanges):
    """One rank's model, KV cache and weight changes (`WeightChanges`)."""

    def __init__(self, config: EngineConfig, rank: int = 0, parallel: ParallelContext = SINGLE) -> None:
        self.config = config
        self.rank = rank
        self.parallel = parallel
        self.model: nn.Module | None = None
        self.runner: ModelRunner | None = None
        self.session = WeightSession()
        self.offloaded: Offloaded | None = None  # a GPU's weights while asleep (hotswap/worker/offload.py)
        # speculative decoding with a draft model: its model, runner and config (model_config the draft's,
        # parallel_config the draft's layout; the other sections are the worker's own objects, so live changes
        # reach it); every draft operation runs inside `_draft_scope`
        self.draft_model: nn.Module | None = None
        self.draft_runner: ModelRunner | None = None
        self.draft_config: EngineConfig | None = None
        self.draft_parallel = SINGLE
        self.speculative: SpeculativeStep | None = None
        self.loras: LoRAManager | None = None  # with enable_lora
        self.last_update_parts: list[str] = []  # "model" / "draft": what the last finished update wrote

    # ---- model and cache ------------------------------------------------------------------------------------

    @in_config_scope
    def load_model(self) -> None:
        """Full load: builds the model and loads every weight from the configured checkpoint folder."""
        torch.manual_seed(self.config.model_config.seed)  # unseeded sampling draws from this process's generator
        mc = self.config.model_config
        if mc.device == "cpu":  # which native kernels win on this model's shapes and dtype (none run elsewhere)
            kernel_policy.prepare(mc.hf_config, mc.torch_dtype)
        model = build_model(self.config.model_config, LayerSettings.of(self.config, self.parallel))
        if self.config.load_config.huge_pages:
            place_in_huge_pages(model)
        index = WeightIndex.of(model)
        if self.config.load_config.load_format == "dummy":
            source = random_source({name: index.targets[name].full_shape for name in sorted(index.required)})
        else:
            source = folder_source(self.config.model_config.model)
        check = self.config.weight_transfer_config.check_finite and self.config.load_config.load_format != "dummy"
        with torch.no_grad():
            self.session.load(index, source, atomic=False, check_finite=check)
        self.model = model
        if self.config.weight_transfer_config.update_staging == "shadow":
            self._reserve_staging(index)
        self.runner = ModelRunner(self.config, model)
        if self.config.lora_config.enable_lora:
            self.loras = self.runner.loras = LoRAManager(
                model, mc.torch_dtype, self.config.lora_config.max_lora_rank, mc.device
            )
        if self.config.draft_model_config is not None:
            self._load_draft()
        self.session.weights_valid = True

    def _reserve_staging(self, index: WeightIndex) -> None:
        """Staged updates: the staging copies of every weight, allocated now and filled with the weights (their
        pages touched, in huge pages as the weights are), so that no update faults them in between two steps, and
        the commit's swap keeps the served weights in huge pages. Raises MemoryError where they do not fit."""
        named, seen = [], set()
        for module_name, module in index.modules.items():
            for name, param in module.named_parameters(recurse=False):
                if id(param) not in seen:  # a tied weight is staged once
                    seen.add(id(param))
                    named.append((f"{module_name}.{name}", param))
        check_room(index, set(index.modules), self.session.shadows)
        on_cpu = all(p.device.type == "cpu" for _, p in named)
        if on_cpu and self.config.load_config.huge_pages:
            buffers = huge_page_tensors([p.data for _, p in named])
        else:
            buffers = [torch.empty_like(p, requires_grad=False) for _, p in named]
        with torch.no_grad():
            for (key, param), buffer in zip(named, buffers, strict=True):
                ops.copy_(buffer, param.data)
                self.session.shadows[key] = buffer

    def _load_draft(self) -> None:
        """Builds the draft model in its own scope and loads its folder in full."""
        spec, dmc = self.config.speculative_config, self.config.draft_model_config
        assert dmc is not None and self.runner is not None
        sharded = spec.draft_tensor_parallel_size == self.parallel.size
        self.draft_parallel = self.parallel if sharded else SINGLE
        pc = self.config.parallel_config
        self.draft_config = dataclasses.replace(
            self.config,
            model_config=dmc,
            parallel_config=ParallelConfig(self.draft_parallel.size, pc.rpc_timeout_s),
            speculative_config=SpeculativeConfig(),
        )
        with self._draft_scope():
            draft = build_model(dmc, LayerSettings.of(self.draft_config, self.draft_parallel))
            if self.config.load_config.huge_pages:
                place_in_huge_pages(draft)
            self.draft_model = draft
            index = self._weight_index("draft")
            if self.config.load_config.load_format == "dummy":
                source = random_source({n: index.targets[n].full_shape for n in sorted(index.required)})
            else:
                source = prefixed_source(folder_source(dmc.model), DRAFT_PREFIX)
            check = self.config.weight_transfer_config.check_finite and self.config.load_config.load_format != "dummy"
            with torch.no_grad():
                self.session.load(index, source, atomic=False, check_finite=check)
            self.draft_runner = ModelRunner(self.draft_config, draft)
        self.speculative = SpeculativeStep(self.runner, self.draft_runner, self._draft_scope, self.parallel)

    @contextlib.contextmanager
    def _draft_scope(self) -> Iterator[None]:
        """The draft model's config and parallel context (inside the worker's own scope)."""
        assert self.draft_config is not None
        with use_config(self.draft_config), use_parallel(self.draft_parallel):
            yield

    @in_config_scope
    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit the configured budget, capped at what `max_num_seqs` full-length
        sequences can use."""
        runner = self._runner()
        cache = self.config.cache_config
        budget = cache.kv_cache_memory_bytes
        if budget is None and self.config.model_config.device != "cpu":
            budget = cuda_kv_budget(
                torch.cuda.get_device_properties(self.config.model_config.device).total_memory,
                cache.gpu_memory_utilization,
                self._profile_peak_bytes(),
            )
        if budget is None:
            budget = int(available_memory_bytes() * cache.memory_fraction)
        per_block = runner.bytes_per_block()
        if self.draft_runner is not None:  # the draft's cache is indexed by the same blocks
            per_block += self.draft_runner.bytes_per_block()
        max_len = self.config.model_config.max_model_len or 1
        cap = self.config.scheduler_config.max_num_seqs * math.ceil(max_len / cache.block_size)
        return min(budget // per_block, cap)

    def _profile_peak_bytes(self) -> int:
        """GPU: the device memory the engine takes at its busiest, measured as vLLM does: the peak of one forward
        over `max_num_batched_tokens` prompt tokens (on a scratch cache just large enough), plus the logits of
        `max_num_seqs` rows in float32 twice over (the sampler's copy). The scratch cache is freed after."""
        runner = self._runner()
        device = self.config.model_config.device
        sc, block = self.config.scheduler_config, self.config.cache_config.block_size
        tokens = min(sc.max_num_batched_tokens or 2048, self.config.model_config.max_model_len or 2048)
        blocks = math.ceil(tokens / block)
        runners: list[tuple[ModelRunner, Callable[[], contextlib.AbstractContextManager[object]]]] = [
            (runner, contextlib.nullcontext)
        ]
        if self.draft_runner is not None:
            runners.append((self.draft_runner, self._draft_scope))
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            for r, scope in runners:
                with scope():
                    r.allocate_kv_cache(blocks)
                    r.forward(
                        [0] * tokens, list(range(tokens)), [tokens], [tokens], [list(range(blocks))], [tokens - 1]
                    )
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        finally:
            for r, _ in runners:
                r.free_kv_cache()
            torch.cuda.empty_cache()
        vocab = int(self.config.model_config.hf_config.get("vocab_size", 0))
        return int(peak + 2 * 4 * sc.max_num_seqs * vocab)

    @in_config_scope
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocates the KV cache; before any request, the native decoder stack is timed on it (see
        `ModelRunner.calibrate_stack`)."""
        runner = self._runner()
        runner.allocate_kv_cache(num_blocks)
        if self.draft_runner is not None:
            with self._draft_scope():
                self.draft_runner.allocate_kv_cache(num_blocks)
        runner.calibrate_stack()

    @in_config_scope
    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        self._check_awake("execute_model")
        if not self.session.weights_valid:
            raise RuntimeError(
                "the weights are inconsistent after a failed non-atomic update; call reload_weights() to restore "
                "a full checkpoint before generating"
            )
        runner = self._runner()
        if model_input.spec is not None:
            if self.speculative is None:
                self.speculative = SpeculativeStep(runner, None, contextlib.nullcontext, self.parallel)
            return self.speculative.run(model_input)
        if self.draft_runner is not None:  # copy-on-write reaches the draft's cache, speculating or not
            self.draft_runner.copy_blocks(model_input.block_copies)
        results = runner.execute(model_input)
        if model_input.draft_prefill and self.speculative is not None and self.draft_runner is not None:
            self.speculative.prefill_draft(model_input)
        return results

    @in_config_scope
    def execute_method(self, /, method: str | Callable[..., Any], *args: object, **kwargs: object) -> Any:
        """Calls a Worker method by name, or `method(self, *args, **kwargs)` for a callable. After a callable,
        the runner's native decoder stack, which keeps what it checked on the modules (e.g. that no forward hook
        is set), is told that user code ran on the model, and its CUDA graphs are dropped (captured again)."""
        if callable(method):
            try:
                return method(self, *args, **kwargs)
            finally:
                if self.runner is not None:
                    self.runner.stack.user_code_ran()
                    if self.runner.graphs is not None:
                        self.runner.graphs.invalidate()
                for model in (self.model, self.draft_model):
                    if model is not None:
                        packing.drop_all(model)  # the code may have written weights
        if method.startswith("_") or not callable(getattr(self, method, None)):
            raise ValueError(f"Worker has no public method {method!r}")
        bound = getattr(self, method)
        inner = getattr(bound, "__wrapped__", None)  # an entry point's body: this call is already in its scope
        return inner(self, *args, **kwargs) if inner is not None else bound(*args, **kwargs)

    # ---- in-place reload and live config --------------------------------------------------------------------

    @in_config_scope
    def update_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        """Applies `{section: {field: value}}` to the live config after validating it like construction.
        Raises ValueError for unknown sections or fields, invalid values, or fields that cannot change live
        (those need a new engine)."""
        self.session.expect(SessionState.NO_ENGINE, SessionState.READY, call="update_config")
        sections = live_overrides(self.config, overrides)
        previous = {name: copy.deepcopy(getattr(self.config, name)) for name in sections}
        placement = self.config.parallel_config.expert_placement
        apply_overrides(self.config, sections)
        if self.model is not None and self.config.parallel_config.expert_placement != placement:
            try:
                self._move_experts()
            except BaseException:
                apply_overrides(self.config, previous)  # the whole change is refused, on every rank
                raise

    def _move_experts(self) -> None:
        """Moves every MoE layer's experts to the live placement, all layers on all ranks or none: every layer's
        new experts are gathered from the ranks first (collectives that change nothing), then the ranks agree
        that all of them gathered (an all-reduce of their verdicts), and only then does every layer take them."""
        layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)] if self.model is not None else []
        gathered: list[tuple[FusedMoE, dict[str, torch.Tensor] | None]] = []
        error: BaseException | None = None
        try:
            gathered = [(layer, layer.gather_placement()) for layer in layers]
        except Exception as err:
            error = err
        ok = self.parallel.all_reduce(torch.tensor([0 if error is not None else 1]))
        if error is not None:
            raise error
        if int(ok.item()) != self.parallel.size:
            raise RuntimeError("moving the experts failed on another rank; the previous placement stays")
        for layer, moved in gathered:
            if moved is not None:
                layer.take_placement(moved)
        if self.model is not None:
            self.model.__dict__.pop("_hotswap_weight_index", None)  # the local views changed
        if self.loras is not None:  # adapters' expert factors follow the experts this rank now holds
            for adapter in self.loras.adapters.values():
                adapter.invalidate_packs()
                adapter.packs()
        self.session.release_backups()

    # ---- sleep and wake ---------------------------------------------------------------------------------------

    @in_config_scope
    def sleep(self, level: int = 1) -> int:
        """Frees the KV cache (level 1), and at level 2 also the weights' memory: parameters keep their storage
        but its pages go back to the OS and read as zeros, so the worker refuses to execute until a reload or a
        full update. Rollback buffers and staging copies are freed too. On a GPU (vLLM's way) level 1 also moves
        the weights to page-locked host memory and frees their device memory, and level 2 frees it without a
        copy; either way the worker refuses every call that reads or writes them until wake_up(["weights"]),
        which gives them new device memory (the decode graphs are captured again). Returns the bytes released
        from weights."""
        self.session.expect(SessionState.NO_ENGINE, SessionState.READY, call="sleep")
        self._runner().free_kv_cache()
        if self.draft_runner is not None:
            self.draft_runner.free_kv_cache()
        model = self._model()
        self.session.release_backups()
        packing.drop_all(model)  # the packed copies' memory goes too (they are rebuilt on first use)
        if self.draft_model is not None:
            packing.drop_all(self.draft_model)
        params = list(model.parameters())
        if self.draft_model is not None:
            params += list(self.draft_model.parameters())
        if self.config.model_config.device != "cpu":
            if self.offloaded is None:
                self.offloaded = offload(params, keep=level == 1, pin=True)
            if level >= 2:  # (deeper after level 1: the host copy comes back at wake, but counts as invalid)
                self.session.invalidate()
            return self.offloaded.bytes_released
        released = 0
        if level >= 2:
            with torch.no_grad():
                for param in params:
                    released += discard_pages(param.data)
            self.session.invalidate()
        return released

    @in_config_scope
    def wake_up(self, tags: list[str]) -> None:
        """Re-allocates the KV cache ("kv_cache"), and on a GPU the weights' device memory ("weights": their
        host copy back after level 1; zeros after level 2, until a reload or a full update). On the CPU weights
        released at level 2 come back with a reload or a full update after wake_up(["weights"]); their storage
        never moved."""
        if "weights" in tags and self.offloaded is not None:
            restore(self.offloaded)
            self.offloaded = None
        runner = self._runner()
        if "kv_cache" in tags and not runner.kv_caches:
            runner.allocate_kv_cache(runner.num_blocks)
            if self.draft_runner is not None:
                with self._draft_scope():
                    self.draft_runner.allocate_kv_cache(runner.num_blocks)

    @in_config_scope
    def shard_plan(self) -> dict[str, list[tuple[int, int, int]]]:
        """Per checkpoint tensor name, the (dim, start, length) narrowings that cut this rank's part out of the
        full tensor (empty: the rank holds it whole). A trainer uses it to send pre-sliced tensors."""
        index = self._index()
        return {name: index.targets[name].narrowings() for name in sorted(index.required)}

    # ---- copying weights between engines of one config (a fleet's restarted replica) --------------------------

    @in_config_scope
    def export_state(self) -> dict[str, torch.Tensor]:
        """Host copies of this rank's parameters and persistent buffers by name, the draft's under "draft."
        (a live replica on a GPU does not double its device memory)."""
        self._check_awake("export_state")
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in self._tensors().items()}

    @in_config_scope
    def import_state(self, states: list[dict[str, torch.Tensor]]) -> None:
        """Copies `states[rank]` into this rank's tensors in place. Raises ValueError, changing nothing, unless
        every name, shape and dtype matches."""
        self._check_awake("import_state")
        given, mine = states[self.rank], self._tensors()
        if given.keys() != mine.keys():
            missing, extra = sorted(mine.keys() - given.keys()), sorted(given.keys() - mine.keys())
            raise ValueError(f"the weights name other tensors (missing {missing[:5]}, unexpected {extra[:5]})")
        for name, tensor in given.items():
            if tensor.shape != mine[name].shape or tensor.dtype != mine[name].dtype:
                raise ValueError(
                    f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the engine holds "
                    f"{tuple(mine[name].shape)} {mine[name].dtype}"
                )
        with torch.no_grad():
            for name, tensor in given.items():
                mine[name].copy_(tensor)

    # ---- helpers --------------------------------------------------------------------------------------------

    def _tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers by name, the draft's under "draft." (not copies)."""
        state = dict(self._model().state_dict())
        if self.draft_model is not None:
            state.update({f"{DRAFT_PREFIX}{k}": v for k, v in self.draft_model.state_dict().items()})
        return state

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the model is not loaded; call load_model() first")
        return self.runner
