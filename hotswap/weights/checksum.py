"""Checksums that let a trainer verify the engine holds exactly the tensors it sent."""

from __future__ import annotations

import hashlib
from collections.abc import Generator

import torch

CHUNK_BYTES = 2 << 20  # hashed between two yields of `sha256_steps` (about 1 ms with SHA extensions)


def tensor_sha256(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """SHA-256 of the tensor's bytes in row-major order (after casting to `dtype` when given)."""
    steps = sha256_steps(tensor, dtype)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return str(stop.value)


def sha256_steps(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> Generator[None, None, str]:
    """`tensor_sha256`, yielding after each `CHUNK_BYTES` hashed (a staged update verifies between steps)."""
    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    data = memoryview(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
    digest = hashlib.sha256()
    for start in range(0, len(data), CHUNK_BYTES):
        digest.update(data[start : start + CHUNK_BYTES])
        yield
    return digest.hexdigest()
