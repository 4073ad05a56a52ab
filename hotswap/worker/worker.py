"""The worker owns the model and its KV cache. The engine reaches it only through `collective_rpc`.

Every public method runs inside `use_config(self.config)`, so code deep in a layer can call
`current_config()`; the previous context is restored on return and on error.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from hotswap.config import EngineConfig, available_memory_bytes, use_config
from hotswap.model.loader import build_model, load_checkpoint
from hotswap.worker.model_input import ModelInput, ModelOutput
from hotswap.worker.model_runner import ModelRunner

F = TypeVar("F", bound=Callable[..., Any])


def in_config_scope(method: F) -> F:
    """Runs a Worker method inside its config context."""

    @functools.wraps(method)
    def wrapper(self: Worker, *args: Any, **kwargs: Any) -> Any:
        with use_config(self.config):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.model: nn.Module | None = None
        self.runner: ModelRunner | None = None

    @in_config_scope
    def load_model(self) -> None:
        """Full load: builds the model and loads every weight from the configured checkpoint folder."""
        model = build_model(self.config.model_config)
        if self.config.load_config.load_format == "safetensors":
            load_checkpoint(model, self.config.model_config.model)
        self.model = model
        self.runner = ModelRunner(self.config, model)

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
        return self._runner().execute(model_input)

    @in_config_scope
    def execute_method(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Calls a Worker method by name, or `method(self, *args, **kwargs)` for a callable."""
        if callable(method):
            return method(self, *args, **kwargs)
        if method.startswith("_") or not callable(getattr(self, method, None)):
            raise ValueError(f"Worker has no public method {method!r}")
        return getattr(self, method)(*args, **kwargs)

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the model is not loaded; call load_model() first")
        return self.runner
