"""Vocab-parallel token embedding, also the LM head (tied or not); implements `ShardedWeights`.

Each rank holds a contiguous block of ceil(V / ranks) rows (the last block zero-padded). A lookup zeroes ids
outside the block and all-reduces; the LM head computes this block's logits and all-gathers them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.kernels import ops
from hotswap.kernels import packed as packing
from hotswap.model.settings import LayerSettings
from hotswap.weights.sharded import Narrowing


class VocabEmbedding(nn.Module):
    """`settings`: this rank's share (`parallel`) and the LM head's product mode (`deterministic`)."""

    def __init__(self, num_embeddings: int, dim: int, settings: LayerSettings) -> None:
        super().__init__()
        self.tp = settings.parallel
        self.deterministic = settings.deterministic
        self.num_embeddings = num_embeddings
        self.rows = -(-num_embeddings // self.tp.size)
        self.start = self.tp.rank * self.rows
        self.valid = max(0, min(num_embeddings - self.start, self.rows))  # real (unpadded) rows on this rank
        self.weight = nn.Parameter(torch.empty(self.rows, dim), requires_grad=False)
        if self.valid < self.rows:
            self.weight.data[self.valid :].zero_()

    def checkpoint_shape(self, param: nn.Parameter, shard_id: object = None) -> tuple[int, ...]:
        return (self.num_embeddings, self.weight.shape[1])

    def local_view(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        return param.data[: self.valid]

    def narrowings(self, param: nn.Parameter, shard_id: object = None) -> Narrowing:
        return [(0, self.start, self.valid)]

    def load_weight(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None, pre_sliced: bool = False
    ) -> None:
        """Copies this rank's rows of the full [vocab, dim] table (or, `pre_sliced`, just those rows) in place."""
        packing.drop(self)
        if not pre_sliced:
            loaded = loaded.narrow(0, self.start, self.valid)
        ops.copy_(self.local_view(param), loaded)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.start + self.valid)
        out = F.embedding((ids - self.start).clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the whole vocabulary for `hidden` [T, dim] (gathered from every rank)."""
        packed = packing.weight_for(self, self.weight)
        local = ops.linear(hidden, self.weight, None, packed, self.deterministic).float()
        return self.tp.all_gather_last_dim(local)[..., : self.num_embeddings]
