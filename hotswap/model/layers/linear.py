"""Linear layers, replicated or tensor-parallel, implementing the `ShardedWeights` layout protocol.

`load_weight(param, loaded, shard_id)` takes a full checkpoint tensor and copies this rank's part of it into the
parameter's existing storage (never rebinding it). Packed layers (q/k/v, gate/up) describe each shard by a
`ShardSpec`: which rows of that shard's checkpoint tensor this rank keeps and where they go in the fused
parameter. Tensor parallelism: "column" splits output rows across ranks; "row" splits
input columns and all-reduces the output (the bias is added once, after the reduction).

Every layer is built with its `LayerSettings` (hotswap/model/settings.py): the rank and group size, the dtype,
the quantization and deterministic mode. With `quantization="fp8"` the weight is stored as float8 with a per-row
scale. Incoming high-precision rows are staged, and `process_weights_after_loading` quantizes the staged rows
into the existing fp8 and scale storage, then frees the stage.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
from torch import nn

from hotswap.distributed import split
from hotswap.kernels import ops
from hotswap.kernels import packed as packing
from hotswap.model.layers.quant.fp8 import FP8_DTYPE, dequantize, quantize_per_channel
from hotswap.model.lora_batch import LoRABatch
from hotswap.model.settings import LayerSettings
from hotswap.weights.sharded import Narrowing


class ShardSpec(NamedTuple):
    """Rows [ckpt_start, ckpt_start + size) of a checkpoint tensor with `ckpt_rows` rows go to local rows
    [local_offset, local_offset + size) of the parameter."""

    local_offset: int
    size: int
    ckpt_rows: int
    ckpt_start: int


def _param(shape: tuple[int, ...], dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). `parallel` is None (replicated), "column" or "row"; ignored on a single rank. Shares
    may be uneven (the first ranks take one more). `quantizable` False keeps the weight in high precision.

    Deterministic mode (`settings.deterministic`): a row-parallel product sums its ranks' partial products in rank
    order, and on one rank it is computed as the two partial products two ranks would compute (the input split at
    `det_split`, by default the first of two shares), summed the same way: one rank equals two, bit for bit. An
    fp8 weight there has a scale per row and per half, as two ranks quantize their shares."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        settings: LayerSettings,
        bias: bool = False,
        quantizable: bool = True,
        parallel: str | None = None,
        shard_specs: dict[object, ShardSpec] | None = None,
        in_split: tuple[int, int] | None = None,
        det_split: int | None = None,
    ) -> None:
        super().__init__()
        self.tp = settings.parallel
        self.deterministic = settings.deterministic
        self.parallel = parallel if self.tp.size > 1 else None
        # one rank of a row-parallel product: where the first of two ranks' inputs would end (0: not row-parallel)
        self.det_split = 0
        if parallel == "row" and self.tp.size == 1:
            self.det_split = det_split if det_split is not None else split(in_features, 0, 2)[1]
        self.in_features, self.out_features = in_features, out_features
        if shard_specs is None:
            start, size = (0, out_features)
            if self.parallel == "column":
                start, size = split(out_features, self.tp.rank, self.tp.size)
            shard_specs = {None: ShardSpec(0, size, out_features, start)}
        self.shard_specs = shard_specs
        self.out_local = sum(s.size for s in shard_specs.values())
        self.in_start, self.in_local = 0, in_features
        if self.parallel == "row":  # `in_split` aligns the split with the producer's (e.g. whole heads)
            self.in_start, self.in_local = in_split or split(in_features, self.tp.rank, self.tp.size)
        self.fp8 = quantizable and settings.fp8
        self.weight = _param((self.out_local, self.in_local), FP8_DTYPE if self.fp8 else None)
        self.stage_dtype = settings.dtype if self.fp8 else None  # fp8: the stage's dtype
        if self.fp8:
            # deterministic mode, one rank of a row-parallel product: a scale per row and per half (the shares of
            # two ranks), so that the quantized weight is the two ranks' (see the class)
            halves = self.det_split > 0 and self.deterministic
            self.weight_scale = _param((self.out_local, 2) if halves else (self.out_local,), torch.float32)
            # computed by post-processing, never loaded (an ad-hoc tag, read back with getattr)
            self.weight_scale.hotswap_derived = True  # type: ignore[attr-defined]
            self._stage: torch.Tensor | None = None
            self._staged_rows: torch.Tensor | None = None
        if bias:
            self.bias = _param((self.out_features if self.parallel == "row" else self.out_local,))
        else:
            self.register_parameter("bias", None)

    def _spec(self, shard_id: object) -> ShardSpec:
        if shard_id not in self.shard_specs:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_specs)}")
        return self.shard_specs[shard_id]

    def checkpoint_shape(self, param: nn.Parameter, shard_id: object = None) -> tuple[int, ...]:
        """The full checkpoint tensor's shape for `param`'s shard `shard_id`."""
        if param is self.bias and self.parallel == "row":
            return (self.out_features,)
        rows = self._spec(shard_id).ckpt_rows
        return (rows, self.in_features) if param is self.weight else (rows,)

    @property
    def stages_weights(self) -> bool:
        """fp8: loads go to a high-precision stage; only post-processing writes the parameters."""
        return self.fp8

    def local_view(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        """This rank's slice of `param` that shard `shard_id` occupies."""
        if param is self.bias and self.parallel == "row":
            return param.data
        spec = self._spec(shard_id)
        return param.data.narrow(0, spec.local_offset, spec.size)

    def load_weight(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None, pre_sliced: bool = False
    ) -> None:
        """Copies this rank's part of the full checkpoint tensor `loaded` (or, `pre_sliced`, the part itself)
        into shard `shard_id` of `param` in place (for an fp8 weight: into the stage)."""
        packing.drop(self)
        if param is self.bias and self.parallel == "row":
            ops.copy_(param.data, loaded)
            return
        spec = self._spec(shard_id)
        part = loaded
        if not pre_sliced:
            part = loaded.narrow(0, spec.ckpt_start, spec.size)
            if param is self.weight and self.parallel == "row":
                part = part.narrow(1, self.in_start, self.in_local)
        if not (self.fp8 and param is self.weight):
            ops.copy_(self.local_view(param, shard_id), part)
            return
        if self._stage is None:
            self._stage = torch.empty(self.weight.shape, dtype=self.stage_dtype, device=self.weight.device)
            self._staged_rows = torch.zeros(self.out_local, dtype=torch.bool, device=self.weight.device)
        ops.copy_(self._stage.narrow(0, spec.local_offset, spec.size), part)
        assert self._staged_rows is not None  # allocated and freed with the stage
        self._staged_rows[spec.local_offset : spec.local_offset + spec.size] = True

    def narrowings(self, param: nn.Parameter, shard_id: object = None) -> Narrowing:
        """(dim, start, length) narrowings that cut this rank's part out of the full checkpoint tensor."""
        if param is self.bias and self.parallel == "row":
            return []
        spec = self._spec(shard_id)
        plan = [(0, spec.ckpt_start, spec.size)]
        if param is self.weight and self.parallel == "row":
            plan.append((1, self.in_start, self.in_local))
        return plan

    def process_weights_after_loading(self) -> None:
        """Quantizes the staged high-precision rows into the fp8 weight and its scales (in place)."""
        if not self.fp8 or self._stage is None:
            return
        assert self._staged_rows is not None  # allocated and freed with the stage
        rows = self._staged_rows.nonzero().squeeze(1)
        if self.weight_scale.dim() == 2:  # a scale per half (see __init__)
            staged, s = self._stage[rows], self.det_split
            (q0, s0), (q1, s1) = quantize_per_channel(staged[:, :s]), quantize_per_channel(staged[:, s:])
            self.weight.data[rows] = torch.cat([q0, q1], dim=1)
            self.weight_scale.data[rows] = torch.stack([s0, s1], dim=1)
        else:
            q, scale = quantize_per_channel(self._stage[rows])
            self.weight.data[rows] = q
            self.weight_scale.data[rows] = scale
        self.discard_stage()

    def discard_stage(self) -> None:
        if self.fp8:
            self._stage = self._staged_rows = None

    def effective_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight to multiply by: the parameter itself, or for fp8 its dequantized copy in `dtype`."""
        if self.fp8 and self.weight_scale.dim() == 2:  # a scale per half (see __init__)
            widths = torch.tensor([self.det_split, self.in_local - self.det_split], device=self.weight.device)
            return (self.weight.float() * self.weight_scale.repeat_interleave(widths, dim=1)).to(dtype)
        return dequantize(self.weight, self.weight_scale, dtype) if self.fp8 else self.weight

    def packed(self) -> torch.Tensor | None:
        """The weight's oneDNN-packed bf16 copy where that path applies (`kernels/packed.py`), else None."""
        return None if self.fp8 else packing.weight_for(self, self.weight)

    # this layer's module name in the model, set where LoRA adapters are enabled (hotswap/lora/manager.py)
    lora_key: str | None = None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """`x · Wᵀ + b` (summed over ranks for a row-parallel layer), plus the pass's adapters `lora` where this
        layer has a `lora_key`."""
        weight = self.effective_weight(x.dtype)
        det = self.deterministic
        if self.parallel == "row":
            partial = ops.linear(x, weight, None, self.packed(), det)
            out = self.tp.sum_in_rank_order(partial) if det else self.tp.all_reduce(partial)
            out = out if self.bias is None else out + self.bias
        elif 0 < self.det_split < self.in_features and det:
            # the two ranks' partial products, added, then the bias (see the class)
            return ops.split_linear(x, weight, self.bias, self.det_split)
        else:
            out = ops.linear(x, weight, self.bias, self.packed(), det)
        if lora is not None and self.lora_key is not None:
            out = lora.apply(self.lora_key, x, out, self.tp.all_reduce if self.parallel == "row" else None)
        return out


class QKVLinear(Linear):
    """Fused q/k/v projection; shards 'q', 'k', 'v'. Column-parallel by heads: a rank keeps its q heads and the
    KV heads they use (KV heads are replicated where ranks outnumber them)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, settings: LayerSettings
    ) -> None:
        tp = settings.parallel
        q_start, q_heads = split(num_heads, tp.rank, tp.size)
        self.q_start = q_start
        group = num_heads // num_kv_heads
        self.kv_start = q_start // group
        kv_end = (q_start + q_heads - 1) // group + 1
        kv_heads = kv_end - self.kv_start
        self.num_local_heads, self.num_local_kv_heads = q_heads, kv_heads
        # the local KV head each local q head attends with
        self.kv_of_q = [(q_start + i) // group - self.kv_start for i in range(q_heads)]
        q, kv = q_heads * head_dim, kv_heads * head_dim
        specs: dict[object, ShardSpec] = {
            "q": ShardSpec(0, q, num_heads * head_dim, q_start * head_dim),
            "k": ShardSpec(q, kv, num_kv_heads * head_dim, self.kv_start * head_dim),
            "v": ShardSpec(q + kv, kv, num_kv_heads * head_dim, self.kv_start * head_dim),
        }
        super().__init__(
            hidden_size,
            (num_heads + 2 * num_kv_heads) * head_dim,
            settings,
            bias,
            parallel="column",
            shard_specs=specs,
        )


class MergedLinear(Linear):
    """Several projections of the same input concatenated by rows (shard i is the i-th); column-parallel: each
    rank keeps its share of every projection."""

    def __init__(self, in_features: int, out_sizes: list[int], settings: LayerSettings, bias: bool = False) -> None:
        tp = settings.parallel
        specs: dict[object, ShardSpec] = {}
        offset = 0
        for i, size in enumerate(out_sizes):
            start, local = split(size, tp.rank, tp.size)
            specs[i] = ShardSpec(offset, local, size, start)
            offset += local
        super().__init__(in_features, sum(out_sizes), settings, bias, parallel="column", shard_specs=specs)
        self.gate_and_up = len(out_sizes) == 2 and out_sizes[0] == out_sizes[1]

    def forward_silu_and_mul(self, x: torch.Tensor, act: nn.Module, lora: LoRABatch | None = None) -> torch.Tensor:
        """`act(self(x, lora))` for a [gate; up] projection and its SwiGLU activation `act` (SiluAndMul), as one
        `ops.gated_linear` (the gate applied as the product is written, where the native kernel takes it)."""
        if lora is not None and lora.touches(self.lora_key):
            return cast(torch.Tensor, act(self(x, lora)))  # the adapter's share joins before the activation
        weight = self.effective_weight(x.dtype)  # dequantized once either way
        if self.gate_and_up:
            return ops.gated_linear(x, weight, self.bias, self.packed(), self.deterministic)
        # column-parallel: forward() is this product
        return cast(torch.Tensor, act(ops.linear(x, weight, self.bias, self.packed(), self.deterministic)))
