"""A forward pass's adapters. The model runner puts a `LoRABatch` in the `StepContext` of a pass whose rows use
adapters (hotswap/model/step.py); each targeted linear layer adds, for every adapter of the pass,
(x @ shrink) @ expand to the output rows of that adapter (all rows at once when one adapter serves them all)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Pack = tuple[torch.Tensor, torch.Tensor]  # (shrink [in, R], expand [R, out]): out += (x @ shrink) @ expand
# a group's packs by layer name: a linear layer's Pack, a fused experts module's {"w13" | "w2": Pack}
# (FusedMoE._add_lora)
Packs = dict[str, Pack | dict[str, Pack]]


@dataclass
class LoRAGroup:
    """The rows of a pass that one adapter version serves, and its packs by layer name: `span` (start, length)
    where they are consecutive (the engine orders a step's sequences by adapter), else `rows`, their indices."""

    packs: Packs
    span: tuple[int, int] | None
    rows: torch.Tensor | None = None

    def token_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """Whether each of `tokens` (flat row indices) is one of this group's rows."""
        if self.span is not None:
            start, length = self.span
            return (tokens >= start) & (tokens < start + length)
        assert self.rows is not None  # a group has a span or its rows
        return torch.isin(tokens, self.rows)


class LoRABatch:
    def __init__(self, groups: list[LoRAGroup]) -> None:
        self.groups = groups

    def touches(self, key: str | None) -> bool:
        """Whether layer `key` (a base linear module's name) has an adapter in this pass."""
        return key is not None and any(key in g.packs for g in self.groups)

    def apply(
        self, key: str, x: torch.Tensor, out: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """`out` (the base layer's output for input rows `x`) plus every adapter's contribution, in place.
        `reduce`: sums the rank-sized partial products across tensor-parallel ranks (a row-parallel layer, whose
        `x` is this rank's input columns)."""
        for group in self.groups:
            pack = group.packs.get(key)
            if not isinstance(pack, tuple):  # not adapted here (a linear layer's key never names experts)
                continue
            shrink, expand = pack
            if shrink.dtype != x.dtype:  # factors in float32 beside a half-precision model, as PEFT keeps them
                self._apply_upcast(group, shrink, expand, x, out, reduce)
            elif group.span is not None:  # the decoder stack's own ops on its rows (decoder.cpp), the same bits
                start, length = group.span
                h = x.narrow(0, start, length) @ shrink
                if reduce is not None:
                    h = reduce(h)
                out.narrow(0, start, length).addmm_(h, expand)
            else:
                assert group.rows is not None  # a group has a span or its rows
                h = x.index_select(0, group.rows) @ shrink
                if reduce is not None:
                    h = reduce(h)
                out.index_add_(0, group.rows, h @ expand)
        return out

    @staticmethod
    def _apply_upcast(
        group: LoRAGroup,
        shrink: torch.Tensor,
        expand: torch.Tensor,
        x: torch.Tensor,
        out: torch.Tensor,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        """PEFT's order for a half-precision model: the input cast to the factors' dtype, the adapter's product
        added to the base output in that dtype, the sum rounded once to the model's."""
        if group.span is not None:
            start, length = group.span
            rows = x.narrow(0, start, length)
        else:
            assert group.rows is not None  # a group has a span or its rows
            rows = x.index_select(0, group.rows)
        h = rows.to(shrink.dtype) @ shrink
        if reduce is not None:
            h = reduce(h)
        delta = h @ expand
        if group.span is not None:
            target = out.narrow(0, start, length)
            target.copy_(target.to(delta.dtype) + delta)
        else:
            assert group.rows is not None  # as above
            out.index_copy_(0, group.rows, out.index_select(0, group.rows).to(delta.dtype) + delta)
