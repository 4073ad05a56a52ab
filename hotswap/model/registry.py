"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from hotswap.model.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODELS)


def model_class(architecture: str) -> type[nn.Module]:
    """The class for `architecture`. Raises ValueError listing the supported ones."""
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported architectures: {', '.join(_MODELS)}"
        )
    return _MODELS[architecture]
