"""A staged update's copies and checks in chunks: no slice of work between two engine steps holds a whole large
tensor."""

from __future__ import annotations

from collections.abc import Generator, Iterator

import torch

from hotswap.kernels import ops

CHUNK_BYTES = 2 << 20  # what a staged update copies or checks between two yields


def row_chunks(t: torch.Tensor) -> Iterator[slice | tuple[()]]:
    """Index expressions cutting `t` along dim 0 into pieces of about `CHUNK_BYTES` (a 0-d tensor: one, whole)."""
    if t.dim() == 0 or t.numel() == 0:
        yield ()
        return
    row_bytes = max(1, t[0].numel() * t.element_size())
    step = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, t.shape[0], step):
        yield slice(start, start + step)


def chunked_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Generator[None, None, None]:
    """Copies each (dst, src) pair in `row_chunks`, yielding after each chunk."""
    for dst, src in pairs:
        for rows in row_chunks(dst):
            ops.copy_(dst[rows], src[rows])
            yield
