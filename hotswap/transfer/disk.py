"""Disk transport: a safetensors checkpoint folder, the same path as `reload_weights(weights_path=...)`.

Trainer side: save with `safetensors.torch.save_file` (or `save_pretrained`) and send {"path": folder}; the
folder may hold a subset of the weights.
"""

from __future__ import annotations

from typing import Any

from hotswap.transfer.base import TransferEngine
from hotswap.weights.update import WeightSource, folder_source


class DiskEngine(TransferEngine):
    def source(self, update_info: dict[str, Any]) -> WeightSource:
        path = update_info.get("path") if isinstance(update_info, dict) else None
        if not isinstance(path, str):
            raise ValueError("a 'disk' update needs update_info['path']: a safetensors checkpoint folder")
        return folder_source(path, complete=False)
