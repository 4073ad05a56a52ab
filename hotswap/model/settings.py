"""What a model's layers are built with: the settings fixed for the model's life, given to every constructor.

A layer reads nothing ambient to build or run itself: `build_model(model_config, settings)` passes one
`LayerSettings` down the constructors (gpt-fast's way: the model is a plain function of its arguments). What varies
per forward pass travels in a `StepContext` (hotswap/model/step.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hotswap.config import EngineConfig, ParallelConfig
from hotswap.distributed import SINGLE, ParallelContext


@dataclass(frozen=True)
class LayerSettings:
    """`dtype`: the model's (an fp8 layer stages incoming high-precision rows in it). `quantization` None or "fp8",
    with `weight_block_size` the experts' scale tiles (None: one scale per row). `deterministic`: the
    batch-invariant paths (docs/determinism.md), passed to every kernel call. `parallel`: this rank, the group
    size and the process group; layers size their shards by it and keep it for their collectives.

    `experts` is the live parallel section (`enable_expert_parallel`, `expert_placement`): the placement may change
    on a live engine (`apply_overrides` writes this very object in place), and `FusedMoE` follows it when told to
    move its experts; a model built outside an engine gets a section of its own (contiguous placement)."""

    dtype: torch.dtype = torch.float32
    quantization: str | None = None
    weight_block_size: tuple[int, int] | None = None
    deterministic: bool = False
    parallel: ParallelContext = SINGLE
    experts: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def fp8(self) -> bool:
        return self.quantization == "fp8"

    @classmethod
    def of(cls, config: EngineConfig, parallel: ParallelContext = SINGLE) -> LayerSettings:
        """The settings of a model served under `config` on the rank `parallel` describes."""
        mc, quant = config.model_config, config.quant_config
        return cls(
            dtype=mc.torch_dtype,
            quantization=quant.quantization,
            weight_block_size=quant.weight_block_size,
            deterministic=mc.deterministic,
            parallel=parallel,
            experts=config.parallel_config,
        )
