"""Engine configuration and the scoped config context.

`EngineConfig` (`engine.py`) groups typed dataclasses, each validated at construction: `ModelConfig` (`model.py`)
and the other sections (`sections.py`). Settings derived at startup (KV block count, default `max_model_len`) are
written once onto the same instance by the engine. `live.py` validates and applies a change to a live engine.

`use_config(cfg)` (`scope.py`) scopes the live config over a `contextvars.ContextVar`; `current_config()` reads it
and raises outside any scope. Worker entry points that load, reload or update weights run inside `use_config`;
layers never read it: what they need is given to their constructors (`hotswap.model.settings`).

Every public name is importable from `hotswap.config`.
"""

from hotswap.config.engine import (
    SECTIONS,
    EngineConfig,
    check_batch_budget,
    check_deterministic,
    check_expert_placement,
    check_lora,
    draft_model_config,
)
from hotswap.config.host import available_memory_bytes
from hotswap.config.live import LIVE_FIELDS, MODEL_KEYS, apply_overrides, live_overrides
from hotswap.config.model import LOGPROBS_MODES, ModelConfig
from hotswap.config.scope import current_config, current_config_or_none, scoped, use_config
from hotswap.config.sections import (
    CacheConfig,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WeightTransferConfig,
)

__all__ = [
    "LIVE_FIELDS",
    "LOGPROBS_MODES",
    "MODEL_KEYS",
    "SECTIONS",
    "CacheConfig",
    "EngineConfig",
    "LoRAConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "QuantConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "WeightTransferConfig",
    "apply_overrides",
    "available_memory_bytes",
    "check_batch_budget",
    "check_deterministic",
    "check_expert_placement",
    "check_lora",
    "current_config",
    "current_config_or_none",
    "draft_model_config",
    "live_overrides",
    "scoped",
    "use_config",
]
