"""Disk transport: a safetensors checkpoint folder, the same path as `reload_weights(weights_path=...)`.

Trainer side: save with `safetensors.torch.save_file` (or `save_pretrained`) and send {"path": folder}; the
folder may hold a subset of the weights.

On an engine whose model is on a CUDA device (or init_info "device" naming one), the memory-mapped tensors are
streamed to the device through two pinned host slots (hotswap/weights/host_staging.py); "device": "cpu" turns
that off.
"""

from __future__ import annotations

from typing import Any

from hotswap.config import WeightTransferConfig
from hotswap.transfer.base import TransferEngine
from hotswap.weights.host_staging import HostStaging, stage_to_device, staging_for
from hotswap.weights.update import WeightSource, folder_source


class DiskEngine(TransferEngine):
    """Worker side (init_info: {"backend": "disk"}, optionally "device" and "staging_slot_bytes", see
    `staging_for`)."""

    def __init__(self, init_info: dict[str, Any], config: WeightTransferConfig) -> None:
        super().__init__(init_info, config)
        self.staging: HostStaging | None = staging_for(init_info)

    def source(self, update_info: dict[str, Any]) -> WeightSource:
        path = update_info.get("path") if isinstance(update_info, dict) else None
        if not isinstance(path, str):
            raise ValueError("a 'disk' update needs update_info['path']: a safetensors checkpoint folder")
        source = folder_source(path, complete=False)
        return source if self.staging is None else stage_to_device(source, staging=self.staging)
