"""One mechanism for every weight path: validate the declared tensors, then copy them in place, layer by layer.

`WeightUpdate` is used by the startup load, disk reloads and every transfer session:
- `validate(...)` checks declared names, shapes and dtypes (and duplicates) against the model before any data
  moves;
- `load(stream)` copies each (name, tensor) into existing parameter storage through its `weight_loader`; when a
  module has received every tensor it is made of, its `process_weights_after_loading` runs (e.g. fp8
  re-quantization), in the caller's config context;
- `finish()` post-processes modules that received only part of their tensors (the rest stay as they were);
- in atomic mode, the first write into a module saves a copy of all its parameters, and `rollback()` restores
  them bit for bit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from hotswap.model.loader import WeightMap

Declared = list[tuple[str, torch.dtype, tuple[int, ...]]]


def _all_finite(tensor: torch.Tensor, target_dtype: torch.dtype) -> bool:
    """True if no element is NaN or Inf, nor becomes Inf when cast to `target_dtype` (e.g. fp32 above 65504
    into fp16). A sum is one cheap pass; only a non-finite sum (a bad value, or an overflow of huge finite ones)
    pays for the exact elementwise check."""
    if tensor.element_size() == 1:
        tensor = tensor.float()
    finite = bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
    limit_dtype = torch.bfloat16 if target_dtype.itemsize == 1 else target_dtype  # fp8 rows get a scale
    if finite and limit_dtype.is_floating_point and torch.finfo(limit_dtype).max < torch.finfo(tensor.dtype).max:
        finite = tensor.numel() == 0 or bool(tensor.abs().amax() <= torch.finfo(limit_dtype).max)
    return finite


class WeightUpdate:
    def __init__(self, model: nn.Module, atomic: bool, check_finite: bool) -> None:
        self.model = model
        self.weight_map = WeightMap.of(model)
        self.atomic = atomic
        self.check_finite = check_finite
        self.backups: dict[str, dict[str, torch.Tensor]] = {}
        self.arrived: dict[str, set[tuple[str, object]]] = {}
        self.pending: set[str] = set()  # touched modules whose post-processing has not run since
        self.loaded_names: set[str] = set()
        self.loaded_keys: set[tuple[str, object]] = set()

    def validate(self, declared: Declared, require_all: bool = False, pre_sliced: frozenset[str] = frozenset()) -> None:
        """Raises ValueError for duplicate, unknown, mis-shaped or non-castable tensors, naming them."""
        counts = Counter(name for name, _, _ in declared)
        duplicates = sorted(n for n, c in counts.items() if c > 1)
        if duplicates:
            raise ValueError(f"duplicate tensor names in one update: {duplicates}")
        by_key: dict[tuple[str, object], list[str]] = {}
        for name, _, _ in declared:
            target = self.weight_map.targets.get(name)
            if target is not None:
                by_key.setdefault(target.key, []).append(name)
        shared = sorted(names for names in by_key.values() if len(names) > 1)
        if shared:
            raise ValueError(f"duplicate tensors for the same (tied) weight in one update: {shared}; send one")
        self.weight_map.check(
            {name: tuple(shape) for name, _, shape in declared},
            require_all=require_all,
            dtypes={name: dtype for name, dtype, _ in declared},
            pre_sliced=pre_sliced,
        )

    def check_values(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """For data already in memory: raises ValueError listing tensors with NaN/Inf (or values the weight's
        dtype cannot hold) before anything is loaded."""
        if not self.check_finite:
            return
        bad = [
            name
            for name, tensor in pairs
            if name in self.weight_map.targets and not _all_finite(tensor, self.weight_map.targets[name].param.dtype)
        ]
        if bad:
            raise ValueError(f"tensors with NaN or Inf values (rejected; disable with check_finite=False): {bad}")

    def load(self, stream: Iterable[tuple[str, torch.Tensor]], pre_sliced: frozenset[str] = frozenset()) -> int:
        """Copies every tensor of `stream` into the model; returns the number of tensors loaded. With
        `check_finite`, tensors holding NaN/Inf are not loaded: the stream is drained and ValueError lists them."""
        non_finite: list[str] = []
        count = 0
        for name, tensor in stream:
            if self.weight_map.ignored(name):
                continue
            target = self.weight_map.lookup(name)
            expected = target.local_shape if name in pre_sliced else target.shape
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name}: expected shape {expected}, got {tuple(tensor.shape)}")
            if self.check_finite and not _all_finite(tensor, target.param.dtype):
                non_finite.append(name)
            if non_finite:
                continue  # drain the stream to name every bad tensor; load nothing more
            self._before_write(target.module_name)
            target.load(tensor, pre_sliced=name in pre_sliced)
            count += 1
            self.loaded_names.add(name)
            self.loaded_keys.add(target.key)
            arrived = self.arrived.setdefault(target.module_name, set())
            arrived.add(target.key)
            self.pending.add(target.module_name)
            if arrived >= self.weight_map.module_keys[target.module_name]:
                self._post_process(target.module_name)
                arrived.clear()
        if non_finite:
            raise ValueError(
                f"tensors with NaN or Inf values (rejected; disable with check_finite=False): {non_finite}"
            )
        return count

    def _before_write(self, module_name: str) -> None:
        if self.atomic and module_name not in self.backups:
            module = self.model.get_submodule(module_name)
            saved = {}
            for name, param in module.named_parameters(recurse=False):
                # Copy buffers persist on the weight map between updates, so steady-state updates do not fault
                # in fresh memory; release_backup_buffers() frees them.
                key = f"{module_name}.{name}"
                buffer = self.weight_map.backup_buffers.get(key)
                if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype:
                    buffer = self.weight_map.backup_buffers[key] = torch.empty_like(param, requires_grad=False)
                buffer.copy_(param.detach())
                saved[name] = buffer
            self.backups[module_name] = saved

    def _post_process(self, module_name: str) -> None:
        module = self.model.get_submodule(module_name)
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
        self.pending.discard(module_name)

    def covers_all(self) -> bool:
        """Whether every weight of the model was loaded by this update."""
        return len(self.loaded_keys) == len(self.weight_map.required)

    def finish(self) -> None:
        """Post-processes modules that received part of their tensors; drops the saved copies."""
        for module_name in sorted(self.pending):
            self._post_process(module_name)
        self.backups.clear()
        self.arrived.clear()

    def rollback(self) -> None:
        """Restores every module written since the start of this update to its saved copy (atomic mode)."""
        assert self.atomic, "rollback needs atomic mode"
        with torch.no_grad():
            for module_name, saved in self.backups.items():
                module = self.model.get_submodule(module_name)
                params = dict(module.named_parameters(recurse=False))
                for name, value in saved.items():
                    params[name].data.copy_(value)
        for module_name in self.arrived:
            discard = getattr(self.model.get_submodule(module_name), "discard_stage", None)
            if discard is not None:
                discard()
        self.backups.clear()
        self.arrived.clear()
        self.pending.clear()
