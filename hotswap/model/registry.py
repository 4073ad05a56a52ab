"""Architecture name (config.json `architectures[0]`) -> model class, and building a model from its config."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hotswap.config import ModelConfig
from hotswap.model.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from hotswap.model.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
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


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(model_config: ModelConfig) -> nn.Module:
    """Constructs the model with uninitialized parameters in the configured dtype (inside the config scope:
    layers read the quantization and parallel layout at construction)."""
    klass = model_class(model_config.architecture)
    with _default_dtype(model_config.torch_dtype):
        model = klass(model_config.hf_config)
    return model.eval()
