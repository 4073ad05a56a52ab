"""The SwiGLU gate: silu(gate) * up over the two halves of a fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.kernels import native


class SiluAndMul(nn.Module):
    """[T, 2I] -> [T, I]: `F.silu(x[:, :I]) * x[:, I:]`, in one pass with the native kernel (2-D float32, bfloat16
    or float16 CPU input with contiguous rows, no autograd), else with torch ops."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = native.ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.kernels is not None
            and native.wide_vector_kernels_win()
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.stride(-1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not (torch.is_grad_enabled() and x.requires_grad)
        ):
            return self.kernels.silu_and_mul(x)
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]
