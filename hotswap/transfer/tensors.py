"""In-process transport: the update carries (name, tensor) pairs directly.

Trainer side: `tensors_update_info(named_tensors)` builds the update; pass it to `update_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hotswap.transfer.base import TransferEngine, declare
from hotswap.weights.update import WeightSource, pairs_source


def tensors_update_info(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """An update for the `tensors` backend: the declaration plus the tensors themselves (no copy)."""
    pairs = [(name, tensor.detach()) for name, tensor in named_tensors]
    return {**declare(pairs), "named_tensors": pairs}


class TensorsEngine(TransferEngine):
    def source(self, update_info: dict[str, Any]) -> WeightSource:
        pairs = update_info.get("named_tensors") if isinstance(update_info, dict) else None
        if pairs is None:
            raise ValueError("a 'tensors' update needs update_info['named_tensors']: a list of (name, tensor)")
        return pairs_source(pairs, description="tensors update")
