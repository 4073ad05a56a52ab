"""Delta encodings of an update: what a trainer sends instead of full tensors when little changed.

    full       every tensor whole (the default; a partial update is a subset of names)
    overwrite  full tensors for a subset of names (the same loading; named for what a delta sender means)
    xor        per name, the bitwise XOR of the new and the current values, as an integer tensor of the weight's
               element size and the full checkpoint shape (int32 for float32 weights, int16 for bf16 / fp16)
    sparse     per name, two tensors: "<name>#indices" (int64, flat indices into the full checkpoint tensor) and
               "<name>#values" (the new values there), in any order; a plain name in a sparse update
               is a whole tensor (a sender sends whole what changed too much to be smaller as indices and values)

`decoded(source, encoding, index, seen)` turns a source of deltas into an ordinary source of this rank's new
values (pre-sliced), read from the weights as they are when each tensor arrives, so the rest of the update path
(checks, finiteness, rollback copies, post-processing of touched modules only) is the one every update takes. A
name decoded twice in one update would apply its delta twice: refused. Layers that hold their weights in another
form than they arrive (fp8: quantized) cannot take xor or sparse deltas (their current values are not the
trainer's); they take full or overwrite tensors, and only the modules written are re-quantized.

`checked(source, index, checksums)` adds the trainer's per-tensor digests of the *result* (SHA-256 of the new
tensor's bytes in the weight's dtype, `hotswap.weights.checksum.tensor_sha256`): verified once everything
loaded, a mismatch fails the update (rolled back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterator
from typing import cast

import torch

from hotswap.weights.checksum import sha256_steps
from hotswap.weights.index import Target, WeightIndex
from hotswap.weights.update import Declared, Patch, PendingHalf, WeightSource, WeightUpdate

ENCODINGS = ("full", "overwrite", "xor", "sparse")
INDICES, VALUES = "#indices", "#values"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def is_delta(encoding: str | None) -> bool:
    """Whether `encoding` names a delta (xor, sparse, overwrite) rather than a full checkpoint: a folder of it has
    no config and a subset of the names, and is never recorded as the model's folder."""
    return encoding not in (None, "full")


def check_encoding(encoding: object) -> str:
    """The encoding name (None: "full"). Raises ValueError naming the known ones."""
    if encoding is None:
        return "full"
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; expected one of {list(ENCODINGS)}")
    return str(encoding)


def xor_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype an xor delta of `dtype` weights travels in."""
    return _INT_OF_SIZE[torch.empty((), dtype=dtype).element_size()]


def _target(index: WeightIndex, name: str, encoding: str) -> Target:
    target = index.targets.get(name)
    if target is None:
        raise ValueError(f"unknown tensors (the model has no such weights): [{name!r}]")
    if target.module_name in index.staging_modules:
        raise ValueError(
            f"{name}: its layer holds the weights in another form than they arrive (fp8), so an "
            f"{encoding} delta has no current value to apply to; send it whole (encoding 'overwrite')"
        )
    try:
        target.narrowings()
    except ValueError:
        raise ValueError(
            f"{name}: a fused tensor cannot take an {encoding} delta; send its per-expert tensors"
        ) from None
    return target


def _local(delta: torch.Tensor, target: Target, pre_sliced: bool) -> torch.Tensor:
    """This rank's part of a full-shape `delta` (as loading cuts it)."""
    if pre_sliced:
        return delta
    for dim, start, length in target.narrowings():
        delta = delta.narrow(dim, start, length)
    return delta


def _local_indices(flat: torch.Tensor, target: Target, pre_sliced: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(positions in `flat` that fall in this rank's part, None for all of them; their flat indices within the
    part)."""
    shape = target.full_shape
    cuts = [(d, s, n) for d, s, n in target.narrowings() if not (s == 0 and n == shape[d])]  # no-op cuts dropped
    if pre_sliced or not cuts:
        return None, flat  # the rank holds the tensor whole: its indices are the part's
    coords = list(torch.unravel_index(flat, shape)) if flat.numel() else [flat.new_empty(0) for _ in shape]
    keep = torch.ones_like(flat, dtype=torch.bool)
    dims = list(shape)
    for dim, start, length in cuts:
        keep &= (coords[dim] >= start) & (coords[dim] < start + length)
        coords[dim] = coords[dim] - start
        dims[dim] = length
    kept = keep.nonzero().squeeze(1)
    local = torch.zeros_like(kept)
    for dim, size in enumerate(dims):
        local = local * size + coords[dim][kept]
    return kept, local


def _apply_sparse(target: Target, flat: torch.Tensor, values: torch.Tensor, pre_sliced: bool) -> torch.Tensor | Patch:
    """This rank's change: the elements at `flat` (full-tensor indices, or the part's when `pre_sliced`) set to
    `values`, as a `Patch` written in place (only those elements move), or, where this rank's part is not one
    contiguous view, as its whole new value."""
    numel = torch.Size(target.local_shape if pre_sliced else target.full_shape).numel()
    if flat.numel():
        low, high = torch.aminmax(flat)
        if int(low) < 0 or int(high) >= numel:
            raise ValueError(
                f"sparse indices outside [0, {numel}) for a tensor of shape "
                f"{target.local_shape if pre_sliced else target.full_shape}"
            )
    current = target.local_view()
    kept, local = _local_indices(flat, target, pre_sliced)
    values = (values if kept is None else values[kept]).to(current.dtype)
    if current.is_contiguous():
        return Patch(local, values)
    new = current.clone()
    new.view(-1).index_copy_(0, local, values)
    return new


def decoded(source: WeightSource, encoding: str, update: WeightUpdate) -> WeightSource:
    """`source` (this rank's selection applied) as new values; see the module doc. Raises ValueError for a
    declaration that does not fit the encoding, before any data moves. A sparse pair may be split across the
    update's sources (two update_weights calls of a session): the first half waits in `update.sparse_pending`,
    and `WeightUpdate.finish` fails an update that still holds one. Names decoded are added to
    `update.delta_names` (each applies once)."""
    if encoding in ("full", "overwrite"):
        return source
    index, pending = update.index, update.sparse_pending
    entries = source.loaded_entries()
    declared: Declared = []
    complete: set[str] = set()  # sparse pairs whose both halves are known by the end of this source
    if encoding == "xor":
        for name, dtype, shape in entries:
            target = _target(index, name, encoding)
            want = xor_dtype(target.param.dtype)
            if dtype != want:
                raise ValueError(f"{name}: an xor delta of {target.param.dtype} weights is {want}, got {dtype}")
            expected = target.local_shape if name in source.pre_sliced else target.full_shape
            if tuple(shape) != expected:
                raise ValueError(f"tensors with the wrong shape: ['{name}: expected shape {expected}, got {shape}']")
            declared.append((name, target.param.dtype, target.local_shape))
    else:
        halves: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}
        for name, dtype, shape in entries:
            kind = "indices" if name.endswith(INDICES) else "values" if name.endswith(VALUES) else None
            if kind is None:
                declared.append((name, dtype, shape))  # a whole tensor
                continue
            base = name.removesuffix(INDICES).removesuffix(VALUES)
            if kind in halves.get(base, {}) or (base in pending and pending[base].kind == kind):
                raise ValueError(f"a sparse delta sent '{name}' twice in one update")
            halves.setdefault(base, {})[kind] = (dtype, tuple(shape))
        for base, kinds in halves.items():
            target = _target(index, base, encoding)
            if base in pending:
                kinds = {**kinds, pending[base].kind: (pending[base].dtype, pending[base].shape)}
            for kind, (dtype, shape) in kinds.items():
                if (
                    len(shape) != 1
                    or (kind == "indices" and dtype != torch.int64)
                    or (kind == "values" and not dtype.is_floating_point)
                ):
                    raise ValueError(
                        f"{base}: a sparse delta is int64 flat indices and floating-point values, "
                        f"1-D; got {kind} {dtype} {list(shape)}"
                    )
            if len(kinds) == 2:
                if kinds["indices"][1] != kinds["values"][1]:
                    raise ValueError(
                        f"{base}: {kinds['indices'][1][0]} sparse indices but {kinds['values'][1][0]} values"
                    )
                complete.add(base)
                declared.append((base, target.param.dtype, target.local_shape))
    repeated = sorted({n for n, _, _ in declared} & update.delta_names)
    if repeated:
        raise ValueError(f"tensors sent twice in one delta update (each delta applies once): {repeated}")
    update.delta_names.update(n for n, _, _ in declared)

    whole_names = {n for n, _, _ in declared} - complete if encoding == "sparse" else set()

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        waiting: dict[str, PendingHalf] = {}  # a pair's first half, until its other half arrives
        for name, delta in source.stream():
            if name in whole_names:
                yield name, delta
                continue
            if encoding == "xor":
                target = index.targets[name]
                current = target.local_view()
                bits = xor_dtype(current.dtype)
                local = _local(delta, target, name in source.pre_sliced)
                yield (
                    name,
                    torch.bitwise_xor(current.contiguous().view(bits), local.contiguous().view(bits)).view(
                        current.dtype
                    ),
                )
                continue
            base = name.removesuffix(INDICES).removesuffix(VALUES)
            kind = "indices" if name.endswith(INDICES) else "values"
            other = waiting.pop(base, None) or pending.pop(base, None)
            if other is None:  # a transport may reuse its buffer for the next tensor: keep a copy (not of the
                # caller's own tensors, which stay as they are while the update runs)
                kept = delta if source.in_memory else delta.clone()
                waiting[base] = PendingHalf(kind, delta.dtype, tuple(delta.shape), kept, name in source.pre_sliced)
                continue
            flat, values = (delta, other.tensor) if kind == "indices" else (other.tensor, delta)
            sliced = (name in source.pre_sliced) if kind == "indices" else other.pre_sliced
            change = _apply_sparse(index.targets[base], flat, values, sliced)
            yield base, cast(torch.Tensor, change)  # a Patch: WeightUpdate writes it in place
        # halves whose partner comes in a later source of this update (an in-memory source's buffer, e.g. an shm
        # segment, may be rewritten before then: copied now)
        pending.update(
            {
                base: dataclasses.replace(half, tensor=half.tensor.clone()) if source.in_memory else half
                for base, half in waiting.items()
            }
        )

    return WeightSource(
        declared=declared,
        tensors=tensors,
        in_memory=source.in_memory,
        complete=False,
        pre_sliced=frozenset(n for n, _, _ in declared if n not in whole_names or n in source.pre_sliced),
        verify=source.verify,
        reads_served=True,
        description=f"{encoding} delta ({source.description})",
    )


def checked(source: WeightSource, index: WeightIndex, checksums: dict[str, str] | None) -> WeightSource:
    """`source` verifying, after it loaded, that each named tensor's new value has the trainer's SHA-256. Raises
    ValueError, before any data moves, for names the update does not carry, fp8 layers (their bytes are
    quantized), and tensors split across ranks (no rank holds their whole result)."""
    if not checksums:
        return source
    if not isinstance(checksums, dict) or not all(isinstance(v, str) for v in checksums.values()):
        raise ValueError("checksums must map tensor names to SHA-256 hex digests")
    carried = {name for name, _, _ in source.loaded_entries()}
    missing = sorted(set(checksums) - carried)
    if missing:
        raise ValueError(f"checksums name tensors this update does not carry: {missing[:5]}")
    for name in checksums:
        target = index.targets.get(name)
        if target is None:
            continue  # the declaration check names it
        if target.module_name in index.staging_modules:
            raise ValueError(f"{name}: checksums of fp8 layers cannot be verified (the engine holds them quantized)")
        if target.local_shape != target.full_shape:
            raise ValueError(f"{name}: split across ranks, no rank holds its whole result to verify a checksum")
    inner = source.verify

    def verify() -> Generator[None, None, None]:  # a generator: a staged update hashes between steps
        if inner is not None:
            inner_steps = inner()
            if inner_steps is not None:
                yield from inner_steps
        wrong = []
        for name, digest in sorted(checksums.items()):
            if (yield from sha256_steps(index.targets[name].local_view())) != digest:
                wrong.append(name)
        if wrong:
            raise ValueError(
                f"checksum mismatch after applying the update (the result differs from the trainer's): {wrong[:10]}"
            )

    return dataclasses.replace(source, verify=verify)
