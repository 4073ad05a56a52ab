"""Building a model and feeding it weights.

Every weight path (startup load, disk reload, and later the transfer engines) goes through `WeightMap`: an exact
map from checkpoint tensor name to the parameter (and fused shard) it fills, built once per model, O(1) per
tensor. Names are never guessed by substring.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from hotswap.config import ModelConfig
from hotswap.model.registry import model_class


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(model_config: ModelConfig) -> nn.Module:
    """Constructs the model with uninitialized parameters in the configured dtype."""
    klass = model_class(model_config.architecture)
    with _default_dtype(model_config.torch_dtype):
        model = klass(model_config.hf_config)
    return model.eval()


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, and optionally a shard of a fused parameter."""

    param_name: str
    param: nn.Parameter
    shard_id: object
    shape: tuple[int, ...]

    def load(self, tensor: torch.Tensor) -> None:
        self.param.weight_loader(self.param, tensor, self.shard_id)


class WeightMap:
    """Exact checkpoint-name -> Target map of one model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        stacked: dict[str, tuple[str, object]] = getattr(model, "stacked_params_mapping", {})
        by_fused: dict[str, list[tuple[str, object]]] = {}
        for source, (fused, shard) in stacked.items():
            by_fused.setdefault(fused, []).append((source, shard))
        self.targets: dict[str, Target] = {}
        for name, param in model.named_parameters():
            parts = name.split(".")
            module_name = parts[-2] if len(parts) >= 2 else ""
            if module_name in by_fused:
                owner = model.get_submodule(".".join(parts[:-1]))
                for source, shard in by_fused[module_name]:
                    ckpt = ".".join([*parts[:-2], source, parts[-1]])
                    shape = tuple(owner.shard_view(param, shard).shape)
                    self.targets[ckpt] = Target(name, param, shard, shape)
            else:
                self.targets[name] = Target(name, param, None, tuple(param.shape))
        self.required = frozenset(self.targets)
        aliases: dict[str, str] = model.checkpoint_aliases() if hasattr(model, "checkpoint_aliases") else {}
        for alias, canonical in aliases.items():
            self.targets[alias] = self.targets[canonical]

    def ignored(self, name: str) -> bool:
        check = getattr(self.model, "ignored_checkpoint_names", None)
        return bool(check and check(name))

    def lookup(self, name: str) -> Target:
        """The target of checkpoint tensor `name`. Raises ValueError for a name the model does not have."""
        target = self.targets.get(name)
        if target is None:
            raise ValueError(f"unknown checkpoint tensor {name!r}: the model has no such weight")
        return target

    def check(self, shapes: dict[str, tuple[int, ...]], require_all: bool) -> None:
        """Checks declared tensor names and shapes against the model before any data moves. Raises ValueError
        naming unknown tensors, wrong shapes (with the expected ones) and, when `require_all`, missing ones."""
        names = [n for n in shapes if not self.ignored(n)]
        unknown = sorted(n for n in names if n not in self.targets)
        if unknown:
            raise ValueError(f"unknown checkpoint tensors (the model has no such weights): {unknown}")
        wrong = [
            f"{n}: expected shape {self.targets[n].shape}, got {tuple(shapes[n])}"
            for n in names
            if tuple(shapes[n]) != self.targets[n].shape
        ]
        if wrong:
            raise ValueError(f"checkpoint tensors with the wrong shape: {wrong}")
        if require_all:
            filled = {n if n in self.required else self._canonical(n) for n in names}
            missing = sorted(self.required - filled)
            if missing:
                raise ValueError(f"checkpoint is missing tensors: {missing}")

    def _canonical(self, alias: str) -> str:
        target = self.targets[alias]
        return next(n for n, t in self.targets.items() if t is target and n in self.required)


def safetensors_files(folder: str) -> list[str]:
    """The *.safetensors files of a checkpoint folder, sorted. Raises ValueError if there are none."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder!r}")
    return files


def safetensors_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the folder, read from the file headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in shapes:
                    raise ValueError(f"tensor {name!r} appears in more than one file of {folder!r}")
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def iterate_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of the checkpoint folder."""
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copies each (name, tensor) into the model in place; returns the parameter names that were filled.
    Raises ValueError on an unknown name or a shape mismatch."""
    weight_map: WeightMap = getattr(model, "_hotswap_weight_map", None) or WeightMap(model)
    model._hotswap_weight_map = weight_map
    filled: set[str] = set()
    for name, tensor in weights:
        if weight_map.ignored(name):
            continue
        target = weight_map.lookup(name)
        target.load(tensor)
        filled.add(target.param_name)
    return filled


def load_checkpoint(model: nn.Module, folder: str) -> None:
    """Full load from a safetensors folder: every name is checked before any byte is copied."""
    weight_map = WeightMap(model)
    model._hotswap_weight_map = weight_map
    weight_map.check(safetensors_shapes(folder), require_all=True)
    load_weights(model, iterate_safetensors(folder))
