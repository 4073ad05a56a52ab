"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral. They are Llama-family models whose sparse
layers replace the dense MLP with `SparseMoeBlock`: a router (`gate`), the fused experts, and for Qwen2-MoE a
shared expert behind a sigmoid gate.

Which layers are sparse: Qwen's `decoder_sparse_step` and `mlp_only_layers` (the others keep a dense MLP of
`intermediate_size`); every layer for Mixtral. Mixtral checkpoints name the block `block_sparse_moe` and its
experts' projections w1 / w3 / w2; a transformers 5 trainer names it `mlp` with fused experts: both load.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from hotswap.kernels import ops
from hotswap.model.layers.fused_moe import FusedMoE, route
from hotswap.model.layers.linear import Linear
from hotswap.model.llama import LlamaForCausalLM, LlamaMLP
from hotswap.model.settings import LayerSettings
from hotswap.model.step import StepContext, call


def num_experts(cfg: dict[str, Any]) -> int:
    """The expert count: `num_experts` (Qwen hub configs) or `num_local_experts` (Mixtral, transformers 5)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


class SparseMoeBlock(nn.Module):
    """Router -> top-k experts (float32 weights) -> weighted sum, plus the optional gated shared expert.
    `routing_layer`: this block's index among the model's sparse blocks (in layer order), the layer whose routes a
    pass's `Routes` records and forces (hotswap/model/routing.py)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        settings: LayerSettings,
        routing_layer: int,
        shared_intermediate_size: int = 0,
        expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        self.top_k, self.renormalize, self.deterministic = top_k, renormalize, settings.deterministic
        self.gate = Linear(hidden_size, num_experts, settings, quantizable=False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, settings, expert_names)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(hidden_size, shared_intermediate_size, settings)
            self.shared_expert_gate = Linear(hidden_size, 1, settings, quantizable=False)
        self.routing_layer = routing_layer

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        """The block on `x` under the pass `ctx` (its adapters, and the routes it records or forces)."""
        lora = None if ctx is None else ctx.lora
        logits = call(self.gate, x, lora)
        weights, ids = route(logits, self.top_k, self.renormalize, self.deterministic)
        routes = None if ctx is None else ctx.routes
        if routes is not None and (routes.record or routes.forced is not None):
            weights, ids = routes.use(self.routing_layer, weights, ids, logits, self.renormalize)
        out = self.experts(x, weights, ids) if lora is None else self.experts(x, weights, ids, lora)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None  # built together
            gate = ops.sigmoid(call(self.shared_expert_gate, x, lora), self.deterministic)
            out = out + gate * call(self.shared_expert, x, None if ctx is None else ctx.extras())
        return cast(torch.Tensor, out)


def route_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(sparse layers, top_k, experts) of a built model: what a pass's `Routes` records; None for a dense
    model."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return (len(blocks), blocks[0].top_k, blocks[0].experts.num_experts) if blocks else None


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    shared_expert = False

    @staticmethod
    def is_sparse(cfg: dict[str, Any], layer: int) -> bool:
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        return layer not in (cfg.get("mlp_only_layers") or []) and bool(num_experts(cfg)) and not (layer + 1) % step

    @classmethod
    def routing_shape(cls, cfg: dict[str, Any]) -> tuple[int, int, int] | None:
        """(sparse layers, top_k, experts) of a model of `cfg`; None when no layer is sparse."""
        layers = sum(cls.is_sparse(cfg, i) for i in range(cfg["num_hidden_layers"]))
        return (layers, int(cfg["num_experts_per_tok"]), num_experts(cfg)) if layers else None

    def mlp_for(self, layer: int) -> nn.Module | None:
        cfg = self.hf_config
        if not self.is_sparse(cfg, layer):
            return None
        return SparseMoeBlock(
            cfg["hidden_size"],
            num_experts(cfg),
            cfg["num_experts_per_tok"],
            cfg["moe_intermediate_size"],
            bool(cfg.get("norm_topk_prob", False)),
            self.settings,
            sum(self.is_sparse(cfg, i) for i in range(layer)),  # the sparse layers before this one
            cfg.get("shared_expert_intermediate_size", 0) if self.shared_expert else 0,
        )


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = False
    qkv_bias = True
    shared_expert = True


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def routing_shape(cls, cfg: dict[str, Any]) -> tuple[int, int, int] | None:
        """(sparse layers, top_k, experts): every layer is sparse."""
        return int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"]), num_experts(cfg)

    def mlp_for(self, layer: int) -> nn.Module | None:
        cfg = self.hf_config
        return SparseMoeBlock(
            cfg["hidden_size"],
            num_experts(cfg),
            cfg["num_experts_per_tok"],
            cfg["intermediate_size"],
            renormalize=True,
            settings=self.settings,
            routing_layer=layer,  # every layer is sparse
            expert_names=("w1", "w3", "w2"),
        )

    def checkpoint_aliases(self) -> dict[str, str]:
        """Hub names (`block_sparse_moe.*`) for the block's router and per-expert weights."""
        aliases = super().checkpoint_aliases()
        cfg: dict[str, Any] = self.hf_config
        for i in range(cfg["num_hidden_layers"]):
            prefix = f"model.layers.{i}"
            aliases[f"{prefix}.block_sparse_moe.gate.weight"] = f"{prefix}.mlp.gate.weight"
            for e in range(num_experts(cfg)):
                for w in ("w1", "w2", "w3"):
                    name = f"experts.{e}.{w}.weight"
                    aliases[f"{prefix}.block_sparse_moe.{name}"] = f"{prefix}.mlp.{name}"
        return aliases
