"""Disk transport: a safetensors checkpoint folder, the same path as `reload_weights(weights_path=...)`.

Trainer side: save with `safetensors.torch.save_file` (or `save_pretrained`) and send {"path": folder}.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hotswap.model.safetensors_io import declared as index_declared
from hotswap.model.safetensors_io import iterate_safetensors, read_index
from hotswap.transfer.base import Declared, TransferEngine


class DiskEngine(TransferEngine):
    def declared(self, update_info: dict[str, Any]) -> Declared:
        return index_declared(read_index(self._path(update_info)))

    def receive(self, update_info: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        yield from iterate_safetensors(self._path(update_info))

    @staticmethod
    def _path(update_info: dict[str, Any]) -> str:
        path = update_info.get("path") if isinstance(update_info, dict) else None
        if not isinstance(path, str):
            raise ValueError("a 'disk' update needs update_info['path']: a safetensors checkpoint folder")
        return path
