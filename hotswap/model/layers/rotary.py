"""Rotary position embedding with a precomputed cos/sin table.

Reads either config style: `rope_theta` + `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5).
Supports the default and llama3 rope types.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hotswap.kernels import ops


def rope_settings(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either config style; scaling is None for plain RoPE."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = params if params.get("rope_type", "default") != "default" else None
        return theta, scaling
    theta = float(hf_config.get("rope_theta", 10000.0))
    scaling = hf_config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """`deterministic`: the batch-invariant kernel (`LayerSettings.deterministic`)."""

    cos: torch.Tensor  # buffers, registered in __init__
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        *,
        deterministic: bool,
    ) -> None:
        super().__init__()
        self.deterministic = deterministic
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"rope scaling type {kind!r} is not supported; supported: default, llama3")
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q [T, H, D] and k [T, KVH, D] for token positions [T]; returns new contiguous tensors."""
        return ops.rotary(q, k, positions, self.cos, self.sin, self.deterministic)
