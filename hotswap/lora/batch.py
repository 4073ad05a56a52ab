"""A forward pass's adapters. The model runner opens `lora_batch(...)` around a pass whose rows use adapters;
each targeted linear layer adds, for every adapter of the pass, (x @ shrink) @ expand to the output rows of
that adapter (all rows at once when one adapter serves them all)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

Pack = tuple[torch.Tensor, torch.Tensor]  # (shrink [in, R], expand [R, out]): out += (x @ shrink) @ expand



@dataclass
class LoRAGroup:
    """The rows of a pass that one adapter version serves (None: every row), and its packs by layer name."""

    packs: dict[str, Pack]
    rows: torch.Tensor | None


class LoRABatch:
    def __init__(self, groups: list[LoRAGroup]) -> None:
        self.groups = groups

    def touches(self, key: str | None) -> bool:
        """Whether layer `key` (a base linear module's name) has an adapter in this pass."""
        return key is not None and any(key in g.packs for g in self.groups)

    def apply(self, key: str, x: torch.Tensor, out: torch.Tensor,
              reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """`out` (the base layer's output for input rows `x`) plus every adapter's contribution, in place.
        `reduce`: sums the rank-sized partial products across tensor-parallel ranks (a row-parallel layer, whose
        `x` is this rank's input columns)."""
        for group in self.groups:
            pack = group.packs.get(key)
            if pack is None:
                continue
            shrink, expand = pack
            rows = group.rows
            h = (x if rows is None else x.index_select(0, rows)) @ shrink.to(x.dtype)
            if reduce is not None:
                h = reduce(h)
            if rows is None:
                out.addmm_(h, expand.to(out.dtype))
            else:
                out.index_add_(0, rows, h @ expand.to(out.dtype))
        return out


_ACTIVE: contextvars.ContextVar[LoRABatch | None] = contextvars.ContextVar("hotswap_lora_batch", default=None)


def active_lora() -> LoRABatch | None:
    """The adapters of the forward pass running now (None: no row uses one)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    token = _ACTIVE.set(batch)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
