"""The worker owns the model and its KV cache. The engine reaches it only through `collective_rpc`.

Every public method runs inside `use_config(self.config)`, so code deep in a layer can call
`current_config()`; the previous context is restored on return and on error.

Weight lifecycle:
- `load_model()` is always a full load.
- `reload_weights(...)` and the transfer session update parameters in place (storage never rebound), validate
  before they mutate, and in atomic mode roll back bit for bit on any failure. With atomic off, a failed update
  leaves the worker refusing to execute until a successful full reload.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any, TypeVar

import torch
from torch import nn

from hotswap.config import EngineConfig, available_memory_bytes, use_config
from hotswap.distributed import SINGLE, ParallelContext, use_parallel
from hotswap.model.loader import WeightMap, build_model
from hotswap.model.reload import WeightUpdate
from hotswap.model.safetensors_io import declared as index_declared
from hotswap.model.safetensors_io import iterate_index, read_index
from hotswap.transfer.checksum import tensor_sha256
from hotswap.worker.memory import discard_pages, place_in_huge_pages
from hotswap.worker.model_input import ModelInput, ModelOutput
from hotswap.worker.model_runner import ModelRunner
from hotswap.worker.weight_session import SessionState, WeightSession, WeightUpdateFailed

F = TypeVar("F", bound=Callable[..., Any])

# Config fields that may change on a live worker; everything else needs a new engine.
LIVE_FIELDS = {
    "model_config": {"model"},
    "load_config": {"load_format"},
    "weight_transfer_config": {"atomic", "check_finite", "timeout_s", "bucket_size_bytes"},
}
# config.json keys that fix the model's shapes or forward pass: a new checkpoint folder must agree on all.
MODEL_KEYS = (
    "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps", "max_position_embeddings", "sliding_window",
    "use_sliding_window", "hidden_act", "eos_token_id",
)  # fmt: skip


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
        self.weights_valid = True

    # ---- model and cache ------------------------------------------------------------------------------------

    @in_config_scope
    def load_model(self) -> None:
        """Full load: builds the model and loads every weight from the configured checkpoint folder."""
        torch.manual_seed(self.config.model_config.seed)  # unseeded sampling draws from this process's generator
        model = build_model(self.config.model_config)
        if self.config.load_config.huge_pages:
            place_in_huge_pages(model)
        if self.config.load_config.load_format == "dummy":
            update = WeightUpdate(model, atomic=False, check_finite=False)
            with torch.no_grad():
                update.load(
                    (name, torch.randn(t.shape) * 0.02)
                    for name, t in WeightMap.of(model).targets.items()
                    if name in WeightMap.of(model).required
                )
            update.finish()
        if self.config.load_config.load_format == "safetensors":
            index = read_index(self.config.model_config.model)
            update = WeightUpdate(model, atomic=False, check_finite=self.config.weight_transfer_config.check_finite)
            update.validate(index_declared(index), require_all=True)
            update.load(iterate_index(index))
            update.finish()
        self.model = model
        self.runner = ModelRunner(self.config, model)
        self.weights_valid = True

    @in_config_scope
    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit the configured budget, capped at what `max_num_seqs` full-length
        sequences can use."""
        runner = self._runner()
        cache = self.config.cache_config
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            budget = int(available_memory_bytes() * cache.memory_fraction)
        per_block = runner.bytes_per_block()
        max_len = self.config.model_config.max_model_len or 1
        cap = self.config.scheduler_config.max_num_seqs * math.ceil(max_len / cache.block_size)
        return min(budget // per_block, cap)

    @in_config_scope
    def initialize_cache(self, num_blocks: int) -> None:
        self._runner().allocate_kv_cache(num_blocks)

    @in_config_scope
    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        if not self.weights_valid:
            raise RuntimeError(
                "the weights are inconsistent after a failed non-atomic update; call reload_weights() to restore "
                "a full checkpoint before generating"
            )
        return self._runner().execute(model_input)

    @in_config_scope
    def execute_method(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Calls a Worker method by name, or `method(self, *args, **kwargs)` for a callable. After a callable,
        the model's modules that keep state about it (`user_code_ran`, e.g. whether forward hooks are set) are
        told that user code ran on it."""
        if callable(method):
            try:
                return method(self, *args, **kwargs)
            finally:
                for module in self.model.modules() if self.model is not None else ():
                    if hasattr(module, "user_code_ran"):
                        module.user_code_ran()
        if method.startswith("_") or not callable(getattr(self, method, None)):
            raise ValueError(f"Worker has no public method {method!r}")
        return getattr(self, method)(*args, **kwargs)

    # ---- in-place reload and live config --------------------------------------------------------------------

    @in_config_scope
    def reload_weights(
        self, weights_path: str | None = None, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None
    ) -> int:
        """Updates the weights in place from a checkpoint folder (`weights_path`, recorded as the model folder on
        success), from (name, tensor) pairs (`weights_iterator`, may be partial), or with neither from the
        current folder. Returns the number of tensors loaded. Validates before mutating; see the class doc for
        failure behaviour."""
        self.session.expect(SessionState.NO_ENGINE, SessionState.READY, call="reload_weights")
        if weights_path is not None and weights_iterator is not None:
            raise ValueError("give weights_path or weights_iterator, not both")
        model = self._model()
        wt = self.config.weight_transfer_config
        update = WeightUpdate(model, atomic=wt.atomic, check_finite=wt.check_finite)
        if weights_iterator is not None:
            pairs = [(str(name), t.detach()) for name, t in weights_iterator]
            update.validate([(n, t.dtype, tuple(t.shape)) for n, t in pairs], require_all=False)
            update.check_values(pairs)
            stream: Iterable[tuple[str, torch.Tensor]] = pairs
        else:
            folder = str(weights_path or self.config.model_config.model)
            if weights_path is not None:
                self._check_same_shapes(folder)
            index = read_index(folder)
            update.validate(index_declared(index), require_all=True)
            stream = iterate_index(index)
        self._apply(update, stream)
        if weights_path is not None:
            self.config.model_config.model = str(weights_path)
        if update.covers_all():
            self.weights_valid = True
        return len(update.loaded_names)

    @in_config_scope
    def update_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        """Applies `{section: {field: value}}` to the live config after validating it like construction.
        Raises ValueError for unknown sections or fields, invalid values, or fields that cannot change live
        (those need a new engine)."""
        self.session.expect(SessionState.NO_ENGINE, SessionState.READY, call="update_config")
        new_sections = self.config.with_overrides(overrides)
        for section, changes in overrides.items():
            frozen = sorted(set(changes) - LIVE_FIELDS.get(section, set()))
            if frozen:
                raise ValueError(
                    f"{section} field(s) {frozen} cannot change on a live engine; live fields: "
                    f"{ {k: sorted(v) for k, v in LIVE_FIELDS.items()} }"
                )
        if "model_config" in new_sections:
            self._check_same_shapes(new_sections["model_config"].model)
        for section, obj in new_sections.items():
            live = getattr(self.config, section)
            for f in fields(obj):
                setattr(live, f.name, getattr(obj, f.name))

    # ---- the weight-transfer session --------------------------------------------------------------------------

    @in_config_scope
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Creates the receiving engine of `init_info["backend"]` (tensors, shm, torch_dist, disk)."""
        self.session.init_engine(init_info, self.config.weight_transfer_config)

    @in_config_scope
    def start_weight_update(self, target: str = "model") -> None:
        """Opens an update session; in atomic mode, everything overwritten until finish is kept for rollback."""
        if target != "model":
            raise ValueError(f"start_weight_update target must be 'model', got {target!r}")
        self.session.start(self._model(), self.config.weight_transfer_config)

    @in_config_scope
    def update_weights(self, update_info: dict[str, Any]) -> int:
        """Receives one update of the session: declaration validated first, then data copied in place.
        Any failure ends the session (rolled back in atomic mode) and re-raises. Returns tensors loaded."""
        self.session.expect(SessionState.ACTIVE, call="update_weights")
        engine, update = self.session.engine, self.session.update
        assert engine is not None and update is not None
        before = len(update.loaded_names)
        try:
            declared = engine.declared(update_info)
            mine = self._own_entries(update_info, len(declared))
            pre_sliced = frozenset(declared[i][0] for i, own in enumerate(mine) if own == "pre_sliced")
            declared = [d for d, own in zip(declared, mine, strict=True) if own]
            update.validate(declared, pre_sliced=pre_sliced)
            # every entry is received (a collective stream must be drained); other ranks' slices are skipped
            stream: Iterable[tuple[str, torch.Tensor]] = (
                item for item, own in zip(engine.receive(update_info), mine, strict=False) if own
            )
            if engine.in_memory:
                stream = list(stream)  # views, no copies: every value is checked before any is loaded
                update.check_values(stream)
            loaded = update.load(stream, pre_sliced=pre_sliced)
            expected = sum(1 for name, _, _ in declared if not update.weight_map.ignored(name))
            if loaded != expected:
                raise ValueError(f"the update stream ended after {loaded} of {expected} declared tensors")
        except BaseException as err:
            self.session.end()
            if not engine.survives_failure:
                self.session.shutdown_engine()
                err = (
                    type(err)(
                        f"{err}; the {type(engine).__name__} channel was closed, call "
                        "init_weight_transfer_engine() again"
                    )
                    if isinstance(err, (ValueError, RuntimeError))
                    else err
                )
            self._fail(update, err)
        return len(update.loaded_names) - before

    @in_config_scope
    def finish_weight_update(self) -> int:
        """Completes post-processing of partially updated layers and closes the session; returns the number of
        tensor names updated in it."""
        self.session.expect(SessionState.ACTIVE, call="finish_weight_update")
        update = self.session.end()
        try:
            update.finish()
        except BaseException as err:
            self._fail(update, err)
        if update.covers_all():
            self.weights_valid = True
        return len(update.loaded_names)

    @in_config_scope
    def abort_weight_update(self) -> None:
        """Ends the session, restoring the weights it changed (atomic mode; otherwise they become invalid)."""
        self.session.expect(SessionState.ACTIVE, call="abort_weight_update")
        update = self.session.end()
        if update.atomic:
            update.rollback()
        elif update.loaded_names:
            self.weights_valid = False

    @in_config_scope
    def shutdown_weight_transfer_engine(self) -> None:
        """Aborts an active session, then releases the transfer engine (connections, shared buffers)."""
        if self.session.state is SessionState.ACTIVE:
            self.abort_weight_update()
        self.session.shutdown_engine()
        if self.model is not None:
            WeightMap.of(self.model).release_backup_buffers()

    # ---- sleep and wake ---------------------------------------------------------------------------------------

    @in_config_scope
    def sleep(self, level: int = 1) -> int:
        """Frees the KV cache (level 1), and at level 2 also the weights' memory: parameters keep their storage
        but its pages go back to the OS and read as zeros, so the worker refuses to execute until a reload or a
        full update. Rollback buffers are freed too. Returns the bytes released from weights."""
        self.session.expect(SessionState.NO_ENGINE, SessionState.READY, call="sleep")
        self._runner().free_kv_cache()
        model = self._model()
        WeightMap.of(model).release_backup_buffers()
        released = 0
        if level >= 2:
            with torch.no_grad():
                for param in model.parameters():
                    released += discard_pages(param.data)
            self.weights_valid = False
        return released

    @in_config_scope
    def wake_up(self, tags: list[str]) -> None:
        """Re-allocates the KV cache ("kv_cache"). Weights released at level 2 come back with a reload or a
        full update after wake_up(["weights"]); their storage never moved."""
        if "kv_cache" in tags and not self._runner().kv_caches:
            assert self.config.cache_config.num_kv_blocks is not None
            self._runner().allocate_kv_cache(self.config.cache_config.num_kv_blocks)

    @in_config_scope
    def weight_checksums(self) -> dict[str, str]:
        """SHA-256 per checkpoint tensor name, over the bytes the engine holds for it (a fused layer's slice),
        so a trainer can compare with `tensor_sha256` of what it sent, cast to the engine's dtype. fp8 layers
        report their quantized bytes."""
        weight_map = WeightMap.of(self._model())
        out = {}
        for name in sorted(weight_map.required):
            target = weight_map.targets[name]
            owner = self._model().get_submodule(target.module_name)
            view = owner.shard_view(target.param, target.shard_id) if hasattr(owner, "shard_view") else target.param
            out[name] = tensor_sha256(view)
        return out

    @in_config_scope
    def shard_plan(self) -> dict[str, list[tuple[int, int, int]]]:
        """Per checkpoint tensor name, the (dim, start, length) narrowings that cut this rank's part out of the
        full tensor (empty: the rank holds it whole). A trainer uses it to send pre-sliced tensors."""
        model = self._model()
        weight_map = WeightMap.of(model)
        plan = {}
        for name in sorted(weight_map.required):
            target = weight_map.targets[name]
            owner = model.get_submodule(target.module_name)
            plan[name] = owner.shard_plan(target.param, target.shard_id) if hasattr(owner, "shard_plan") else []
        return plan

    # ---- helpers --------------------------------------------------------------------------------------------

    def _own_entries(self, update_info: dict[str, Any], count: int) -> list[str | None]:
        """For each declared tensor: "full" (a whole tensor, this rank takes its part), "pre_sliced" (already
        this rank's part) or None (another rank's part). `update_info["tp_ranks"]`, when given, names the rank
        each tensor was sliced for (None: whole)."""
        ranks = update_info.get("tp_ranks") if isinstance(update_info, dict) else None
        if ranks is None:
            return ["full"] * count
        if not isinstance(ranks, list) or len(ranks) != count:
            raise ValueError(f"tp_ranks must list one rank (or None) per declared tensor ({count})")
        size = self.parallel.size
        if any(r is not None and not (isinstance(r, int) and 0 <= r < size) for r in ranks):
            raise ValueError(f"tp_ranks entries must be None or ranks in [0, {size})")
        return ["full" if r is None else "pre_sliced" if r == self.parallel.rank else None for r in ranks]

    def _apply(self, update: WeightUpdate, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        try:
            update.load(stream)
            update.finish()
        except BaseException as err:
            self._fail(update, err)

    def _fail(self, update: WeightUpdate, err: BaseException) -> None:
        """Rolls back (atomic) or invalidates the weights, then re-raises `err` with the outcome attached."""
        if update.atomic:
            update.rollback()
            outcome = "the previous weights were restored"
        elif update.loaded_names:
            self.weights_valid = False
            outcome = "atomic mode is off, so the engine refuses to generate until a successful reload_weights()"
        else:
            outcome = "no weight had been changed"
        if isinstance(err, (ValueError, TimeoutError)):
            raise type(err)(f"{err} ({outcome})") from err
        if isinstance(err, Exception):
            raise WeightUpdateFailed(f"weight update failed: {err!r} ({outcome})") from err
        raise err

    def _check_same_shapes(self, folder: str) -> None:
        import json
        import os

        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{folder!r} is not a checkpoint folder (no config.json)")
        new = json.loads(open(path).read())
        old = self.config.model_config.hf_config
        differ = [k for k in MODEL_KEYS if new.get(k) != old.get(k)]
        if differ:
            raise ValueError(
                f"checkpoint {folder!r} has a different model shape or configuration ({differ}); start a new engine"
            )

    def _model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("the model is not loaded; call load_model() first")
        return self.model

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the model is not loaded; call load_model() first")
        return self.runner
