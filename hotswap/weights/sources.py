"""Every way weights arrive, as one thing: a `WeightSource`, a declaration plus the (name, tensor) pairs.

The startup load, `reload_weights` by folder or iterator, and every transport (tensors, shm, torch_dist, disk)
build a source; `WeightUpdate.apply` is the only consumer. The declaration (names, dtypes, shapes) is complete
before any data is read, so it is checked against the model before anything moves.

`in_memory`: every tensor is readable at once (so values are checked before the first write). `verify` runs after the
data was copied into the model and raises if the data may have changed underneath (a torn shm write).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hotswap.model.safetensors_io import iterate_index, read_index

Declared = list[tuple[str, torch.dtype, tuple[int, ...]]]
NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class WeightSource:
    """A declaration and the tensors it promises, in declared order.

    `tensors()` yields (name, tensor) for the declared entries; a tensor may be a view into a transport buffer
    that is reused once the next one is requested. `pre_sliced` names entries that already are this rank's part.
    `complete` marks a full checkpoint: every weight of the model must be declared. `skip[i]` True means entry i
    is another rank's slice: it is received (a collective stream must be drained) but not loaded."""

    declared: Declared
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    in_memory: bool = False
    complete: bool = False
    pre_sliced: frozenset[str] = frozenset()
    skip: list[bool] | None = None
    verify: Callable[[], None] | None = None
    description: str = "update"

    def loaded_entries(self) -> Declared:
        """The declared entries this rank loads."""
        if self.skip is None:
            return self.declared
        return [d for d, skipped in zip(self.declared, self.skip, strict=True) if not skipped]

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors this rank loads (other ranks' slices are received and dropped)."""
        if self.skip is None:
            yield from self.tensors()
            return
        for item, skipped in zip(self.tensors(), self.skip, strict=False):
            if not skipped:
                yield item


def pairs_source(named_tensors: NamedTensors, description: str = "weights_iterator") -> WeightSource:
    """A source over in-memory (name, tensor) pairs; the iterable is consumed once, here (generators work)."""
    pairs = []
    for item in named_tensors:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"weights must be (name, tensor) pairs, got {type(item).__name__}")
        pairs.append((str(item[0]), item[1].detach()))
    return WeightSource(
        declared=[(n, t.dtype, tuple(t.shape)) for n, t in pairs],
        tensors=lambda: iter(pairs),
        in_memory=True,
        description=description,
    )


def folder_source(folder: str, complete: bool = True) -> WeightSource:
    """A safetensors checkpoint folder, read through a private memory map (no intermediate copies); names,
    dtypes and shapes come from the headers. Raises ValueError for a malformed or truncated folder."""
    index = read_index(folder)
    return WeightSource(
        declared=[(name, entry.dtype, entry.shape) for name, entry in index.items()],
        tensors=lambda: iterate_index(index),
        complete=complete,
        description=f"checkpoint {folder!r}",
    )


def random_source(shapes: dict[str, tuple[int, ...]], std: float = 0.02) -> WeightSource:
    """Random normal tensors of the given full shapes (load_format "dummy")."""
    return WeightSource(
        declared=[(name, torch.float32, shape) for name, shape in shapes.items()],
        tensors=lambda: ((name, torch.randn(shape) * std) for name, shape in shapes.items()),
        complete=True,
        description="dummy weights",
    )


@dataclass
class RankSelection:
    """Which declared entries a tensor-parallel rank loads: `update_info["tp_ranks"]`, when given, names the rank
    each tensor was sliced for (None: a whole tensor, every rank takes its part)."""

    rank: int
    size: int
    ranks: list[int | None] | None = field(default=None)

    @classmethod
    def from_update_info(cls, update_info: Any, rank: int, size: int) -> RankSelection:
        ranks = update_info.get("tp_ranks") if isinstance(update_info, dict) else None
        return cls(rank, size, ranks)

    def apply(self, source: WeightSource) -> WeightSource:
        """`source` with other ranks' slices skipped and this rank's marked pre-sliced. Raises ValueError for a
        malformed `tp_ranks`."""
        if self.ranks is None:
            return source
        count = len(source.declared)
        if not isinstance(self.ranks, list) or len(self.ranks) != count:
            raise ValueError(f"tp_ranks must list one rank (or None) per declared tensor ({count})")
        if any(r is not None and not (isinstance(r, int) and 0 <= r < self.size) for r in self.ranks):
            raise ValueError(f"tp_ranks entries must be None or ranks in [0, {self.size})")
        source.skip = [r is not None and r != self.rank for r in self.ranks]
        source.pre_sliced = frozenset(d[0] for d, r in zip(source.declared, self.ranks, strict=True) if r == self.rank)
        return source
