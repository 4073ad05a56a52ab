"""How a module's parameters map to full checkpoint tensors: the one protocol every weight path goes through.

A module whose parameters are (or may be) a rank's part of a larger checkpoint tensor, or a slice of a fused
parameter, implements `ShardedWeights`. Modules that do not are treated as `REPLICATED`: every parameter is one
whole checkpoint tensor. `shard_id` names a slice of a fused parameter (e.g. "q" of qkv_proj), None for the whole.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from hotswap.kernels import ops

# (dim, start, length) narrowings that cut a rank's part out of a full checkpoint tensor, applied in order
Narrowing = list[tuple[int, int, int]]


@runtime_checkable
class ShardedWeights(Protocol):
    """The layout contract of a module's parameters. Implementations must agree with each other:
    `local_view(p, s).shape` is the full tensor of `checkpoint_shape(p, s)` cut by `narrowings(p, s)`, and
    `load_weight` writes exactly `local_view(p, s)` (or, for a module that stages, its stage for that view)."""

    def checkpoint_shape(self, param: nn.Parameter, shard_id: object = None) -> tuple[int, ...]:
        """Shape of the full checkpoint tensor behind shard `shard_id` of `param`."""
        ...

    def local_view(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        """The part of `param`'s storage that shard `shard_id` occupies on this rank (a view, never a copy)."""
        ...

    def narrowings(self, param: nn.Parameter, shard_id: object = None) -> Narrowing:
        """How this rank's part is cut out of the full checkpoint tensor (empty: the rank holds it whole)."""
        ...

    def load_weight(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None, pre_sliced: bool = False
    ) -> None:
        """Copies the full checkpoint tensor `loaded` (or, `pre_sliced`, this rank's part of it) into shard
        `shard_id` of `param` in place, casting its dtype; storage is never rebound. The caller has checked the
        shape against `checkpoint_shape` (or `local_view`'s) and disabled autograd."""
        ...


class _Replicated:
    """`ShardedWeights` of a module that holds every parameter whole (norms, and anything on one rank)."""

    def checkpoint_shape(self, param: nn.Parameter, shard_id: object = None) -> tuple[int, ...]:
        return tuple(param.shape)

    def local_view(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        return param.data

    def narrowings(self, param: nn.Parameter, shard_id: object = None) -> Narrowing:
        return []

    def load_weight(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None, pre_sliced: bool = False
    ) -> None:
        ops.copy_(param.data, loaded)


REPLICATED: ShardedWeights = _Replicated()


def layout_of(module: nn.Module) -> ShardedWeights:
    """The module's own layout if it implements `ShardedWeights`, else `REPLICATED`."""
    return module if isinstance(module, ShardedWeights) else REPLICATED
