"""LoRA adapters: PEFT folders and tensors loaded through the weight session, versioned, applied per row.

- `request.py`: `LoRARequest`, as vLLM names it.
- `peft_format.py`: an adapter's PEFT config and tensor names.
- `adapter.py`: one adapter version as a module whose parameters carry PEFT's names, so the weight session's
  validation, transports, deltas, checksums and rollback apply to it unchanged.
- `batch.py`: a forward pass's adapters, applied inside each targeted linear layer.
- `manager.py`: the worker's adapters; `registry.py`: the engine's names, versions and users.
"""

from hotswap.lora.request import LoRARequest

__all__ = ["LoRARequest"]
