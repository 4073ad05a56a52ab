"""FP8 weight-only quantization: float8_e4m3fn weights with one float32 scale per output channel, or (the
mixture-of-experts layer's block scheme) one per b0 x b1 tile.

Scales are computed from the high-precision weights (amax of each row or tile / the format's max), so quantizing
a row (a tile) depends on that row (tile) alone: a partial update re-quantizes exactly the rows it rewrote.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale per row) such that dequantize(q, s) approximates `weight` [N, K]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def _block_view(shape: torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[-2] // block[0]), -(-shape[-1] // block[1])


def expand_block_scales(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Per-element scales [..., N, K] from block scales [..., ceil(N / b0), ceil(K / b1)]."""
    rows = scale.repeat_interleave(block[0], dim=-2)[..., : shape[-2], :]
    return rows.repeat_interleave(block[1], dim=-1)[..., : shape[-1]]


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale per `block` tile [..., ceil(N / b0), ceil(K / b1)]) of `weight` [..., N, K],
    as DeepSeek / Qwen FP8 checkpoints store them (`weight_scale_inv`: the dequantized weight is q * scale).
    A tile's scale depends on that tile alone."""
    w = weight.float()
    n, k = w.shape[-2:]
    nb, kb = _block_view(w.shape, block)
    padded = torch.zeros(*w.shape[:-2], nb * block[0], kb * block[1], device=w.device)
    padded[..., :n, :k] = w
    tiles = padded.view(*w.shape[:-2], nb, block[0], kb, block[1])
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=1e-12)
    q = (w / expand_block_scales(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * expand_block_scales(scale, q.shape, block)).to(dtype)
