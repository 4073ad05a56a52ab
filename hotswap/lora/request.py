"""`LoRARequest`: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, with a positive integer id unique per name (as vLLM requires) and, optionally, the PEFT
    folder to load it from the first time it is used. An adapter loaded once is never read from disk again (a
    request's `load_inplace` does not re-read it): later changes arrive through
    `LLM.load_lora_adapter(..., load_inplace=True)` or a weight update with target "lora:<name>"."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {type(self.lora_path).__name__}")

    # vLLM's accessors
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
