"""Architecture name (config.json `architectures[0]`) -> model class, and building a model from its config."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from hotswap.architectures import MODELS as _MODELS
from hotswap.model.settings import LayerSettings


def model_class(architecture: str) -> type[nn.Module]:
    """The class for `architecture`. Raises ValueError listing the supported ones."""
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported architectures: {', '.join(_MODELS)}"
        )
    module, name = _MODELS[architecture]
    klass: type[nn.Module] = getattr(importlib.import_module(module), name)
    return klass


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelSpec(Protocol):
    """What building a model reads of its model config (`hotswap.config.ModelConfig` has it)."""

    @property
    def architecture(self) -> str: ...

    @property
    def torch_dtype(self) -> torch.dtype: ...

    @property
    def hf_config(self) -> dict[str, Any]: ...

    @property
    def device(self) -> str: ...


def build_model(model_config: ModelSpec, settings: LayerSettings) -> nn.Module:
    """Constructs the model with uninitialized parameters in the configured dtype, on the configured device (every
    parameter, buffer and construction-time tensor follows `torch.device`). Every layer takes what it needs of
    `settings` (quantization, deterministic mode, this rank's share, the experts' layout) at construction; nothing
    ambient is read."""
    klass = model_class(model_config.architecture)
    with _default_dtype(model_config.torch_dtype), torch.device(model_config.device):
        model = klass(model_config.hf_config, settings)
    return model.eval()
