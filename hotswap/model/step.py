"""One forward pass's context: what varies from step to step, passed explicitly to the model's forward
(`model(input_ids, positions, ctx)`) and down to the layers that need it. Settings fixed at build time are not
here: the layers hold them (hotswap/model/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hotswap.model.layers.attention import AttentionMetadata
from hotswap.model.lora_batch import LoRABatch
from hotswap.model.routing import Routes


@dataclass
class StepContext:
    """`attn`: the flat batch's layout over the paged cache, shared by every attention layer. `lora`: the pass's
    adapters and the rows each serves (None: no row uses one). `routes`: the mixture-of-experts routes to record
    and/or force in this pass (None: the routers decide, nothing is recorded)."""

    attn: AttentionMetadata
    lora: LoRABatch | None = None
    routes: Routes | None = None

    def extras(self) -> StepContext | None:
        """This context where the pass has adapters or routes, else None (a feed-forward block then needs only its
        input)."""
        return self if self.lora is not None or self.routes is not None else None


def call(module: nn.Module, x: torch.Tensor, arg: object) -> torch.Tensor:
    """`module(x)`, or `module(x, arg)` where `arg` (the pass's adapters, or its context) is not None. A module
    whose forward user code replaced on the instance (`LLM.apply_model`) gets its input alone in every pass, as
    when layers took nothing else: its adapters and routes are then the replacement's business."""
    replaced = "forward" in vars(module)
    out: torch.Tensor = module(x) if arg is None or replaced else module(x, arg)
    return out
