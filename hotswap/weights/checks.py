"""The checks an update runs before it writes: a declaration against the model's weight index, and values
against the dtypes they are bound for.

A declaration (names, dtypes, shapes) is checked whole before any data moves (`check_declaration`). Values are
checked for NaN, Inf and magnitudes their target's dtype cannot hold: a tensor alone (`all_finite`), or many at
once by comparing the largest |x| bit pattern of each with the largest one its target accepts (`magnitude_bound`;
`ops.max_magnitude_bits` on the CPU, `device_max_magnitude_bits` on a GPU).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import cast

import torch

from hotswap.kernels import ops
from hotswap.weights.index import WeightIndex
from hotswap.weights.source import Declared, Patch


def all_finite(tensor: torch.Tensor, limit_dtype: torch.dtype) -> bool:
    """True if no element is NaN or Inf, nor becomes Inf when cast to `limit_dtype` (e.g. fp32 above 65504
    into fp16). A sum is one cheap pass; only a non-finite sum (a bad value, or an overflow of huge finite ones)
    pays for the exact elementwise check."""
    if tensor.element_size() == 1:
        tensor = tensor.float()
    finite = bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
    if finite and limit_dtype.is_floating_point and torch.finfo(limit_dtype).max < torch.finfo(tensor.dtype).max:
        finite = tensor.numel() == 0 or bool(tensor.abs().amax() <= torch.finfo(limit_dtype).max)
    return finite


_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@functools.cache
def magnitude_bound(dtype: torch.dtype, limit_dtype: torch.dtype) -> int | None:
    """The largest |x| bit pattern (sign cleared) of a `dtype` tensor that `all_finite(x, limit_dtype)` accepts
    (finite, and within `limit_dtype`'s range), or None where a bit comparison does not decide it (another dtype,
    or a 16-bit tensor bound for a narrower dtype)."""
    if dtype not in _BITS:
        return None
    top = torch.finfo(dtype).max
    if limit_dtype.is_floating_point and torch.finfo(limit_dtype).max < top:
        if dtype != torch.float32:
            return None
        top = torch.finfo(limit_dtype).max  # exactly a float32 (float16's and bfloat16's maxima are)
    return int(torch.tensor(top, dtype=dtype).view(_BITS[dtype]).item())


def device_max_magnitude_bits(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor (contiguous float32, bfloat16 or float16, on any one device), the largest |x| bit pattern
    (sign cleared: NaN and Inf above every finite value), computed with torch ops where the tensors live and read
    back to the host once for all of them: a GPU update's value check costs one synchronization, not one per tensor
    (`ops.max_magnitude_bits` is the CPU's native twin)."""
    if not tensors:
        return []
    tops = []
    for t in tensors:
        bits = t.view(_BITS[t.dtype])
        mask = 0x7FFFFFFF if bits.dtype == torch.int32 else 0x7FFF
        tops.append(
            (bits & mask).amax().to(torch.int64) if t.numel() else torch.zeros((), dtype=torch.int64, device=t.device)
        )
    return cast(list[int], torch.stack(tops).tolist())


def castable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and not dtype.is_complex


def non_finite_error(names: list[str]) -> ValueError:
    return ValueError(f"tensors with NaN or Inf values (rejected; disable with check_finite=False): {names}")


def check_declaration(index: WeightIndex, declared: Declared, complete: bool, pre_sliced: frozenset[str]) -> None:
    """Raises ValueError for duplicate, unknown, mis-shaped or non-castable tensors (naming them all) and, for
    a `complete` checkpoint, missing ones. Nothing has moved yet."""
    counts = Counter(name for name, _, _ in declared)
    duplicates = sorted(n for n, c in counts.items() if c > 1)
    if duplicates:
        raise ValueError(f"duplicate tensor names in one update: {duplicates}")
    entries = [(n, d, s) for n, d, s in declared if not index.ignored(n)]
    unknown = sorted(n for n, _, _ in entries if n not in index.targets)
    if unknown:
        raise ValueError(f"unknown tensors (the model has no such weights): {unknown}")
    by_key: dict[tuple[str, object], list[str]] = {}
    wrong, bad_dtypes = [], []
    for name, dtype, shape in entries:
        target = index.targets[name]
        for key in target.keys:
            by_key.setdefault(key, []).append(name)
        expected = target.local_shape if name in pre_sliced else target.full_shape
        if tuple(shape) != expected:
            wrong.append(
                f"{name}: expected shape {expected}{' (pre-sliced)' if name in pre_sliced else ''}, got {tuple(shape)}"
            )
        if not castable(dtype):
            bad_dtypes.append(f"{name}: {dtype}")
    shared = sorted({tuple(names) for names in by_key.values() if len(names) > 1})
    if shared:
        raise ValueError(f"duplicate tensors for the same (tied) weight in one update: {shared}; send one")
    if wrong:
        raise ValueError(f"tensors with the wrong shape: {wrong}")
    if bad_dtypes:
        raise ValueError(f"tensors whose dtype cannot be cast to a floating-point weight: {bad_dtypes}")
    per_module: dict[str, list[tuple[object, torch.nn.Parameter, torch.dtype]]] = {}
    for name, dtype, _ in entries:
        target = index.targets[name]
        per_module.setdefault(target.module_name, []).append((target.shard_id, target.param, dtype))
    for module_name, module_entries in per_module.items():
        check = getattr(index.modules[module_name], "check_update", None)
        if check is not None:
            with index.scope(module_name):
                check(module_entries)
    if complete:
        missing = sorted(n for n in index.required if index.targets[n].key not in by_key)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing}")


def non_finite_names(pairs: list[tuple[str, torch.Tensor]], limit: Callable[[str], torch.dtype]) -> list[str]:
    """The names in `pairs` whose values do not fit their targets (`all_finite` against `limit(name)`, the dtype
    each must fit), in order. Read last to first, so the first tensors loaded are the ones read last (still cached,
    if they fit); where the native check applies, in one pass over all of them (`ops.max_magnitude_bits`)."""
    batch: list[tuple[str, torch.Tensor, int]] = []
    on_device: dict[torch.device, list[tuple[str, torch.Tensor, int]]] = {}
    alone: list[tuple[str, torch.Tensor]] = []
    for name, tensor in reversed(pairs):
        values = tensor.values if isinstance(tensor, Patch) else tensor
        bound = magnitude_bound(values.dtype, limit(name))
        if bound is None or not values.is_contiguous() or values.numel() == 0:
            alone.append((name, tensor))
        elif values.device.type != "cpu":  # one fused check per device, one host read
            on_device.setdefault(values.device, []).append((name, values, bound))
        else:
            batch.append((name, values, bound))
    maxima = ops.max_magnitude_bits([values for _, values, _ in batch])
    if maxima is None:
        alone = [(name, values) for name, values, _ in batch] + alone
        batch = []
    bad = {name for (name, _, bound), top in zip(batch, maxima or [], strict=True) if top > bound}
    for group in on_device.values():
        tops = device_max_magnitude_bits([values for _, values, _ in group])
        bad.update(name for (name, _, bound), top in zip(group, tops, strict=True) if top > bound)
    bad.update(
        name
        for name, tensor in alone
        if not all_finite(tensor.values if isinstance(tensor, Patch) else tensor, limit(name))
    )
    return [name for name, _ in pairs if name in bad]
