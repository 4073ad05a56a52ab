"""Tensor-parallel context of the current worker: its rank, the group size and the process group.

Like the config, it is scoped: a Worker enters `use_parallel(...)` with its config. Layers take theirs at
construction (`LayerSettings.parallel`, hotswap/model/settings.py) to size their shards and keep the group for their
collectives; transports and the runner read `current_parallel()`. Outside any scope the context is the
single-process one (rank 0 of 1).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any

import torch

from hotswap.config import scoped


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` across ranks in place (a no-op on one rank)."""
        if self.size > 1:
            self.group.allreduce([tensor]).wait()
        return tensor

    def sum_in_rank_order(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `tensor`, computed as ((rank 0 + rank 1) + rank 2) + ... on each rank: the same
        bits on every rank, in every run, whatever algorithm the collective library picks (deterministic mode;
        `tensor` itself is left as it was on more than one rank)."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.allgather([parts], [tensor.contiguous()]).wait()
        total = parts[0]
        for part in parts[1:]:
            total += part
        return total

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrites `tensor` on every rank with rank `src`'s, in place (a no-op on one rank)."""
        if self.size > 1:
            import torch.distributed as dist

            opts = dist.BroadcastOptions()
            opts.rootRank = src
            self.group.broadcast([tensor], opts).wait()
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's `tensor` along the last dimension, in rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=-1)


SINGLE = ParallelContext()
_CURRENT: contextvars.ContextVar[ParallelContext] = contextvars.ContextVar("hotswap_parallel", default=SINGLE)


def use_parallel(context: ParallelContext) -> contextlib.AbstractContextManager[ParallelContext]:
    """Makes `context` the current parallel context inside the block (restored on exit, also on error)."""
    return scoped(_CURRENT, context)


def current_parallel() -> ParallelContext:
    return _CURRENT.get()


def split(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of rank's contiguous share of `total` items; the first `total % size` ranks get one
    more (e.g. 9 heads over 2 ranks: 5 and 4)."""
    base, extra = divmod(total, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)
