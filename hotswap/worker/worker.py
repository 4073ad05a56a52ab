"""The worker owns the model and its KV cache. The engine reaches it only through `collective_rpc`.

Every public method runs inside `use_config(self.config)`, so code deep in a layer can call
`current_config()`; the previous context is restored on return and on error.

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
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

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
from hotswap.lora.peft_format import canonical_name
from hotswap.model.layers.fused_moe import FusedMoE
from hotswap.model.registry import build_model
from hotswap.model.settings import LayerSettings
from hotswap.weights.checksum import tensor_sha256
from hotswap.weights.delta import is_delta
from hotswap.weights.index import WeightIndex
from hotswap.weights.shadow import check_room
from hotswap.weights.target import check_target
from hotswap.weights.update import (
    RankSelection,
    chunked_copies,
    folder_source,
    pairs_source,
    prefixed_source,
    prefixer,
    random_source,
)
from hotswap.wire import ModelInput, ModelOutput
from hotswap.worker.memory import discard_pages, huge_page_tensors, place_in_huge_pages
from hotswap.worker.model_runner import ModelRunner
from hotswap.worker.offload import Offloaded, offload, restore
from hotswap.worker.session import SessionState, WeightSession
from hotswap.worker.speculative import SpeculativeStep

DRAFT_PREFIX = "draft."  # the draft model's checkpoint names, where one update carries both models

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class WeightState:
    """What the engine asks a worker after a weight change."""

    valid: bool  # False after a failed non-atomic update or sleep(2), until a full update or reload
    updated_parts: list[str]  # "model" / "draft": what the last committed update wrote


def in_config_scope(method: F) -> F:
    """Runs a Worker method inside its config context."""

    @functools.wraps(method)
    def wrapper(self: Worker, *args: Any, **kwargs: Any) -> Any:
        with use_config(self.config), use_parallel(self.parallel):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class Worker:
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
        self._session_target = "model"  # or "lora": the session loads the pending adapter version
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
        runners: list[tuple[ModelRunner, Callable[[], contextlib.AbstractContextManager[Any]]]] = [
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

    def _check_awake(self, call: str) -> None:
        """Raises RuntimeError while sleep took the weights' device memory (a GPU): nothing may read or write
        them until wake_up(["weights"])."""
        if self.offloaded is not None:
            raise RuntimeError(
                f"{call}() while asleep: the weights' device memory was released; call wake_up(['weights']) first"
            )

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
    def execute_method(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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
    def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        commit: bool = True,
        target: str = "model",
        encoding: str | None = None,
        checksums: dict[str, str] | None = None,
        sliced: bool = False,
    ) -> int:
        """Updates the weights in place from a checkpoint folder (`weights_path`, recorded as the model folder on
        success), from (name, tensor) pairs (`weights_iterator`, may be partial), or with neither from the
        current folder. Returns the number of tensors loaded. Validates before mutating; see the module doc for
        failure behaviour. `commit` False keeps the update open with its rollback copies until
        `finish_weight_update()` or `abort_weight_update()` (how the engine makes worker processes change
        together), and leaves recording a new folder to the caller. `target` "draft" reloads the speculative draft
        model instead (its own checkpoint names, in its config scope). `encoding` / `checksums`: the tensors are a
        delta, and the trainer's digests of the results (hotswap/weights/delta.py). `sliced` (a staged engine,
        `commit` False): the reload is only opened; `advance_weight_update` receives it."""
        self.session.expect(SessionState.NO_ENGINE, SessionState.READY, call="reload_weights")
        self._check_awake("reload_weights")
        check_target(target, ("model", "draft"), "reload_weights target")
        if weights_path is not None and weights_iterator is not None:
            raise ValueError("give weights_path or weights_iterator, not both")
        config = self._config_of(target)
        delta = is_delta(encoding)
        if weights_iterator is not None:
            source = pairs_source(weights_iterator)
        elif delta:  # a folder of delta tensors: no config of its own, never the model's folder
            if weights_path is None:
                raise ValueError(f"encoding {encoding!r} needs the delta's tensors (weights_path or weights_iterator)")
            source = folder_source(str(weights_path), complete=False)
        else:
            if weights_path is not None:
                live_overrides(config, {"model_config": {"model": str(weights_path)}})  # same model shape
            source = folder_source(str(weights_path or config.model_config.model))
        wt = self.config.weight_transfer_config
        update = self.session.load(
            self._weight_index(target),
            source,
            wt.atomic,
            wt.check_finite,
            commit=commit,
            encoding={"encoding": encoding, "checksums": checksums},
            rename=prefixer(DRAFT_PREFIX) if target == "draft" else None,
            staged=wt.update_staging == "shadow",
            sliced=sliced,
            backup_device=wt.backup_device,
        )
        if weights_path is not None and commit and not delta:  # uncommitted: the engine records it once committed
            self._record_folder(str(weights_path), target)
        return len(update.loaded_names)

    def _record_folder(self, folder: str, target: str = "model") -> None:
        """Records `folder` as the checkpoint of the target model or the draft (after a committed reload)."""
        if target == "draft":
            assert self.draft_config is not None
            self.draft_config.model_config.model = folder
            self.config.speculative_config.model = folder
        else:
            self.config.model_config.model = folder

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

    # ---- the weight-transfer session --------------------------------------------------------------------------

    @in_config_scope
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Creates the receiving engine of `init_info["backend"]` (tensors, shm, torch_dist, disk). Returns without
        waiting for a trainer to connect: poll `weight_transfer_ready()`."""
        self.session.init_engine(init_info, self.config.weight_transfer_config)

    @in_config_scope
    def weight_transfer_ready(self) -> bool:
        """Whether the transfer engine has connected to its trainer; raises (and drops the engine) if connecting
        failed or timed out."""
        return self.session.engine_ready()

    @in_config_scope
    def start_weight_update(self, target: str = "model") -> None:
        """Opens an update session; in atomic mode, everything overwritten until finish is kept for rollback.
        `target`: "model" (the served model), "draft" (the speculative draft) or "all" (both, committed or rolled
        back together; draft tensors are named "draft.<name>" or sent in update calls with "target": "draft")."""
        self._check_awake("start_weight_update")
        self.session.start(self._weight_index(target), self.config.weight_transfer_config)  # raises for a bad target
        self._session_target = target

    @in_config_scope
    def update_weights(self, update_info: dict[str, Any], sliced: bool = False) -> int:
        """Receives one update of the session: declaration validated first, then data copied in place (staged:
        into the staging copies). Any failure ends the session (rolled back in atomic mode) and re-raises. Returns
        tensors loaded. `sliced` (a staged session): only opens the receive; `advance_weight_update` runs it."""
        selection = RankSelection.from_update_info(update_info, self.parallel.rank, self.parallel.size)
        part = update_info.get("target") if isinstance(update_info, dict) else None
        problem = None
        if self._session_target == "lora":
            part = None if part in (None, "lora") else part
            if part is not None:
                problem = f"update_info target {part!r} in a session started for a LoRA adapter"
        if part not in (None, "model", "draft"):
            problem = f"update_info target must be 'model' or 'draft', got {part!r}"
        elif part is not None and self._session_target not in (part, "all"):
            problem = (
                f"this update carries {part!r} weights, but the session was started for "
                f"{self._session_target!r}; start it with target={part!r} or 'all'"
            )
        if problem is not None:
            self.session.expect(SessionState.ACTIVE, call="update_weights")
            self.session.abort()  # like any failed update, it ends the session (rolled back)
            raise ValueError(f"{problem} (the session was rolled back)")
        draft = part == "draft" or self._session_target == "draft"
        rename = canonical_name if self._session_target == "lora" else prefixer(DRAFT_PREFIX) if draft else None
        try:
            with torch.no_grad():
                return self.session.receive(update_info, selection, rename, sliced=sliced)
        finally:
            self._drop_lora_unless_open()

    @in_config_scope
    def advance_weight_update(self, budget_s: float | None = None) -> int | None:
        """Receives the staged update opened with `sliced` for about `budget_s` seconds (None: to its end).
        Returns the tensors loaded once it ended, None while more remain. A failure ends the session (the served
        weights were never written) and re-raises."""
        try:
            with torch.no_grad():
                return self.session.advance(budget_s)
        finally:
            self._drop_lora_unless_open()  # an adapter's next version that failed is dropped

    @in_config_scope
    def view_staged(self, on: bool) -> None:
        """Serves the open staged update's weights (`on`), as a canary's probes must see them, or the committed
        ones again. No-op without a staged update."""
        update = self.session.update
        if update is None or update.shadow is None:
            return
        if on and not update.shadow.inside:
            update.shadow.swap_in()
        elif not on and update.shadow.inside:
            update.shadow.swap_out()

    @in_config_scope
    def finish_weight_update(self, commit: bool = True) -> int:
        """Completes post-processing of partially updated layers and closes the session; returns the number of
        tensor names updated in it. `commit` False post-processes but keeps the update open with its rollback
        copies, for a second call (commit) or `abort_weight_update()`."""
        lora = self._session_target == "lora"
        try:
            update = self.session.finish(commit)
            if lora and commit:
                self._loras().commit_pending()
            elif lora:
                self._loras().prepare_pending()  # the commit then only registers it
        finally:
            self._drop_lora_unless_open()
        if lora:
            self.last_update_parts = ["lora"]
            return len(update.loaded_names)
        self.last_update_parts = sorted(
            {"draft" if n.startswith(DRAFT_PREFIX) else "model" for n in update.loaded_names}
        )
        return len(update.loaded_names)

    @in_config_scope
    def abort_weight_update(self) -> bool:
        """Ends the open update, restoring the weights it changed (atomic mode; otherwise they become invalid).
        Returns False when no update was open (nothing to do)."""
        try:
            return self.session.abort()
        finally:
            self._drop_lora_unless_open()

    @in_config_scope
    def shutdown_weight_transfer_engine(self) -> None:
        """Aborts an active session, then releases the transfer engine (connections, shared buffers) and the
        rollback buffers."""
        try:
            self.session.shutdown_engine()
        finally:
            self._drop_lora_unless_open()
        self.session.release_backups()

    # ---- LoRA adapters (hotswap/lora) --------------------------------------------------------------------------

    @in_config_scope
    def add_lora(self, uid: int, spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Loads adapter version `uid` of `spec` (LoRASpec.as_dict) from its full tensors by PEFT name. Raises
        ValueError naming a missing, unknown, mis-shaped or non-finite tensor (nothing is loaded then)."""
        source = pairs_source(((canonical_name(n), t) for n, t in tensors.items()), "LoRA adapter")
        self._loras().add(uid, spec, source, self.config.weight_transfer_config.check_finite)

    @in_config_scope
    def remove_lora(self, uid: int) -> bool:
        """Forgets adapter version `uid`; False if it was not loaded."""
        return self._loras().remove(uid)

    @in_config_scope
    def start_lora_update(self, old: int, new: int) -> None:
        """Opens an update session whose tensors (PEFT names) go into version `new` of an adapter, a copy of
        version `old`; `finish_weight_update()` makes it loadable, a failure or abort discards it. The update is
        atomic whatever the config says (a failure drops the new version; the served one never changes)."""
        self.session.expect(SessionState.READY, call="start_weight_update")  # before anything changes here
        adapter = self._loras().begin(old, new)
        try:
            config = dataclasses.replace(self.config.weight_transfer_config, atomic=True)
            self.session.start(adapter.weight_index(), config)
        except BaseException:
            self._drop_lora_unless_open()
            raise
        self._session_target = "lora"

    @in_config_scope
    def reload_lora(
        self,
        old: int,
        new: int,
        weights_iterator: Iterable[tuple[str, torch.Tensor]],
        commit: bool = True,
        encoding: str | None = None,
        checksums: dict[str, str] | None = None,
        sliced: bool = False,
    ) -> int:
        """Version `new` of an adapter := version `old` updated by (name, tensor) pairs (PEFT names, possibly a
        subset, possibly a delta `encoding` with the trainer's `checksums` of the results). `commit` False keeps
        it pending for `finish_weight_update()` / `abort_weight_update()`; `sliced` (with `commit` False) only
        opens the load, which `advance_weight_update` runs. Returns the tensors loaded. Refused (RuntimeError,
        nothing changed) while a weight-update session is open."""
        self.session.expect(SessionState.NO_ENGINE, SessionState.READY, call="reload_weights")
        adapter = self._loras().begin(old, new, fill=not sliced)  # sliced: the copy of `old` is the first slices
        wt = self.config.weight_transfer_config
        self._session_target = "lora"
        try:
            update = self.session.load(
                adapter.weight_index(),
                pairs_source(weights_iterator),
                True,
                wt.check_finite,
                commit=commit,
                encoding={"encoding": encoding, "checksums": checksums},
                rename=canonical_name,
                sliced=sliced,
            )
            if sliced:
                self.session.prefix_job(chunked_copies(self._loras().fill_pairs(old)))
            if commit:
                self._loras().commit_pending()
        finally:
            self._drop_lora_unless_open()
        return len(update.loaded_names)

    def _drop_lora_unless_open(self) -> None:
        """After a LoRA session call: a pending adapter version whose update is no longer open is discarded (a
        failure, an abort); after a commit it was registered first."""
        if self._session_target == "lora" and self.session.state is not SessionState.ACTIVE:
            if self.loras is not None:
                self.loras.drop_pending()
            self._session_target = "model"

    def _loras(self) -> LoRAManager:
        if self.loras is None:
            raise ValueError("LoRA adapters are not enabled; start the engine with enable_lora=True")
        return self.loras

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
    def weight_checksums(self, target: str = "model") -> dict[str, str]:
        """SHA-256 per checkpoint tensor name, over the bytes the engine holds for it (a fused layer's slice),
        so a trainer can compare with `tensor_sha256` of what it sent, cast to the engine's dtype. fp8 layers
        report their quantized bytes. `target` "draft" / "all": the draft's tensors, named "draft.<name>"."""
        self._check_awake("weight_checksums")
        index = self._weight_index(target)
        return {name: tensor_sha256(index.targets[name].local_view()) for name in sorted(index.required)}

    @in_config_scope
    def shard_plan(self) -> dict[str, list[tuple[int, int, int]]]:
        """Per checkpoint tensor name, the (dim, start, length) narrowings that cut this rank's part out of the
        full tensor (empty: the rank holds it whole). A trainer uses it to send pre-sliced tensors."""
        index = self._index()
        return {name: index.targets[name].narrowings() for name in sorted(index.required)}

    @in_config_scope
    def record_folder(self, folder: str, target: str = "model") -> None:
        """Records `folder` as the checkpoint of the model or (target "draft") the draft, once every rank
        committed a reload from it."""
        self._record_folder(folder, target)

    @in_config_scope
    def weight_state(self) -> WeightState:
        """Whether this rank's weights are valid, and which models the last committed update wrote."""
        return WeightState(self.session.is_valid(), list(self.last_update_parts))

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

    def _index(self) -> WeightIndex:
        return WeightIndex.of(self._model())

    def _weight_index(self, target: str) -> WeightIndex:
        """The index an update of `target` goes through: the model's own, or a union naming the draft's tensors
        "draft.<name>", whose post-processing runs in the draft's scope."""
        check_target(target)
        if target == "model":
            return self._index()
        if self.draft_model is None:
            raise ValueError(f"target {target!r} needs a draft model (speculative_config method 'draft_model')")
        draft = (WeightIndex.of(self.draft_model), self._draft_scope)
        if target == "draft":
            return WeightIndex.union({DRAFT_PREFIX: draft})
        return WeightIndex.union({"": (self._index(), None), DRAFT_PREFIX: draft})

    def _config_of(self, target: str) -> EngineConfig:
        if target == "draft":
            self._weight_index(target)  # raises without a draft
            assert self.draft_config is not None
            return self.draft_config
        return self.config

    def _model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("the model is not loaded; call load_model() first")
        return self.model

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the model is not loaded; call load_model() first")
        return self.runner
