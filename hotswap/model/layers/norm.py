"""RMSNorm, computed in float32 as Hugging Face does, optionally fused with the residual add before it."""

from __future__ import annotations

import torch
from torch import nn

from hotswap.kernels import ops


class RMSNorm(nn.Module):
    """`deterministic`: the batch-invariant kernels (`LayerSettings.deterministic`); named at every construction."""

    def __init__(self, size: int, eps: float, *, deterministic: bool) -> None:
        super().__init__()
        self.eps, self.deterministic = eps, deterministic
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.deterministic)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). The sum may be written into `residual` in place: the caller owns
        it and must not need its old value."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, self.deterministic)
