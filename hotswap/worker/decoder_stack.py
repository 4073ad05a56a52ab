"""The native decoder stack: a Llama-family model's layers and final norm in one kernel call (`decoder_layers`,
hotswap/kernels/decoder.cpp), run by the model runner in place of the modules where it computes exactly what
they would.

At decode batch sizes the trips between the modules (Python calls, argument checks, op bindings) cost a few
milliseconds per step on top of the layers' own work; the kernel runs the same kernels the modules' native paths
call, in the same order, so the result and the caches are the same bits (for any step of 4 to 64 tokens: decode
steps, and short or prefix-cached prefills). It is taken where the policy takes the linear kernels it is built
on (`decoder_stack` in `python -m hotswap.kernels --report`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import NamedTuple

import torch
from torch import nn

from hotswap.kernels import ops
from hotswap.kernels import packed as packing
from hotswap.kernels import policy as kernel_policy
from hotswap.kernels.measurements import fastest_in_turn
from hotswap.kernels.policy import Products
from hotswap.model.layers.attention import Attention, AttentionMetadata
from hotswap.model.layers.linear import Linear, MergedLinear, QKVLinear
from hotswap.model.layers.norm import RMSNorm
from hotswap.model.layers.rotary import RotaryEmbedding
from hotswap.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from hotswap.model.lora_batch import LoRABatch, Packs
from hotswap.model.step import StepContext


class _Layer(NamedTuple):
    """One decoder layer's modules whose tensors `decoder_layers` takes, in its order; `attention` holds its heads'
    layout."""

    norm1: RMSNorm
    qkv: QKVLinear
    o: Linear
    norm2: RMSNorm
    gate_up: MergedLinear
    down: Linear
    rotary: RotaryEmbedding
    attn: Attention
    attention: LlamaAttention


class NativeDecoderStack:
    """Runs `model.model` (a `LlamaModel`) through `decoder_layers` where `applies`. The checks on the modules
    run once, and again after user code ran on the model (`user_code_ran`): walking the modules at every step
    would be slow, their dicts being out of cache after a step's weights went by. `deterministic`: the model's
    mode (every product native, the row-parallel ones split as the modules split them)."""

    def __init__(self, model: nn.Module, *, deterministic: bool) -> None:
        self.outer = model
        self.deterministic = deterministic

    @cached_property
    def model(self) -> LlamaModel | None:
        """The decoder (`outer.model`) if it is exactly a `LlamaModel`."""
        inner = getattr(self.outer, "model", None)
        return inner if type(inner) is LlamaModel else None

    def user_code_ran(self) -> None:
        """Called after user code ran on the model (`apply_model`, `collective_rpc` with a callable), which may
        have added hooks, replaced modules or unfrozen parameters."""
        for name in ("model", "modules_fit", "needs_grad", "layers", "onednn"):
            self.__dict__.pop(name, None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.model is not None  # checked by `applies`
        embedded: torch.Tensor = self.model.embed_tokens(input_ids)
        return embedded

    def applies(self, num_tokens: int, positions: torch.Tensor, ctx: StepContext) -> bool:
        """Whether every layer would take the native kernels on this pass of `num_tokens` (float32 or bfloat16
        (`dtypes_fit`); a small batch, one rank, unquantized, the native attention, no q/k norm) and no
        forward hook would see the model or its layers run."""
        meta, lora = ctx.attn, ctx.lora
        if meta.kernel is None or not ops.decoder_stack_available(num_tokens, self.deterministic) or self.model is None:
            return False
        if lora is not None and not all(g.span is not None and not self._experts(g.packs) for g in lora.groups):
            return False  # adapters on gathered rows, or on experts: the modules' path
        if not self.modules_fit:
            return False
        first = self.layers[0]
        qkv, cache = first.qkv, first.attn.k_cache
        policy = ops.policy()
        return (
            (
                self.deterministic
                or (
                    num_tokens <= ops.SMALL_BATCH_ROWS
                    and all(policy.uses(op, num_tokens) for op in ("rms_norm", "add_rms_norm", "rope_paged_attention"))
                )
            )
            and cache is not None
            and self.dtypes_fit(qkv.weight.dtype, cache.dtype, lora is not None)
            and not (torch.is_grad_enabled() and self.needs_grad)
            and positions.dtype == torch.long
            and positions.device.type == "cpu"
            and not (torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks)
        )

    @staticmethod
    def dtypes_fit(weights: torch.dtype, cache: torch.dtype, lora: bool) -> bool:
        """Whether the stack runs these dtypes: float32 weights and cache; or bfloat16 weights with a float32 or
        bfloat16 cache, without adapters (their float32 factors meet bf16 rows in the modules' order)."""
        if weights == torch.float32:
            return cache == torch.float32
        return weights == torch.bfloat16 and cache in (torch.float32, torch.bfloat16) and not lora

    @cached_property
    def modules_fit(self) -> bool:
        """Whether every layer is built as `decoder_layers` computes it: the classes of hotswap/model/llama.py and
        their layers (no subclass, wrapper or per-instance forward), one dtype, no q/k norm, one rank,
        unquantized, and no forward hook on them, the final norm, the embedding or the model around them."""
        model = self.model
        if model is None:
            return False
        if any(
            m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__
            for m in (self.outer, model, model.embed_tokens)
        ):
            return False
        expected = {
            "self_attn": LlamaAttention,
            "mlp": LlamaMLP,
            "input_layernorm": RMSNorm,
            "post_attention_layernorm": RMSNorm,
        }
        for layer in model.layers:
            if type(layer) is not LlamaDecoderLayer:
                return False
            if any(type(getattr(layer, name)) is not cls for name, cls in expected.items()):
                return False
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(mlp, LlamaMLP)  # its type was checked above
            parts = {
                attn.qkv_proj: QKVLinear,
                attn.o_proj: Linear,
                attn.rotary_emb: RotaryEmbedding,
                attn.attn: Attention,
                mlp.gate_up_proj: MergedLinear,
                mlp.down_proj: Linear,
            }
            if any(type(m) is not c for m, c in parts.items()) or attn.q_norm is not None:
                return False
            if attn.o_proj.parallel is not None or attn.qkv_proj.fp8 or not mlp.gate_up_proj.gate_and_up:
                return False
        if type(model.norm) is not RMSNorm or len({p.dtype for p in model.layers.parameters()}) != 1:
            return False
        modules = [*model.layers.modules(), model.norm]
        return not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in modules)

    @cached_property
    def needs_grad(self) -> bool:
        """Whether a parameter of the layers or the final norm requires grad (the kernels have no backward)."""
        assert self.model is not None  # checked by `applies`
        return any(p.requires_grad for p in [*self.model.layers.parameters(), *self.model.norm.parameters()])

    @cached_property
    def layers(self) -> list[_Layer]:
        """Per layer, the modules whose tensors `decoder_layers` takes, in its order (see `run`). Read only once
        `modules_fit` checked every module's class."""
        assert self.model is not None  # checked by `applies`
        layers = []
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer) and isinstance(layer.mlp, LlamaMLP)  # checked by `modules_fit`
            attention = layer.self_attn
            layers.append(
                _Layer(
                    layer.input_layernorm,
                    attention.qkv_proj,
                    attention.o_proj,
                    layer.post_attention_layernorm,
                    layer.mlp.gate_up_proj,
                    layer.mlp.down_proj,
                    attention.rotary_emb,
                    attention.attn,
                    attention,
                )
            )
        return layers

    def time_step(
        self,
        rows: int,
        block_size: int,
        kernel: ops.PagedKernels | None,
        num_blocks: int,
        variants: Sequence[Products],
    ) -> tuple[list[float], float] | None:
        """(seconds through the stack with each variant's products, seconds through the modules) of one decode
        step of `rows` sequences, each in a block of its own (the fastest of 5, all taking turns:
        `measurements.fastest_in_turn`), or None if the cache has fewer than `rows` blocks (a smaller step would be
        another batch class). Writes scratch keys and values into the first `rows` blocks of the cache: only
        before any request ran."""
        assert self.model is not None
        if rows > num_blocks:
            return None
        meta = AttentionMetadata.build(
            [1] * rows, [1] * rows, [[b] for b in range(rows)], block_size, kernel, self.deterministic
        )
        ctx = StepContext(meta)
        ids, positions = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
        model = self.model

        def stack(products: Products) -> Callable[[], object]:
            return lambda: self.run(self.embed(ids), positions, ctx, products)

        with torch.inference_mode():
            *stack_s, modules_s = fastest_in_turn([*map(stack, variants), lambda: model(ids, positions, ctx)], 5)
        return stack_s, modules_s

    def run(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext, products: Products | None = None
    ) -> torch.Tensor:
        """The layers and the final norm on the embedded tokens `x` of the pass `ctx` (its metadata and adapters),
        as `decoder_layers`, the products on the paths the policy chose (or `products`, for the calibration). The
        tensors are read from the modules at every call (weights and caches may be replaced), from their dicts
        directly: the nn.Module attribute lookup is a measurable part of a small step. Every RMSNorm of the model
        has the config's one epsilon, and every layer the first one's head layout."""
        assert self.model is not None  # checked by `applies`
        meta = ctx.attn
        first = self.layers[0].attention
        wide = x.dtype == torch.float32
        splits = (0, 0)
        if self.deterministic:  # every product native, the row-parallel ones split as the modules split them
            products = (True, True, True)
            splits = (first.o_proj.det_split, self.layers[0].down.det_split)
        linear, gated, silu = products or kernel_policy.products(ops.policy(), x.shape[0])
        onednn: list[bool] = []
        if not self.deterministic:
            if wide and x.shape[0] < ops.SMALL_BATCH_MIN_ROWS:  # the modules' fp32 products are torch's here
                linear = gated = False
            onednn = self.onednn if wide else []
        # a bf16 product that is not native takes the module's oneDNN-packed weight where the module would
        weight = _weight if wide or linear else _packed_or_weight
        gate_up_weight = _weight if wide or linear or gated else _packed_or_weight
        tensors: list[torch.Tensor | None] = []
        k_caches, v_caches = [], []
        for norm1, qkv, o, norm2, gate_up, down, rotary, attn, _ in self.layers:
            tensors += [
                norm1._parameters["weight"],
                weight(qkv),
                qkv._parameters.get("bias"),
                weight(o),
                o._parameters.get("bias"),
                norm2._parameters["weight"],
                gate_up_weight(gate_up),
                gate_up._parameters.get("bias"),
                weight(down),
                down._parameters.get("bias"),
                rotary._buffers["cos"],
                rotary._buffers["sin"],
            ]
            k_caches.append(attn.k_cache)
            v_caches.append(attn.v_cache)
        adapters, segments = self._lora_tensors(ctx.lora)
        return ops.decoder_layers(
            x,
            positions,
            tensors,
            k_caches,
            v_caches,
            meta.slot_mapping,
            meta.block_tables,
            meta.context_lens,
            meta.query_lens,
            first.attn.expand_index,
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            first.attn.scale,
            self.model.norm.eps,
            self.model.norm.weight,
            linear,
            gated,
            silu,
            *splits,
            adapters,
            segments,
            onednn,
        )

    @cached_property
    def onednn(self) -> list[bool]:
        """Per product (qkv, o, gate_up, down), whether an fp32 product off the native kernels goes to oneDNN, as
        the modules send it (`dense_faster` of its shape; every layer's weights have the first layer's shapes)."""
        _, qkv, o, _, gate_up, down, _, _, _ = self.layers[0]
        return [packing.dense_faster(*_weight(m).shape) for m in (qkv, o, gate_up, down)]

    def _lora_tensors(self, lora: LoRABatch | None) -> tuple[list[torch.Tensor | None], list[int]]:
        """The pass's LoRA adapters `lora` as `decoder_layers` takes them: per layer and row segment, (shrink,
        expand) of qkv, o, gate_up and down (None where not adapted), and each segment's (start, length)."""
        if lora is None:
            return [], []
        tensors: list[torch.Tensor | None] = []
        for _, qkv, o, _, gate_up, down, _, _, _ in self.layers:
            for group in lora.groups:
                for linear in (qkv, o, gate_up, down):
                    pack = group.packs.get(linear.lora_key) if linear.lora_key is not None else None
                    tensors += list(pack) if isinstance(pack, tuple) else [None, None]
        segments: list[int] = []
        for group in lora.groups:
            assert group.span is not None  # checked by `applies`
            segments += group.span
        return tensors, segments

    @staticmethod
    def _experts(packs: Packs) -> bool:
        return any(isinstance(p, dict) for p in packs.values())


def _weight(module: nn.Module) -> torch.Tensor:
    return module._parameters["weight"]  # type: ignore[return-value]  # every Linear has one


def _packed_or_weight(module: nn.Module) -> torch.Tensor:
    """The weight a half-precision product multiplies by: its oneDNN-packed copy where the module takes one."""
    weight = _weight(module)
    packed = packing.weight_for(module, weight)
    return weight if packed is None else packed
