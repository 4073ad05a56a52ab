"""What feeds an update: every way weights arrive is a `WeightSource`, a declaration plus the (name, tensor) pairs.

The startup load, `reload_weights` by folder or iterator, and every transport (tensors, shm, torch_dist, disk)
build one, and `WeightUpdate.apply` (hotswap/weights/update.py) is its only consumer. The declaration (names,
dtypes, shapes) is complete before any data is read, so it is checked against the model before anything moves.
A source's stream carries tensors, or `Patch`es: the elements a sparse delta writes in place.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from hotswap.weights.safetensors_io import iterate_index, read_index

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
    # run after the last tensor loaded; it may return a generator (run to its end), which a staged update runs
    # between steps
    verify: Callable[[], Generator[None, None, None] | None] | None = None
    reads_served: bool = False  # decoding reads the weights it updates (a delta): staging copies start as them
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
        name, tensor = str(item[0]), item[1]
        if tensor.layout is not torch.strided or tensor.is_meta or tensor.is_quantized:
            raise ValueError(f"{name}: a dense tensor with data is needed, got a {tensor.layout} / meta tensor")
        pairs.append((name, tensor.detach()))
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


def prefixed_source(source: WeightSource, prefix: str) -> WeightSource:
    """`source` with `prefix` put before every name that lacks it (draft tensors sent under their own names)."""
    return renamed_source(source, prefixer(prefix))


def prefixer(prefix: str) -> Callable[[str], str]:
    """The renaming that puts `prefix` before a name that lacks it."""
    return lambda n: n if n.startswith(prefix) else prefix + n


def renamed_source(source: WeightSource, name: Callable[[str], str]) -> WeightSource:
    """`source` with every name `n` called `name(n)`."""
    inner = source.tensors
    return WeightSource(
        declared=[(name(n), d, s) for n, d, s in source.declared],
        tensors=lambda: ((name(n), t) for n, t in inner()),
        in_memory=source.in_memory,
        complete=source.complete,
        pre_sliced=frozenset(name(n) for n in source.pre_sliced),
        skip=source.skip,
        verify=source.verify,
        description=source.description,
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
    def from_update_info(cls, update_info: object, rank: int, size: int) -> RankSelection:
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


# ---- a sparse delta's pieces (hotswap/weights/delta.py) -----------------------------------------------------


@dataclass
class PendingHalf:
    """One half of a sparse delta's pair ("indices" or "values") whose partner has not arrived yet in this update
    (hotswap/weights/delta.py); `pre_sliced`: it is already this rank's part."""

    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    tensor: torch.Tensor
    pre_sliced: bool


class Patch:
    """Elements of one tensor's local part written in place: flat `indices` into it (int64) and their new
    `values` (the parameter's dtype). What a sparse delta becomes (hotswap/weights/delta.py)."""

    __slots__ = ("indices", "values")

    def __init__(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        self.indices, self.values = indices, values
