"""Building a model and feeding it weights.

Every weight path (startup load, disk reload, and later the transfer engines) goes through `WeightMap`: an exact
map from checkpoint tensor name to the parameter (and fused shard) it fills, built once per model, O(1) per
tensor. Names are never guessed by substring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
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
    module_name: str
    local_shape: tuple[int, ...] = ()  # this rank's part (what a pre-sliced tensor must have)

    @property
    def key(self) -> tuple[str, object]:
        return (self.param_name, self.shard_id)

    def load(self, tensor: torch.Tensor, pre_sliced: bool = False) -> None:
        self.param.weight_loader(self.param, tensor, self.shard_id, pre_sliced=pre_sliced)


class WeightMap:
    """Exact checkpoint-name -> Target map of one model, plus, per module, the loads it needs before its
    post-processing may run. Parameters marked `hotswap_derived` are computed, never loaded."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        stacked: dict[str, tuple[str, object]] = getattr(model, "stacked_params_mapping", {})
        by_fused: dict[str, list[tuple[str, object]]] = {}
        for source, (fused, shard) in stacked.items():
            by_fused.setdefault(fused, []).append((source, shard))
        self.targets: dict[str, Target] = {}
        self.module_keys: dict[str, set[tuple[str, object]]] = {}
        for name, param in model.named_parameters():
            if getattr(param, "hotswap_derived", False):
                continue
            parts = name.split(".")
            module_name = ".".join(parts[:-1])
            owner = model.get_submodule(module_name)
            shards = [(name, None)]
            if len(parts) >= 2 and parts[-2] in by_fused:
                shards = [(".".join([*parts[:-2], source, parts[-1]]), shard) for source, shard in by_fused[parts[-2]]]
            for ckpt, shard in shards:
                # shapes are those of the full checkpoint tensors; each rank's loader takes its part
                shape = owner.checkpoint_shape(param, shard) if hasattr(owner, "checkpoint_shape") else param.shape
                local = owner.shard_view(param, shard).shape if hasattr(owner, "shard_view") else param.shape
                self.targets[ckpt] = Target(name, param, shard, tuple(shape), module_name, tuple(local))
        for target in self.targets.values():
            self.module_keys.setdefault(target.module_name, set()).add(target.key)
        self.required = frozenset(self.targets)
        self.backup_buffers: dict[str, torch.Tensor] = {}  # reused by atomic updates (see WeightUpdate)
        aliases: dict[str, str] = model.checkpoint_aliases() if hasattr(model, "checkpoint_aliases") else {}
        for alias, canonical in aliases.items():
            self.targets[alias] = self.targets[canonical]

    @classmethod
    def of(cls, model: nn.Module) -> WeightMap:
        """The model's map, built on first use and kept on the model."""
        weight_map = getattr(model, "_hotswap_weight_map", None)
        if weight_map is None:
            weight_map = cls(model)
            model._hotswap_weight_map = weight_map
        return weight_map

    def release_backup_buffers(self) -> None:
        self.backup_buffers = {}

    def ignored(self, name: str) -> bool:
        check = getattr(self.model, "ignored_checkpoint_names", None)
        return bool(check and check(name))

    def lookup(self, name: str) -> Target:
        """The target of checkpoint tensor `name`. Raises ValueError for a name the model does not have."""
        target = self.targets.get(name)
        if target is None:
            raise ValueError(f"unknown checkpoint tensor {name!r}: the model has no such weight")
        return target

    def check(
        self,
        shapes: dict[str, tuple[int, ...]],
        require_all: bool,
        dtypes: dict[str, torch.dtype] | None = None,
        pre_sliced: frozenset[str] = frozenset(),
    ) -> None:
        """Checks declared tensor names, shapes and dtypes against the model before any data moves. Raises
        ValueError naming unknown tensors, wrong shapes (with the expected ones), dtypes that cannot be cast
        to a floating-point weight and, when `require_all`, missing ones."""
        names = [n for n in shapes if not self.ignored(n)]
        unknown = sorted(n for n in names if n not in self.targets)
        if unknown:
            raise ValueError(f"unknown tensors (the model has no such weights): {unknown}")

        def expected(n: str) -> tuple[int, ...]:
            return self.targets[n].local_shape if n in pre_sliced else self.targets[n].shape

        wrong = [
            f"{n}: expected shape {expected(n)}{' (pre-sliced)' if n in pre_sliced else ''}, got {tuple(shapes[n])}"
            for n in names
            if tuple(shapes[n]) != expected(n)
        ]
        if wrong:
            raise ValueError(f"tensors with the wrong shape: {wrong}")
        bad_dtypes = [f"{n}: {dtypes[n]}" for n in names if dtypes and n in dtypes and not _castable(dtypes[n])]
        if bad_dtypes:
            raise ValueError(f"tensors whose dtype cannot be cast to a floating-point weight: {bad_dtypes}")
        if require_all:
            filled = {self.targets[n].key for n in names}
            missing = sorted(n for n in self.required if self.targets[n].key not in filled)
            if missing:
                raise ValueError(f"checkpoint is missing tensors: {missing}")


def _castable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and not dtype.is_complex
