"""Llama-family decoder models: Llama 2/3, Mistral, SmolLM, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm,
independent head_dim). Module names follow the Hugging Face checkpoints, with q/k/v fused into `qkv_proj` and
gate/up into `gate_up_proj` (see `stacked_params_mapping`).

A model is built with its `LayerSettings` (hotswap/model/settings.py), passed down to every layer's constructor,
and runs one pass as `model(input_ids, positions, ctx)` with the pass's `StepContext` (hotswap/model/step.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from hotswap.distributed import split
from hotswap.model.layers.activation import SiluAndMul
from hotswap.model.layers.attention import Attention
from hotswap.model.layers.embedding import VocabEmbedding
from hotswap.model.layers.linear import Linear, MergedLinear, QKVLinear
from hotswap.model.layers.norm import RMSNorm
from hotswap.model.layers.rotary import RotaryEmbedding, rope_settings
from hotswap.model.settings import LayerSettings
from hotswap.model.step import StepContext, call


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], settings: LayerSettings, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        det = settings.deterministic
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = QKVLinear(
            hidden, self.head_dim, self.num_heads, self.num_kv_heads, qkv_bias or attention_bias, settings
        )
        # this rank's heads; o_proj's input split follows them
        local_heads = self.qkv_proj.num_local_heads
        self.o_proj = Linear(
            self.num_heads * self.head_dim,
            hidden,
            settings,
            bias=attention_bias,
            parallel="row",
            in_split=(self.qkv_proj.q_start * self.head_dim, local_heads * self.head_dim),
            det_split=split(self.num_heads, 0, 2)[1] * self.head_dim,  # whole heads, as two ranks split them
        )
        self.num_heads, self.num_kv_heads = local_heads, self.qkv_proj.num_local_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        theta, scaling = rope_settings(cfg)
        max_position = cfg.get("max_position_embeddings", 2048)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position, theta, scaling, deterministic=det)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps, deterministic=det) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, deterministic=det) if qk_norm else None
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.qkv_proj.kv_of_q, deterministic=det
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        qkv = call(self.qkv_proj, x, ctx.lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            assert self.k_norm is not None  # built together with q_norm
            q, k = self.q_norm(q), self.k_norm(k)
        return call(self.o_proj, self.attn(q, k, v, ctx.attn, positions, self.rotary_emb), ctx.lora)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, settings: LayerSettings, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], settings, bias=bias)
        self.down_proj = Linear(intermediate, hidden, settings, bias=bias, parallel="row")
        self.act_fn = SiluAndMul(deterministic=settings.deterministic)

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        """The SwiGLU block on `x`, with the adapters of the pass `ctx` (None: none)."""
        lora = None if ctx is None else ctx.lora
        return call(self.down_proj, self.gate_up_proj.forward_silu_and_mul(x, self.act_fn, lora), lora)


class LlamaDecoderLayer(nn.Module):
    """Attention, then the feed-forward block `mlp` (default: the dense SwiGLU MLP of the config), called as
    `mlp(x, ctx)` in a pass with adapters or routes, else `mlp(x)`."""

    def __init__(
        self,
        cfg: dict[str, Any],
        settings: LayerSettings,
        qkv_bias: bool,
        qk_norm: bool,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        eps, det = cfg.get("rms_norm_eps", 1e-6), settings.deterministic
        self.self_attn = LlamaAttention(cfg, settings, qkv_bias, qk_norm)
        if mlp is None:
            mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"], settings, bool(cfg.get("mlp_bias", False)))
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, deterministic=det)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, deterministic=det)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes this layer's input as (x, residual): the hidden state is residual + x (residual None: x alone).
        Returns the next layer's (x, residual); the residual add is fused into the norms that follow it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(positions, h, ctx)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return call(self.mlp, h, ctx.extras()), residual


class LlamaModel(nn.Module):
    """`mlp_for(i)` gives layer i's feed-forward block (None: the dense MLP)."""

    def __init__(
        self,
        cfg: dict[str, Any],
        settings: LayerSettings,
        qkv_bias: bool,
        qk_norm: bool,
        mlp_for: Callable[[int], nn.Module | None] = lambda i: None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg["vocab_size"], cfg["hidden_size"], settings)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, settings, qkv_bias, qk_norm, mlp_for(i)) for i in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), deterministic=settings.deterministic)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        assert residual is not None  # set by the first layer (a model has at least one)
        return self.norm.add_and_norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Causal LM over the paged cache. `forward` returns final hidden states for the flat batch;
    `compute_logits` projects only the rows that need sampling."""

    qkv_bias = False
    qk_norm = False
    # checkpoint module name -> (fused module name, shard id)
    stacked_params_mapping: dict[str, tuple[str, object]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config: dict[str, Any], settings: LayerSettings) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.settings = settings
        self.model = LlamaModel(hf_config, settings, self.qkv_bias, self.qk_norm, self.mlp_for)
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = VocabEmbedding(hf_config["vocab_size"], hf_config["hidden_size"], settings)

    def mlp_for(self, layer: int) -> nn.Module | None:
        """Layer `layer`'s feed-forward block; None: the dense MLP (mixture-of-experts models override this)."""
        return None

    @classmethod
    def routing_shape(cls, cfg: dict[str, Any]) -> tuple[int, int, int] | None:
        """(sparse layers, top_k, experts) of a mixture-of-experts model of `cfg`; None: a dense model."""
        return None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The final hidden states [T, H] of the flat batch, under the pass's context `ctx`."""
        return cast(torch.Tensor, self.model(input_ids, positions, ctx))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the whole vocabulary (gathered across tensor-parallel ranks)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(hidden)

    def checkpoint_aliases(self) -> dict[str, str]:
        """Extra checkpoint names that refer to an existing parameter (tied embeddings accept either name)."""
        if self.tie_word_embeddings:
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    @staticmethod
    def ignored_checkpoint_names(name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
