"""Checksums that let a trainer verify the engine holds exactly the tensors it sent."""

from __future__ import annotations

import hashlib

import torch


def tensor_sha256(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """SHA-256 of the tensor's bytes in row-major order (after casting to `dtype` when given)."""
    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    data = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()
