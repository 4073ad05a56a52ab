"""In-process transport: the update carries (name, tensor) pairs directly.

Trainer side: `tensors_update_info(named_tensors)` builds the update; pass it to `update_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hotswap.transfer.base import Declared, TransferEngine, declare


def tensors_update_info(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """An update for the `tensors` backend: the declaration plus the tensors themselves (no copy)."""
    pairs = [(name, tensor.detach()) for name, tensor in named_tensors]
    return {**declare(pairs), "named_tensors": pairs}


class TensorsEngine(TransferEngine):
    in_memory = True

    def declared(self, update_info: dict[str, Any]) -> Declared:
        pairs = self._pairs(update_info)
        return [(name, t.dtype, tuple(t.shape)) for name, t in pairs]

    def receive(self, update_info: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._pairs(update_info)

    @staticmethod
    def _pairs(update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        pairs = update_info.get("named_tensors") if isinstance(update_info, dict) else None
        if pairs is None:
            raise ValueError("a 'tensors' update needs update_info['named_tensors']: a list of (name, tensor)")
        out = []
        for item in pairs:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise ValueError(f"named_tensors entries must be (name, tensor) pairs, got {type(item).__name__}")
            out.append((str(item[0]), item[1]))
        return out
