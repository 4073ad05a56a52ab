"""Staged weights: an update written into staging copies while the served weights keep serving, then committed
in one swap (`update_staging="shadow"`, docs/weight-sync.md).

Before an update first writes a module, `Shadow.stage` copies the module's parameters into staging buffers (so a
partial update keeps the values it does not send). Every write of the update (loads, sparse patches,
post-processing, checksum verification, a canary's forward) runs inside `swapped_in()`: for that stretch each
staged parameter's `.data` is its staging buffer, and the module's packed copy is the staging side's; on leaving,
the served tensors are back. Nothing else may run on the model inside the stretch: the engine enters it between
steps, on the thread that steps.

    commit()   the staging side becomes the served one: on the CPU the parameters keep the staging buffers
               (a pointer swap per parameter, whatever the update's size) and the buffers they had return to the
               pool, to stage the next update; on a GPU the staging buffers are copied into the served storage
               (a device copy at HBM rate), so captured CUDA graphs, which hold the served pointers, stay valid
    drop()     the rollback: the staging buffers return to the pool, the served weights were never touched

Parameter objects are never replaced (layers, the weight index and the decoder stack hold them); on the CPU their
storage changes at the commit, as after `wake_up`. Memory: one more copy of the weights, reserved when the model
loads (`Worker._reserve_staging`: its pages touched, in huge pages as the weights are) and kept in the pool
between updates; `check_room` refuses what does not fit before anything is allocated (the reservation at
construction; after `sleep()` released the pool, the next update).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hotswap.config import available_memory_bytes
from hotswap.kernels import ops
from hotswap.kernels import packed as packing
from hotswap.weights.index import WeightIndex


class Shadow:
    """The staging copies of one update, drawn from (and returned to) `pool`, a dict the caller keeps across
    updates: parameter name -> buffer."""

    def __init__(self, index: WeightIndex, pool: dict[str, torch.Tensor]) -> None:
        self.index = index
        self.pool = pool
        # id(parameter) -> (its name, the parameter, the staging tensor); a tied weight is staged once
        self.params: dict[int, tuple[str, nn.Parameter, torch.Tensor]] = {}
        self.modules: dict[
            str, packing.PackedEntry | None
        ] = {}  # staged module name -> the staging side's packed copy (None: none)
        self.served: dict[int, torch.Tensor] = {}  # while swapped in: id(parameter) -> the served tensor
        self.served_packed: dict[
            str, packing.PackedEntry | None
        ] = {}  # while swapped in: module -> the served side's packed copy
        self.inside = False

    # ---- staging ----------------------------------------------------------------------------------------------

    def stage(self, module_name: str, fill: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Gives `module_name` staging copies of its parameters (once per update); inside `swapped_in()` they take
        the parameters' place at once. Returns the (staging copy, served tensor) copies the caller must make
        before writing: every parameter when `fill`, else only freshly allocated ones (a pooled copy holds a served
        version already; `fill` False says the update rewrites every loaded element, and derived parameters and
        padding follow from those or never change)."""
        if module_name in self.modules:
            return []
        module = self.index.modules[module_name]
        copies = []
        for name, param in module.named_parameters(recurse=False):
            if id(param) in self.params:
                continue  # tied: staged with its other module
            key = f"{module_name}.{name}"
            live = param.data  # not swapped yet: the served tensor
            buffer = self.pool.pop(key, None)
            fresh = (
                buffer is None
                or buffer.shape != live.shape
                or buffer.dtype != live.dtype
                or (buffer.device != live.device)
            )
            if buffer is None or fresh:
                buffer = torch.empty_like(live, requires_grad=False)
            if fill or fresh or getattr(param, "hotswap_derived", False):
                copies.append((buffer, live))
            self.params[id(param)] = (key, param, buffer)
            if self.inside:
                self.served[id(param)] = param.data
                param.data = buffer
        self.modules[module_name] = None
        if self.inside:
            self.served_packed[module_name] = packing.take(module)
        return copies

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The staged tensors take the parameters' place for the duration (re-entrant: an inner use is a no-op)."""
        if self.inside:
            yield
            return
        self.swap_in()
        try:
            yield
        finally:
            self.swap_out()

    def swap_in(self) -> None:
        """The staged tensors take the parameters' place until `swap_out` (see `swapped_in`)."""
        for pid, (_, param, staged) in self.params.items():
            self.served[pid] = param.data
            param.data = staged
        for module_name, entry in self.modules.items():
            module = self.index.modules[module_name]
            self.served_packed[module_name] = packing.take(module)
            packing.put(module, entry)
        self.inside = True

    def swap_out(self) -> None:
        """The served tensors are back."""
        for pid, (key, param, _) in self.params.items():
            staged = param.data
            param.data = self.served.pop(pid)
            self.params[pid] = (key, param, staged)
        for module_name in self.modules:
            module = self.index.modules[module_name]
            self.modules[module_name] = packing.take(module)
            packing.put(module, self.served_packed.pop(module_name, None))
        self.inside = False

    def prepack(self) -> None:
        """Builds the staging side's packed copies (where the packed product applies) now, off the pause, so the
        first step after the commit does not pack them."""
        with self.swapped_in(), torch.no_grad():
            for module_name in self.modules:
                weight = getattr(self.index.modules[module_name], "weight", None)
                if isinstance(weight, torch.Tensor):
                    packing.weight_for(self.index.modules[module_name], weight)

    # ---- ending -----------------------------------------------------------------------------------------------

    def commit(self) -> None:
        """The staged weights become the served ones (see the module doc: a swap on the CPU, a copy on a GPU)."""
        assert not self.inside, "commit outside swapped_in()"
        with torch.no_grad():
            for key, param, staged in self.params.values():
                if param.device.type == "cpu":
                    served, param.data = param.data, staged
                    self.pool[key] = served
                else:
                    ops.copy_(param.data, staged)
                    self.pool[key] = staged
        for module_name, entry in self.modules.items():  # a packed copy names the storage it was packed from
            packing.put(self.index.modules[module_name], entry)
        self.params.clear()
        self.modules.clear()

    def drop(self) -> None:
        """Forgets the staged weights (the served ones were never written); their buffers go back to the pool,
        the reservation a staged engine holds anyway (one copy of the weights), and nothing more is kept."""
        if self.inside:
            self.swap_out()
        for key, _, staged in self.params.values():
            self.pool[key] = staged
        self.params.clear()
        self.modules.clear()


def check_room(index: WeightIndex, module_names: set[str], pool: dict[str, torch.Tensor]) -> None:
    """Raises MemoryError (nothing allocated) when staging copies of `module_names`' parameters, beyond what the
    pool already holds for them, do not fit in the memory free on their device (host: MemAvailable; a GPU:
    `torch.cuda.mem_get_info`), keeping a 5 % margin."""
    need: dict[str, int] = {}
    seen: set[int] = set()
    for module_name in module_names:
        for name, param in index.modules[module_name].named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            held = pool.get(f"{module_name}.{name}")
            if held is not None and held.shape == param.shape and held.dtype == param.dtype:
                continue
            where = str(param.device)
            need[where] = need.get(where, 0) + param.numel() * param.element_size()
    for where, nbytes in need.items():
        free = _free_bytes(torch.device(where))
        if nbytes > 0.95 * free:
            raise MemoryError(
                f"update_staging='shadow' needs {nbytes / 2**20:.0f} MiB more for the staging copies on {where}, "
                f"but {free / 2**20:.0f} MiB are free; update fewer tensors at a time, free memory, or use "
                "update_staging='in_place'"
            )


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory_bytes()
