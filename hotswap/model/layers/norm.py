"""RMSNorm, computed in float32 as Hugging Face does, optionally fused with the residual add before it."""

from __future__ import annotations

import torch
from torch import nn

from hotswap.kernels import native


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.kernels = native.ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            assert self.kernels is not None  # checked by `_fused`
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). The sum may be written into `residual` in place: the caller owns
        it and must not need its old value."""
        if self._fused(x) and residual.is_contiguous():
            assert self.kernels is not None  # checked by `_fused`
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self._norm(residual), residual

    def _fused(self, x: torch.Tensor) -> bool:
        return self.kernels is not None and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
