"""The one update object every weight path goes through, and what feeds it.

Every way weights arrive is a `WeightSource`, a declaration plus the (name, tensor) pairs: the startup load,
`reload_weights` by folder or iterator, and every transport (tensors, shm, torch_dist, disk) build one, and
`WeightUpdate.apply` is its only consumer. The declaration (names, dtypes, shapes) is complete before any data is
read, so it is checked against the model before anything moves.

    WeightUpdate(index, atomic, check_finite, backups)
      .apply(source)   declaration checked once (names, shapes, dtypes, duplicates, completeness), then values
                       (in-memory sources: all of them before the first write; streamed ones: tensor by tensor),
                       then each tensor loaded through its target's layout; a module whose tensors all arrived is
                       post-processed at once (`process_weights_after_loading`, in the caller's config scope)
      .finish()        post-processes modules that received only part of their tensors; drops rollback copies
      .rollback()      restores every parameter written since the update began, bit for bit (atomic mode)

Rollback copies. In atomic mode a module's parameters are copied into `backups` (a pool the caller owns and
reuses across updates) before its first write. They are skipped when nothing after the first write is expected
to fail: the update is `final` (no later `apply` in it), the source is in memory (every declaration and value,
and each tensor's layout, were checked first), its `verify` cannot reject what was loaded, and no layer it
writes post-processes into its parameters (`stages_weights`, e.g. fp8, whose post-processing runs mid-stream).
Should something fail anyway (out of memory, an interrupt), the update is `unprotected`: rollback cannot undo
it, and the caller marks the weights invalid. In a session that may go on the copies stay: a later update of the
session may fail, and deferring the writes instead is unsafe, since a trainer may reuse its buffers once
`update_weights` returned.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from hotswap.kernels import ops
from hotswap.kernels import packed as packing
from hotswap.weights.index import WeightIndex
from hotswap.weights.safetensors_io import iterate_index, read_index
from hotswap.weights.shadow import Shadow, check_room

Declared = list[tuple[str, torch.dtype, tuple[int, ...]]]
NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class WeightSource:
    """A declaration and the tensors it promises, in declared order.

    `tensors()` yields (name, tensor) for the declared entries; a tensor may be a view into a transport buffer
    that is reused once the next one is requested. `pre_sliced` names entries that already are this rank's part.
    `complete` marks a full checkpoint: every weight of the model must be declared. `skip[i]` True means entry i
    is another rank's slice: it is received (a collective stream must be drained) but not loaded."""

    declared: Declared
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    in_memory: bool = False
    complete: bool = False
    pre_sliced: frozenset[str] = frozenset()
    skip: list[bool] | None = None
    # run after the last tensor loaded; it may return a generator (run to its end), which a staged update runs
    # between steps
    verify: Callable[[], Generator[None, None, None] | None] | None = None
    reads_served: bool = False  # decoding reads the weights it updates (a delta): staging copies start as them
    description: str = "update"

    def loaded_entries(self) -> Declared:
        """The declared entries this rank loads."""
        if self.skip is None:
            return self.declared
        return [d for d, skipped in zip(self.declared, self.skip, strict=True) if not skipped]

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors this rank loads (other ranks' slices are received and dropped)."""
        if self.skip is None:
            yield from self.tensors()
            return
        for item, skipped in zip(self.tensors(), self.skip, strict=False):
            if not skipped:
                yield item


def pairs_source(named_tensors: NamedTensors, description: str = "weights_iterator") -> WeightSource:
    """A source over in-memory (name, tensor) pairs; the iterable is consumed once, here (generators work)."""
    pairs = []
    for item in named_tensors:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"weights must be (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = str(item[0]), item[1]
        if tensor.layout is not torch.strided or tensor.is_meta or tensor.is_quantized:
            raise ValueError(f"{name}: a dense tensor with data is needed, got a {tensor.layout} / meta tensor")
        pairs.append((name, tensor.detach()))
    return WeightSource(
        declared=[(n, t.dtype, tuple(t.shape)) for n, t in pairs],
        tensors=lambda: iter(pairs),
        in_memory=True,
        description=description,
    )


def folder_source(folder: str, complete: bool = True) -> WeightSource:
    """A safetensors checkpoint folder, read through a private memory map (no intermediate copies); names,
    dtypes and shapes come from the headers. Raises ValueError for a malformed or truncated folder."""
    index = read_index(folder)
    return WeightSource(
        declared=[(name, entry.dtype, entry.shape) for name, entry in index.items()],
        tensors=lambda: iterate_index(index),
        complete=complete,
        description=f"checkpoint {folder!r}",
    )


def prefixed_source(source: WeightSource, prefix: str) -> WeightSource:
    """`source` with `prefix` put before every name that lacks it (draft tensors sent under their own names)."""
    return renamed_source(source, prefixer(prefix))


def prefixer(prefix: str) -> Callable[[str], str]:
    """The renaming that puts `prefix` before a name that lacks it."""
    return lambda n: n if n.startswith(prefix) else prefix + n


def renamed_source(source: WeightSource, name: Callable[[str], str]) -> WeightSource:
    """`source` with every name `n` called `name(n)`."""
    inner = source.tensors
    return WeightSource(
        declared=[(name(n), d, s) for n, d, s in source.declared],
        tensors=lambda: ((name(n), t) for n, t in inner()),
        in_memory=source.in_memory,
        complete=source.complete,
        pre_sliced=frozenset(name(n) for n in source.pre_sliced),
        skip=source.skip,
        verify=source.verify,
        description=source.description,
    )


def random_source(shapes: dict[str, tuple[int, ...]], std: float = 0.02) -> WeightSource:
    """Random normal tensors of the given full shapes (load_format "dummy")."""
    return WeightSource(
        declared=[(name, torch.float32, shape) for name, shape in shapes.items()],
        tensors=lambda: ((name, torch.randn(shape) * std) for name, shape in shapes.items()),
        complete=True,
        description="dummy weights",
    )


@dataclass
class RankSelection:
    """Which declared entries a tensor-parallel rank loads: `update_info["tp_ranks"]`, when given, names the rank
    each tensor was sliced for (None: a whole tensor, every rank takes its part)."""

    rank: int
    size: int
    ranks: list[int | None] | None = field(default=None)

    @classmethod
    def from_update_info(cls, update_info: Any, rank: int, size: int) -> RankSelection:
        ranks = update_info.get("tp_ranks") if isinstance(update_info, dict) else None
        return cls(rank, size, ranks)

    def apply(self, source: WeightSource) -> WeightSource:
        """`source` with other ranks' slices skipped and this rank's marked pre-sliced. Raises ValueError for a
        malformed `tp_ranks`."""
        if self.ranks is None:
            return source
        count = len(source.declared)
        if not isinstance(self.ranks, list) or len(self.ranks) != count:
            raise ValueError(f"tp_ranks must list one rank (or None) per declared tensor ({count})")
        if any(r is not None and not (isinstance(r, int) and 0 <= r < self.size) for r in self.ranks):
            raise ValueError(f"tp_ranks entries must be None or ranks in [0, {self.size})")
        source.skip = [r is not None and r != self.rank for r in self.ranks]
        source.pre_sliced = frozenset(d[0] for d, r in zip(source.declared, self.ranks, strict=True) if r == self.rank)
        return source


# ---- the update ---------------------------------------------------------------------------------------------


@dataclass
class PendingHalf:
    """One half of a sparse delta's pair ("indices" or "values") whose partner has not arrived yet in this update
    (hotswap/weights/delta.py); `pre_sliced`: it is already this rank's part."""

    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    tensor: torch.Tensor
    pre_sliced: bool


class Patch:
    """Elements of one tensor's local part written in place: flat `indices` into it (int64) and their new
    `values` (the parameter's dtype). What a sparse delta becomes (hotswap/weights/delta.py)."""

    __slots__ = ("indices", "values")

    def __init__(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        self.indices, self.values = indices, values


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
        shadow: Shadow | None = None,
        backup_device: str = "cpu",
    ) -> None:
        self.index = index
        # where rollback copies of a GPU's parameters go: "cpu" (page-locked host memory) or "device"
        self.backup_device = backup_device
        # staged (update_staging="shadow"): every write goes to staging copies, served only at the commit; the
        # staging copies are the rollback, so no rollback copy is made
        self.shadow = shadow
        self.atomic = atomic
        self.check_finite = check_finite
        self.backup_pool = {} if backups is None else backups
        self.saved: dict[str, dict[str, torch.Tensor]] = {}  # module -> its parameters before the first write
        # what rollback undoes, in the order it happened: ("module", name) for a module saved whole, ("patch",
        # flat view, indices, old values) for elements written in place by a sparse delta
        self.undo: list[tuple[Any, ...]] = []
        self.arrived: dict[str, set[tuple[str, object]]] = {}  # module -> targets loaded since its post-processing
        self.pending: set[str] = set()  # written modules whose post-processing has not run since
        self.loaded_names: set[str] = set()
        self.loaded_keys: set[tuple[str, object]] = set()
        self.delta_names: set[str] = set()  # names a delta of this update applied to (each applies once)
        self.sparse_pending: dict[str, PendingHalf] = {}  # sparse halves awaiting their partner (delta.py)
        # atomic, but wrote without rollback copies (nothing was expected to fail after the first write): a
        # failure that happens anyway cannot be undone, and the caller must treat the weights as invalid
        self.unprotected = False

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
            for key in target.keys:
                by_key.setdefault(key, []).append(name)
            expected = target.local_shape if name in pre_sliced else target.full_shape
            if tuple(shape) != expected:
                wrong.append(
                    f"{name}: expected shape {expected}{' (pre-sliced)' if name in pre_sliced else ''}, "
                    f"got {tuple(shape)}"
                )
            if not _castable(dtype):
                bad_dtypes.append(f"{name}: {dtype}")
        shared = sorted({tuple(names) for names in by_key.values() if len(names) > 1})
        if shared:
            raise ValueError(f"duplicate tensors for the same (tied) weight in one update: {shared}; send one")
        if wrong:
            raise ValueError(f"tensors with the wrong shape: {wrong}")
        if bad_dtypes:
            raise ValueError(f"tensors whose dtype cannot be cast to a floating-point weight: {bad_dtypes}")
        per_module: dict[str, list[tuple[object, Any, torch.dtype]]] = {}
        for name, dtype, _ in entries:
            target = self.index.targets[name]
            per_module.setdefault(target.module_name, []).append((target.shard_id, target.param, dtype))
        for module_name, module_entries in per_module.items():
            check = getattr(self.index.modules[module_name], "check_update", None)
            if check is not None:
                with self.index.scope(module_name):
                    check(module_entries)
        if complete:
            missing = sorted(n for n in self.index.required if self.index.targets[n].key not in by_key)
            if missing:
                raise ValueError(f"checkpoint is missing tensors: {missing}")

    def _limit(self, name: str) -> torch.dtype:
        """The dtype `name`'s values must fit: the parameter's, or for a staging layer (fp8) its stage's, from which
        each row gets its scale."""
        target = self.index.targets[name]
        return getattr(self.index.modules[target.module_name], "stage_dtype", None) or target.param.dtype

    def _finite(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s values fit its target (`_limit`)."""
        if not self.check_finite:
            return True
        return all_finite(tensor.values if isinstance(tensor, Patch) else tensor, self._limit(name))

    def _non_finite(self, pairs: list[tuple[str, torch.Tensor]]) -> list[str]:
        """The names in `pairs` whose values do not fit their targets (`_finite`), in order. Read last to first, so
        the first tensors loaded are the ones read last (still cached, if they fit); where the native check applies,
        in one pass over all of them (`ops.max_magnitude_bits`)."""
        if not self.check_finite:
            return []
        batch: list[tuple[str, torch.Tensor, int]] = []
        on_device: dict[torch.device, list[tuple[str, torch.Tensor, int]]] = {}
        alone: list[tuple[str, torch.Tensor]] = []
        for name, tensor in reversed(pairs):
            values = tensor.values if isinstance(tensor, Patch) else tensor
            bound = magnitude_bound(values.dtype, self._limit(name))
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
        bad.update(name for name, tensor in alone if not self._finite(name, tensor))
        return [name for name, _ in pairs if name in bad]

    # ---- loading --------------------------------------------------------------------------------------------

    def writing(self) -> contextlib.AbstractContextManager[object]:
        """The context every write of this update runs in: the staging copies swapped in (staged), else none."""
        return self.shadow.swapped_in() if self.shadow is not None else contextlib.nullcontext()

    def apply(self, source: WeightSource, final: bool = False) -> int:
        """Loads `source` into the model; returns the number of tensors loaded. `final`: no further `apply`
        follows in this update (see the module doc on rollback copies). Raises ValueError for a declaration or
        values that the model rejects (before anything is loaded from an in-memory source), or whatever the
        source raises while streaming; the caller then rolls back."""
        steps = self.steps(source, final)
        with self.writing():
            return drive(steps)

    def steps(self, source: WeightSource, final: bool = False) -> Generator[None, None, int]:
        """`apply` one tensor at a time: the generator yields after each tensor it loaded and returns the count.
        The caller runs it inside `writing()`, and may leave that context between two tensors (a staged update
        received in slices between the engine's steps)."""
        entries = source.loaded_entries()
        self.check_declaration(entries, source.complete, source.pre_sliced)
        if self.shadow is not None:
            known = [self.index.targets[n] for n, _, _ in entries if n in self.index.targets]
            modules = {t.module_name for t in known}
            check_room(self.index, modules - set(self.shadow.modules), self.shadow.pool)
            keys = {key for t in known for key in t.keys}
            whole = set() if source.reads_served else {m for m in modules if self.index.module_keys[m] <= keys}
            count = yield from self._load_staged(source.stream(), source.pre_sliced, source.description, whole)
            yield from self._verify(source)
            return count
        stream = source.stream()
        backup = (
            self.atomic
            and self.shadow is None
            and not (
                final
                and source.in_memory
                and source.verify is None
                and not any(
                    self.index.targets[n].module_name in self.index.staging_modules
                    for n, _, _ in entries
                    if n in self.index.targets
                )
            )
        )
        self.unprotected = self.unprotected or (self.atomic and not backup and self.shadow is None)
        if source.in_memory:
            pairs = [item for item in stream if not self.index.ignored(item[0])]
            bad = self._non_finite(pairs)
            if bad:
                raise _non_finite_error(bad)
            count = yield from self._load(pairs, source.pre_sliced, backup, True, source.description)
        else:
            count = yield from self._load(stream, source.pre_sliced, backup, False, source.description)
        expected = sum(1 for name, _, _ in entries if not self.index.ignored(name))
        if count != expected:
            raise ValueError(f"the {source.description} ended after {count} of {expected} declared tensors")
        yield from self._verify(source)
        return count

    def _verify(self, source: WeightSource) -> Generator[None, None, None]:
        if source.verify is not None:
            steps = source.verify()
            if steps is not None:
                yield from steps

    def _load(
        self,
        stream: Iterable[tuple[str, torch.Tensor]],
        pre_sliced: frozenset[str],
        backup: bool,
        checked: bool,
        kind: str,
    ) -> Generator[None, None, int]:
        """Loads each tensor of `stream` into its target (the stream's names and shapes must be those declared),
        yielding after each; `checked`: values were checked already."""
        with torch.no_grad():
            count = yield from self._load_each(stream, pre_sliced, backup, checked, kind)
        return count

    def _load_each(
        self,
        stream: Iterable[tuple[str, torch.Tensor]],
        pre_sliced: frozenset[str],
        backup: bool,
        checked: bool,
        kind: str,
    ) -> Generator[None, None, int]:
        non_finite: list[str] = []
        count = 0
        for name, tensor in stream:
            if self.index.ignored(name):
                continue
            if not checked and not self._finite(name, tensor):
                non_finite.append(name)
            if non_finite:
                continue  # drain the stream to name every bad tensor; load nothing more
            target = self.index.targets.get(name)
            assert target is not None, f"the {kind} delivered {name!r}, which it did not declare"
            sliced = name in pre_sliced
            if isinstance(tensor, Patch):
                self._patch(target, tensor, backup)
            else:
                if tuple(tensor.shape) != (target.local_shape if sliced else target.full_shape):
                    raise ValueError(f"the {kind} delivered {name!r} with shape {tuple(tensor.shape)}, not as declared")
                if backup or target.module_name in self.index.staging_modules:
                    self._save(target.module_name)
                target.layout.load_weight(target.param, tensor, target.shard_id, sliced)
            count += 1
            self._loaded(name, target)
            yield
        if non_finite:
            raise _non_finite_error(non_finite)
        return count

    def _load_staged(
        self, stream: Iterable[tuple[str, torch.Tensor]], pre_sliced: frozenset[str], kind: str, whole: set[str]
    ) -> Generator[None, None, int]:
        """`_load` of a staged update: each tensor checked and copied into the staging copies in chunks of
        `CHUNK_BYTES`, yielding after each, so that no slice between two steps holds a whole large tensor.
        `whole`: modules this update rewrites entirely (their staging copies need not start as the served
        weights)."""
        assert self.shadow is not None
        non_finite: list[str] = []
        count = 0
        with torch.no_grad():
            for name, tensor in stream:
                if self.index.ignored(name) or non_finite:
                    continue  # after a bad tensor: drain the stream to name every bad one; load nothing more
                target = self.index.targets.get(name)
                assert target is not None, f"the {kind} delivered {name!r}, which it did not declare"
                sliced = name in pre_sliced
                yield from chunked_copies(self.shadow.stage(target.module_name, target.module_name not in whole))
                if isinstance(tensor, Patch):
                    if not self._finite(name, tensor):
                        non_finite.append(name)
                        continue
                    self._patch(target, tensor, False)
                else:
                    if tuple(tensor.shape) != (target.local_shape if sliced else target.full_shape):
                        raise ValueError(
                            f"the {kind} delivered {name!r} with shape {tuple(tensor.shape)}, not as declared"
                        )
                    if not (yield from self._write_staged(name, target, tensor, sliced)):
                        non_finite.append(name)
                        continue
                count += 1
                self._loaded(name, target)
                yield
        if non_finite:
            raise _non_finite_error(non_finite)
        return count

    def _loaded(self, name: str, target: Any) -> None:
        """Records that `name` landed in `target`; post-processes its module once all the module's targets did."""
        self.loaded_names.add(name)
        self.loaded_keys.update(target.keys)
        arrived = self.arrived.setdefault(target.module_name, set())
        arrived.update(target.keys)
        self.pending.add(target.module_name)
        if arrived >= self.index.module_keys[target.module_name]:
            self._post_process(target.module_name)
            arrived.clear()

    def _write_staged(self, name: str, target: Any, tensor: torch.Tensor, sliced: bool) -> Generator[None, None, bool]:
        """Writes `tensor` into its target (the staging copy), checking its values chunk by chunk: what the
        layout's `load_weight` does, by the `ShardedWeights` contract (this rank's part, cut by `narrowings`,
        lands in `local_view`), where that contract alone decides it (no fused name covering several shards, no
        fp8 stage); else through `load_weight` after checking the whole tensor. Returns False (nothing more
        written) when a chunk's values do not fit the target."""
        if target.covers is None and target.module_name not in self.index.staging_modules:
            src = tensor
            if not sliced:
                for dim, start, length in target.narrowings():
                    src = src.narrow(dim, start, length)
            dst = target.local_view()
            if src.shape == dst.shape:
                limit = self._limit(name)
                for rows in _row_chunks(dst):
                    part = src[rows]
                    if self.check_finite and not all_finite(part, limit):
                        return False
                    ops.copy_(dst[rows], part)
                    yield
                return True
        if not self._finite(name, tensor):
            return False
        target.layout.load_weight(target.param, tensor, target.shard_id, sliced)
        return True

    def _patch(self, target: Any, patch: Patch, backup: bool) -> None:
        """Writes a sparse delta's elements in place (only those: a 2 % delta moves 2 % of the bytes), keeping
        their old values for rollback when `backup`."""
        view = target.local_view().view(-1)  # contiguous: `decoded` sends whole tensors otherwise
        if backup and self.atomic and target.module_name not in self.saved:
            self.undo.append(("patch", view, patch.indices, view.index_select(0, patch.indices)))
        ops.scatter_(view, patch.indices, patch.values)
        packing.drop(self.index.modules[target.module_name])  # a packed copy holds the old values

    def _save(self, module_name: str) -> None:
        if not self.atomic or module_name in self.saved:
            return
        module = self.index.modules[module_name]
        saved = {}
        for name, param in module.named_parameters(recurse=False):
            # pooled buffers persist between updates, so steady-state updates do not fault in fresh memory
            key = f"{module_name}.{name}"
            buffer = self.backup_pool.get(key)
            where = torch.device("cpu") if self.backup_device == "cpu" else param.device
            if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype or buffer.device != where:
                buffer = self.backup_pool[key] = torch.empty(
                    param.shape, dtype=param.dtype, device=where, pin_memory=where.type == "cpu" != param.device.type
                )
            ops.copy_(buffer, param.detach())
            saved[name] = buffer
        self.saved[module_name] = saved
        self.undo.append(("module", module_name))

    def _post_process(self, module_name: str) -> None:
        hook = getattr(self.index.modules[module_name], "process_weights_after_loading", None)
        if hook is not None:
            with self.index.scope(module_name):
                hook()
        self.pending.discard(module_name)

    # ---- ending ---------------------------------------------------------------------------------------------

    def wrote_served(self) -> bool:
        """Whether this update wrote any weight of the served model (not only a draft's)."""
        return bool(self.loaded_keys & self.index.validating_keys)

    def covers_all(self) -> bool:
        """Whether every weight of the served model was loaded by this update (after `finish`); a draft model's
        weights alone never count (see `WeightIndex.union`)."""
        return bool(self.index.validating_keys) and self.index.validating_keys <= self.loaded_keys

    def finish(self, keep_copies: bool = False) -> None:
        """Post-processes modules that received part of their tensors (the rest stay as they were); then drops
        the rollback copies (their buffers stay in the pool), unless `keep_copies`: the update may still be
        rolled back (the first phase of a two-phase commit). Raises ValueError, before post-processing, when a
        sparse delta's half never met its partner."""
        if self.sparse_pending:
            raise ValueError(f"sparse delta halves whose partner never arrived: {sorted(self.sparse_pending)[:5]}")
        with self.writing():
            for module_name in sorted(self.pending):
                self._post_process(module_name)
        if self.shadow is not None:
            self.shadow.prepack()
            if not keep_copies:
                self.shadow.commit()
        if not keep_copies:
            self.saved.clear()
            self.undo.clear()
            self.arrived.clear()

    def rollback(self) -> None:
        """Restores every module written since the update began to its saved copy (atomic mode) and discards
        staged data."""
        if self.shadow is not None:  # the served weights were never written: the staging copies go
            self.shadow.drop()
            for module_name in self.arrived:
                discard = getattr(self.index.modules[module_name], "discard_stage", None)
                if discard is not None:
                    discard()
            self.arrived.clear()
            self.pending.clear()
            return
        assert self.atomic, "rollback needs atomic mode"
        with torch.no_grad():
            for entry in reversed(self.undo):  # latest first: each undo sees the state its write left
                if entry[0] == "patch":
                    _, view, indices, old = entry
                    ops.scatter_(view, indices, old)
                    continue
                module = self.index.modules[entry[1]]
                packing.drop(module)  # a packed copy holds the weights being undone
                params = dict(module.named_parameters(recurse=False))
                for name, value in self.saved[entry[1]].items():
                    ops.copy_(params[name].data, value)
            for module_name in self.arrived:  # patched in place (modules restored whole dropped theirs above)
                packing.drop(self.index.modules[module_name])
        for module_name in self.arrived:
            discard = getattr(self.index.modules[module_name], "discard_stage", None)
            if discard is not None:
                discard()
        self.saved.clear()
        self.undo.clear()
        self.arrived.clear()
        self.pending.clear()


def drive(steps: Generator[None, None, int]) -> int:
    """Runs `steps` (see `WeightUpdate.steps`) to its end; returns its count."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return cast(int, stop.value)


CHUNK_BYTES = 2 << 20  # what a staged update copies or checks between two yields


def _row_chunks(t: torch.Tensor) -> Iterator[slice | tuple[()]]:
    """Index expressions cutting `t` along dim 0 into pieces of about `CHUNK_BYTES` (a 0-d tensor: one, whole)."""
    if t.dim() == 0 or t.numel() == 0:
        yield ()
        return
    row_bytes = max(1, t[0].numel() * t.element_size())
    step = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, t.shape[0], step):
        yield slice(start, start + step)


def chunked_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Generator[None, None, None]:
    """Copies each (dst, src) pair in `_row_chunks`, yielding after each chunk."""
    for dst, src in pairs:
        for rows in _row_chunks(dst):
            ops.copy_(dst[rows], src[rows])
            yield
