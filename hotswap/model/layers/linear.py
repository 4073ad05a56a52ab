"""Linear layers whose parameters load themselves.

Every parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies a checkpoint tensor into the
parameter's existing storage (never rebinding it). Packed layers (q/k/v, gate/up) expose `shard_slices`, mapping
a shard id to the (offset, size) of its rows, so a tensor arriving for one shard lands in its slice.

With `quantization="fp8"` in the live config at construction, the weight is stored as float8 with a per-row
scale. Incoming high-precision rows are staged, and `process_weights_after_loading` quantizes the staged rows
into the existing fp8 and scale storage, then frees the stage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.config import current_config
from hotswap.model.layers.quant.fp8 import FP8_DTYPE, dequantize, quantize_per_channel


def copy_into(target: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copies `loaded` into `target` in place (casting dtype). Raises ValueError if the shapes disagree."""
    if tuple(loaded.shape) != tuple(target.shape):
        raise ValueError(f"{name}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
    with torch.no_grad():
        target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Copies a whole tensor into `param`. Raises ValueError on a shape mismatch."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
    copy_into(param.data, loaded, getattr(param, "hotswap_name", "parameter"))


def _param(shape: tuple[int, ...], dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). `shard_slices` is empty for an unpacked layer. `quantizable` False keeps the weight in
    high precision whatever the config says (the LM head)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quantizable: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.shard_slices: dict[object, tuple[int, int]] = {}
        self.fp8 = quantizable and current_config().quant_config.quantization == "fp8"
        self.weight = _param((out_features, in_features), FP8_DTYPE if self.fp8 else None)
        self.weight.weight_loader = self.weight_loader
        if self.fp8:
            self.weight_scale = _param((out_features,), torch.float32)
            self.weight_scale.hotswap_derived = True  # computed by post-processing, never loaded
            self._stage: torch.Tensor | None = None
            self._staged_rows: torch.Tensor | None = None
        if bias:
            self.bias = _param((out_features,))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def shard_view(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        """The slice of `param` that shard `shard_id` (None: the whole tensor) occupies."""
        offset, size = self._rows(shard_id, param.shape[0])
        return param.data.narrow(0, offset, size)

    def _rows(self, shard_id: object, total: int) -> tuple[int, int]:
        if shard_id is None:
            return 0, total
        if shard_id not in self.shard_slices:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_slices)}")
        return self.shard_slices[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Copies `loaded` into shard `shard_id` of `param` in place (for an fp8 weight: into the stage).
        Raises ValueError on a shape mismatch."""
        name = getattr(param, "hotswap_name", "parameter")
        if not (self.fp8 and param is self.weight):
            copy_into(self.shard_view(param, shard_id), loaded, name)
            return
        if self._stage is None:
            self._stage = torch.empty(self.weight.shape, dtype=current_config().model_config.torch_dtype)
            self._staged_rows = torch.zeros(self.out_features, dtype=torch.bool)
        offset, size = self._rows(shard_id, self.out_features)
        copy_into(self._stage.narrow(0, offset, size), loaded, name)
        self._staged_rows[offset : offset + size] = True

    def process_weights_after_loading(self) -> None:
        """Quantizes the staged high-precision rows into the fp8 weight and its scales (in place)."""
        if not self.fp8 or self._stage is None:
            return
        assert current_config().quant_config.quantization == "fp8", "fp8 layer outside an fp8 config"
        rows = self._staged_rows.nonzero().squeeze(1)
        q, scale = quantize_per_channel(self._stage[rows])
        self.weight.data[rows] = q
        self.weight_scale.data[rows] = scale
        self.discard_stage()

    def discard_stage(self) -> None:
        if self.fp8:
            self._stage = self._staged_rows = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            return F.linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)
        return F.linear(x, self.weight, self.bias)


class QKVLinear(Linear):
    """Fused q/k/v projection; shards 'q', 'k', 'v' are consecutive row blocks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, q + 2 * kv, bias)
        self.shard_slices = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}


class MergedLinear(Linear):
    """Several projections of the same input concatenated by rows; shard i is the i-th block."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.shard_slices = {i: (off, size) for i, (off, size) in enumerate(zip(offsets, out_sizes, strict=True))}
