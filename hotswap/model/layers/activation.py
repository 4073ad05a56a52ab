"""The SwiGLU gate: silu(gate) * up over the two halves of a fused gate_up projection."""

from __future__ import annotations

import torch
from torch import nn

from hotswap.kernels import ops


class SiluAndMul(nn.Module):
    """[T, 2I] -> [T, I]: `F.silu(x[:, :I]) * x[:, I:]` (`ops.silu_and_mul`; `deterministic`: the batch-invariant
    kernel)."""

    def __init__(self, *, deterministic: bool) -> None:
        super().__init__()
        self.deterministic = deterministic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x, self.deterministic)
