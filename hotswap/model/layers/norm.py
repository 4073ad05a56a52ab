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

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given `residual`, (norm(residual + x), residual + x) where the sum may be written into
        `residual` in place (the caller owns it)."""
        fused = self.kernels is not None and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps) if fused else self._norm(x)
        if fused and residual.is_contiguous():
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
