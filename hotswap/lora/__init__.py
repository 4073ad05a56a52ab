"""LoRA adapters: PEFT folders and tensors loaded through the weight session, versioned, applied per row.

- `request.py`: `LoRARequest`, as vLLM names it.
- `peft_format.py`: an adapter's PEFT config and tensor names.
- `adapter.py`: one adapter version as a module whose parameters carry PEFT's names, so the weight session's
  validation, transports, deltas, checksums and rollback apply to it unchanged.
- `manager.py`: the worker's adapters.
- Elsewhere, by layer: a forward pass's adapters (`hotswap/model/lora_batch.py`, carried in the pass's
  `StepContext`), and the engine's names, versions, users and changes (`hotswap/engine/lora_registry.py`,
  `lora_updates.py`).
"""

from hotswap.lora.request import LoRARequest

__all__ = ["LoRARequest"]
