"""Sleep and wake for weights on a GPU: free the device memory of the model's parameters and bring it back, with
every Parameter, and every storage object, kept.

`offload(params, keep, pin)` takes the distinct storages under `params` (deduplicated by data pointer: tied
weights, and every view of a fused parameter, share one storage and are moved once). With `keep` (sleep level 1)
it copies each storage's bytes into one host buffer (pinned with `pin`, so that wake copies at the link's rate);
then it frees the device memory by resizing each storage to 0 bytes (`untyped_storage().resize_(0)`), and hands
the freed blocks back to the driver (`torch.cuda.empty_cache()`). `restore(offloaded)` resizes every storage back
to its byte size and copies the host bytes in (level 1), or zero-fills it (level 2: the caller marks the weights
invalid until a reload or a full update).

What stays valid, and what does not:

- the Parameter objects, their storage objects and every tensor viewing those storages (a layer's reference, a
  slice of a fused parameter made before the sleep, a weight index's local views): they share the storage object,
  whose memory is swapped underneath, so after `restore` they read the restored bytes (tests/test_offload.py);
- while asleep, those tensors have no memory behind them: reading or writing them is undefined (on the CPU it
  can crash the process, nothing checks the bounds of a read). The caller must run nothing on the model until
  `restore`;
- the data pointers change at wake (the allocator hands out new blocks): CUDA graphs captured over the weights
  read the old addresses and must be captured again after `restore` (and never replayed while asleep); so must any
  other cache of raw pointers or of copies (packed weights).

Works on CPU tensors too (their storages resize the same way), which is how it is tested without a GPU; a
storage that cannot be resized (a view of a memory map, of huge-page placement, of numpy memory) is refused up
front with ValueError, before anything moved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

_ALIGN = 64  # each storage's bytes start on a cache line of the host copy


@dataclass
class _Entry:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int  # of its bytes in the host copy


@dataclass
class Offloaded:
    """What `offload` freed: the storages (each once) with their byte sizes; with `keep`, their bytes in `host`
    (one buffer, back to back; `pinned`: page-locked for the device). Figures: `bytes_released` (device or host
    memory freed from the storages), `bytes_to_host` (copied out; 0 without `keep`). `restored` once `restore`
    brought everything back."""

    entries: list[_Entry]
    keep: bool
    host: torch.Tensor | None
    pinned: bool
    bytes_released: int
    bytes_to_host: int
    restored: bool = False
    _registered: list[int] = field(default_factory=list)  # host address pinned by cudaHostRegister, to unregister

    @property
    def storages(self) -> int:
        return len(self.entries)


@dataclass
class Restored:
    """What `restore` did: storages resized back, the bytes re-allocated, and those copied back from the host
    (level 1; 0 at level 2, where the bytes were zero-filled)."""

    storages: int
    bytes_reallocated: int
    bytes_to_device: int


def distinct_storages(params: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages under `params`, each once (by data pointer: tied and fused parameters share one), in first
    appearance order; storages of 0 bytes (empty parameters, or already offloaded ones) are left out."""
    seen: set[int] = set()
    out: list[torch.UntypedStorage] = []
    for param in params:
        storage = param.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append(storage)
    return out


def _bytes(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the first `nbytes` of `storage` (sharing it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _synchronize(devices: set[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def offload(params: Iterable[torch.Tensor], keep: bool, pin: bool = False, empty_cache: bool = True) -> Offloaded:
    """Frees the memory of every distinct storage under `params` (see the module doc), first copying its bytes to
    host memory when `keep` (sleep level 1), pinned when `pin` and some storage is on a CUDA device. Returns what
    `restore` needs, with the figures. `empty_cache`: hand the freed CUDA blocks back to the driver, so that other
    processes (a colocated trainer) can use them. Raises ValueError, having changed nothing, if a storage cannot
    be resized; an error while copying (host memory) also leaves everything as it was."""
    storages = distinct_storages(params)
    for storage in storages:
        if not storage.resizable():
            raise ValueError(
                f"a {storage.device} parameter storage of {storage.nbytes()} bytes cannot be resized (it views memory "
                "that torch does not own: a memory map, huge pages, numpy); nothing was offloaded"
            )
    entries: list[_Entry] = []
    total = 0
    for storage in storages:
        entries.append(_Entry(storage, storage.nbytes(), total))
        total += (storage.nbytes() + _ALIGN - 1) // _ALIGN * _ALIGN
    devices = {s.device for s in storages}
    on_cuda = any(d.type == "cuda" for d in devices)
    result = Offloaded(entries, keep, None, False, sum(e.nbytes for e in entries), 0)
    if keep and entries:
        result.host = torch.empty(total, dtype=torch.uint8, device="cpu")
        if pin and on_cuda:
            result.pinned = _register(result)
        try:
            for entry in entries:
                host = result.host[entry.offset : entry.offset + entry.nbytes]
                host.copy_(_bytes(entry.storage, entry.nbytes), non_blocking=result.pinned)
            _synchronize(devices)  # the host bytes are complete before any device memory goes
        except BaseException:
            _unregister(result)
            raise
        result.bytes_to_host = result.bytes_released
    for entry in entries:
        entry.storage.resize_(0)
    if on_cuda and empty_cache:
        torch.cuda.empty_cache()
    return result


def restore(offloaded: Offloaded, zero: bool = True) -> Restored:
    """Resizes every offloaded storage back to its byte size (new memory: its data pointer changes) and copies
    its host bytes back (level 1), or, without a host copy (level 2), zero-fills it when `zero` (else its
    contents are undefined). Every Parameter and view sees the result (the module doc). Raises RuntimeError if
    already restored; an allocation failure (out of memory) raises with the storages restored so far kept, and a
    later call resumes with the rest."""
    if offloaded.restored:
        raise RuntimeError("these weights were restored already")
    reallocated = copied = 0
    devices: set[torch.device] = set()
    for entry in offloaded.entries:
        if entry.storage.nbytes() == entry.nbytes:
            continue  # restored by an earlier, interrupted call
        entry.storage.resize_(entry.nbytes)
        reallocated += entry.nbytes
        devices.add(entry.storage.device)
        target = _bytes(entry.storage, entry.nbytes)
        if offloaded.host is not None:
            target.copy_(offloaded.host[entry.offset : entry.offset + entry.nbytes], non_blocking=offloaded.pinned)
            copied += entry.nbytes
        elif zero:
            target.zero_()
    _synchronize(devices)  # the copies read the host buffer: done before it is let go
    _unregister(offloaded)
    offloaded.host = None
    offloaded.restored = True
    return Restored(len(offloaded.entries), reallocated, copied)


def _register(offloaded: Offloaded) -> bool:
    """Page-locks the host copy for the device (cudaHostRegister: exactly its size, unlike pinned allocations,
    which torch's host allocator rounds up to a power of two). False, leaving it pageable, where that fails."""
    assert offloaded.host is not None
    address, size = offloaded.host.data_ptr(), offloaded.host.nbytes
    if size == 0:
        return False
    try:
        status = torch.cuda.cudart().cudaHostRegister(address, size, 0)
    except (RuntimeError, AttributeError):
        return False
    if int(status) != 0:
        return False
    offloaded._registered.append(address)
    return True


def _unregister(offloaded: Offloaded) -> None:
    for address in offloaded._registered:
        with contextlib.suppress(RuntimeError, AttributeError):
            torch.cuda.cudart().cudaHostUnregister(address)
    offloaded._registered.clear()
    offloaded.pinned = False
