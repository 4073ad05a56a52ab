"""The one update object every weight path goes through.

Every way weights arrive is a `WeightSource` (hotswap/weights/source.py), a declaration plus the (name, tensor)
pairs, and `WeightUpdate.apply` is its only consumer; the declaration is checked against the model before anything
moves (hotswap/weights/checks.py).

    WeightUpdate(index, atomic, check_finite, backups)
      .apply(source)   declaration checked once (names, shapes, dtypes, duplicates, completeness), then values
                       (in-memory sources: all of them before the first write; streamed ones: tensor by tensor),
                       then each tensor loaded through its target's layout; a module whose tensors all arrived is
                       post-processed at once (`process_weights_after_loading`)
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
from collections.abc import Generator, Iterable
from typing import Literal, cast

import torch

from hotswap.kernels import ops
from hotswap.kernels import packed as packing
from hotswap.weights.checks import (
    all_finite,
    check_declaration,
    device_max_magnitude_bits,
    magnitude_bound,
    non_finite_error,
    non_finite_names,
)
from hotswap.weights.chunks import CHUNK_BYTES, chunked_copies, row_chunks
from hotswap.weights.index import Target, WeightIndex
from hotswap.weights.shadow import Shadow, check_room
from hotswap.weights.source import (
    Declared,
    NamedTensors,
    Patch,
    PendingHalf,
    RankSelection,
    WeightSource,
    folder_source,
    pairs_source,
    prefixed_source,
    prefixer,
    random_source,
    renamed_source,
)

# re-exported: what feeds an update and its checks are imported from here too
__all__ = [
    "CHUNK_BYTES",
    "Declared",
    "NamedTensors",
    "Patch",
    "PendingHalf",
    "RankSelection",
    "WeightSource",
    "WeightUpdate",
    "all_finite",
    "chunked_copies",
    "device_max_magnitude_bits",
    "drive",
    "folder_source",
    "magnitude_bound",
    "pairs_source",
    "prefixed_source",
    "prefixer",
    "random_source",
    "renamed_source",
]


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
        self.undo: list[
            tuple[Literal["module"], str] | tuple[Literal["patch"], torch.Tensor, torch.Tensor, torch.Tensor]
        ] = []
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
        a `complete` checkpoint, missing ones. Nothing has moved yet (`checks.check_declaration`)."""
        check_declaration(self.index, declared, complete, pre_sliced)

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

    def _non_finite(self, pairs: list[tuple[str, torch.Tensor]], grouped: bool) -> Generator[None, None, list[str]]:
        """The names in `pairs` whose values do not fit their targets (`_finite`), in order
        (`checks.non_finite_names`: one pass over host tensors, one host read per device). `grouped` (an update
        received in slices between steps): host tensors in groups of about `CHUNK_BYTES`, with a yield after each
        (the last group first, as that function reads), so that no slice holds the check of every tensor. Every
        value is checked before the first write either way."""
        if not self.check_finite:
            return []
        groups: list[list[tuple[str, torch.Tensor]]] = [list(pairs)]
        if grouped:  # a device's tensors stay one group (one host read); the host's, groups of CHUNK_BYTES
            on_host = [(t.values if isinstance(t, Patch) else t).device.type == "cpu" for _, t in pairs]
            groups = [[pair for pair, host in zip(pairs, on_host, strict=True) if not host], []]
            size = 0
            for (name, tensor), host in zip(pairs, on_host, strict=True):
                if not host:
                    continue
                nbytes = (tensor.values if isinstance(tensor, Patch) else tensor).nbytes
                if groups[-1] and size + nbytes > CHUNK_BYTES:
                    groups.append([])
                    size = 0
                groups[-1].append((name, tensor))
                size += nbytes
        order = {name: i for i, (name, _) in enumerate(pairs)}
        bad: list[str] = []
        for group in reversed(groups):
            if group:
                bad += non_finite_names(group, self._limit)
                yield
        return sorted(bad, key=order.__getitem__)

    # ---- loading --------------------------------------------------------------------------------------------

    def writing(self) -> contextlib.AbstractContextManager[object]:
        """The context every write of this update runs in: the staging copies swapped in (staged), else none."""
        return self.shadow.swapped_in() if self.shadow is not None else contextlib.nullcontext()

    def apply(self, source: WeightSource, final: bool = False) -> int:
        """Loads `source` into the model; returns the number of tensors loaded. `final`: no further `apply`
        follows in this update (see the module doc on rollback copies). Raises ValueError for a declaration or
        values that the model rejects (before anything is loaded from an in-memory source), or whatever the
        source raises while streaming; the caller then rolls back."""
        steps = self.steps(source, final, sliced=False)
        with self.writing():
            return drive(steps)

    def steps(self, source: WeightSource, final: bool = False, sliced: bool = True) -> Generator[None, None, int]:
        """`apply` one tensor at a time: the generator yields after each tensor it loaded and returns the count.
        The caller runs it inside `writing()`, and may leave that context between two tensors (a staged update
        received in slices between the engine's steps). `sliced` False (`apply`, driven to its end at once): an
        in-memory source's values are checked in one pass, not in groups."""
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
            bad = yield from self._non_finite(pairs, sliced)
            if bad:
                raise non_finite_error(bad)
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
            raise non_finite_error(non_finite)
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
            raise non_finite_error(non_finite)
        return count

    def _loaded(self, name: str, target: Target) -> None:
        """Records that `name` landed in `target`; post-processes its module once all the module's targets did."""
        self.loaded_names.add(name)
        self.loaded_keys.update(target.keys)
        arrived = self.arrived.setdefault(target.module_name, set())
        arrived.update(target.keys)
        self.pending.add(target.module_name)
        if arrived >= self.index.module_keys[target.module_name]:
            self._post_process(target.module_name)
            arrived.clear()

    def _write_staged(
        self, name: str, target: Target, tensor: torch.Tensor, sliced: bool
    ) -> Generator[None, None, bool]:
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
                for rows in row_chunks(dst):
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

    def _patch(self, target: Target, patch: Patch, backup: bool) -> None:
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
