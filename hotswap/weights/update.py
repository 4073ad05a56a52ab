"""The one update object every weight path goes through.

    WeightUpdate(index, atomic, check_finite, backups)
      .apply(source)   declaration checked once (names, shapes, dtypes, duplicates, completeness), then values
                       (in-memory sources: all of them before the first write; streamed ones: tensor by tensor),
                       then each tensor loaded through its target's layout; a module whose tensors all arrived is
                       post-processed at once (`process_weights_after_loading`, in the caller's config scope)
      .finish()        post-processes modules that received only part of their tensors; drops rollback copies
      .rollback()      restores every parameter written since the update began, bit for bit (atomic mode)

Rollback copies. In atomic mode a module's parameters are copied into `backups` (a pool the caller owns and
reuses across updates) before its first write. They are skipped when nothing after the first write can fail:
the update is `final` (no later `apply` in it), the source is in memory (every declaration and value was checked
first) and its `verify` cannot reject what was loaded. Then only modules whose post-processing writes their
parameters (`stages_weights`, e.g. fp8: a later module's post-processing may still fail) are copied. In a
session that may go on the copies stay: a later update of the session may fail, and deferring the write instead
is unsafe, since a trainer may reuse its buffers once `update_weights` returned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from hotswap.weights.index import WeightIndex
from hotswap.weights.sources import Declared, WeightSource


def all_finite(tensor: torch.Tensor, target_dtype: torch.dtype) -> bool:
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


def _castable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and not dtype.is_complex


def _non_finite_error(names: list[str]) -> ValueError:
    return ValueError(f"tensors with NaN or Inf values (rejected; disable with check_finite=False): {names}")


class WeightUpdate:
    def __init__(
        self,
        index: WeightIndex,
        atomic: bool,
        check_finite: bool,
        backups: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.index = index
        self.model: nn.Module = index.model
        self.atomic = atomic
        self.check_finite = check_finite
        self.backup_pool = {} if backups is None else backups
        self.saved: dict[str, dict[str, torch.Tensor]] = {}  # module -> its parameters before the first write
        self.arrived: dict[str, set[tuple[str, object]]] = {}  # module -> targets loaded since its post-processing
        self.pending: set[str] = set()  # written modules whose post-processing has not run since
        self.loaded_names: set[str] = set()
        self.loaded_keys: set[tuple[str, object]] = set()

    # ---- checks ---------------------------------------------------------------------------------------------

    def check_declaration(self, declared: Declared, complete: bool, pre_sliced: frozenset[str]) -> None:
        """Raises ValueError for duplicate, unknown, mis-shaped or non-castable tensors (naming them all) and, for
        a `complete` checkpoint, missing ones. Nothing has moved yet."""
        counts = Counter(name for name, _, _ in declared)
        duplicates = sorted(n for n, c in counts.items() if c > 1)
        if duplicates:
            raise ValueError(f"duplicate tensor names in one update: {duplicates}")
        entries = [(n, d, s) for n, d, s in declared if not self.index.ignored(n)]
        unknown = sorted(n for n, _, _ in entries if n not in self.index.targets)
        if unknown:
            raise ValueError(f"unknown tensors (the model has no such weights): {unknown}")
        by_key: dict[tuple[str, object], list[str]] = {}
        wrong, bad_dtypes = [], []
        for name, dtype, shape in entries:
            target = self.index.targets[name]
            by_key.setdefault(target.key, []).append(name)
            expected = target.local_shape if name in pre_sliced else target.full_shape
            if tuple(shape) != expected:
                wrong.append(
                    f"{name}: expected shape {expected}{' (pre-sliced)' if name in pre_sliced else ''}, "
                    f"got {tuple(shape)}"
                )
            if not _castable(dtype):
                bad_dtypes.append(f"{name}: {dtype}")
        shared = sorted(names for names in by_key.values() if len(names) > 1)
        if shared:
            raise ValueError(f"duplicate tensors for the same (tied) weight in one update: {shared}; send one")
        if wrong:
            raise ValueError(f"tensors with the wrong shape: {wrong}")
        if bad_dtypes:
            raise ValueError(f"tensors whose dtype cannot be cast to a floating-point weight: {bad_dtypes}")
        if complete:
            missing = sorted(n for n in self.index.required if self.index.targets[n].key not in by_key)
            if missing:
                raise ValueError(f"checkpoint is missing tensors: {missing}")

    def _finite(self, name: str, tensor: torch.Tensor) -> bool:
        return not self.check_finite or all_finite(tensor, self.index.targets[name].param.dtype)

    # ---- loading --------------------------------------------------------------------------------------------

    def apply(self, source: WeightSource, final: bool = False) -> int:
        """Loads `source` into the model; returns the number of tensors loaded. `final`: no further `apply`
        follows in this update (see the module doc on rollback copies). Raises ValueError for a declaration or
        values that the model rejects (nothing loaded from an in-memory source), or whatever the source raises
        while streaming; the caller then rolls back."""
        entries = source.loaded_entries()
        self.check_declaration(entries, source.complete, source.pre_sliced)
        stream = source.stream()
        backup = self.atomic and not (final and source.in_memory and source.verify is None)
        if source.in_memory:
            pairs = [item for item in stream if not self.index.ignored(item[0])]
            bad = [name for name, tensor in pairs if not self._finite(name, tensor)]
            if bad:
                raise _non_finite_error(bad)
            count = self._load(pairs, source.pre_sliced, backup, checked=True)
        else:
            count = self._load(stream, source.pre_sliced, backup, checked=False)
        expected = sum(1 for name, _, _ in entries if not self.index.ignored(name))
        if count != expected:
            raise ValueError(f"the {source.description} ended after {count} of {expected} declared tensors")
        if source.verify is not None:
            source.verify()
        return count

    def _load(self, stream: Iterable[tuple[str, torch.Tensor]], pre_sliced: frozenset[str], backup: bool,
              checked: bool) -> int:  # fmt: skip
        non_finite: list[str] = []
        count = 0
        for name, tensor in stream:
            if self.index.ignored(name):
                continue
            if not checked and not self._finite(name, tensor):
                non_finite.append(name)
            if non_finite:
                continue  # drain the stream to name every bad tensor; load nothing more
            target = self.index.lookup(name)
            if backup or target.module_name in self.index.staging_modules:
                self._save(target.module_name)
            target.load(tensor, pre_sliced=name in pre_sliced)
            count += 1
            self.loaded_names.add(name)
            self.loaded_keys.add(target.key)
            arrived = self.arrived.setdefault(target.module_name, set())
            arrived.add(target.key)
            self.pending.add(target.module_name)
            if arrived >= self.index.module_keys[target.module_name]:
                self._post_process(target.module_name)
                arrived.clear()
        if non_finite:
            raise _non_finite_error(non_finite)
        return count

    def _save(self, module_name: str) -> None:
        if not self.atomic or module_name in self.saved:
            return
        module = self.model.get_submodule(module_name)
        saved = {}
        for name, param in module.named_parameters(recurse=False):
            # pooled buffers persist between updates, so steady-state updates do not fault in fresh memory
            key = f"{module_name}.{name}"
            buffer = self.backup_pool.get(key)
            if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype:
                buffer = self.backup_pool[key] = torch.empty_like(param, requires_grad=False)
            buffer.copy_(param.detach())
            saved[name] = buffer
        self.saved[module_name] = saved

    def _post_process(self, module_name: str) -> None:
        hook = getattr(self.model.get_submodule(module_name), "process_weights_after_loading", None)
        if hook is not None:
            hook()
        self.pending.discard(module_name)

    # ---- ending ---------------------------------------------------------------------------------------------

    def covers_all(self) -> bool:
        """Whether every weight of the model was loaded by this update (after `finish`)."""
        return len(self.loaded_keys) == len(self.index.required)

    def finish(self) -> None:
        """Post-processes modules that received part of their tensors (the rest stay as they were); drops the
        rollback copies (their buffers stay in the pool)."""
        for module_name in sorted(self.pending):
            self._post_process(module_name)
        self.saved.clear()
        self.arrived.clear()

    def rollback(self) -> None:
        """Restores every module written since the update began to its saved copy (atomic mode) and discards
        staged data."""
        assert self.atomic, "rollback needs atomic mode"
        with torch.no_grad():
            for module_name, saved in self.saved.items():
                params = dict(self.model.get_submodule(module_name).named_parameters(recurse=False))
                for name, value in saved.items():
                    params[name].data.copy_(value)
        for module_name in self.arrived:
            discard = getattr(self.model.get_submodule(module_name), "discard_stage", None)
            if discard is not None:
                discard()
        self.saved.clear()
        self.arrived.clear()
        self.pending.clear()
