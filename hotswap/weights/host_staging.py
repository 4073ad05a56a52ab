"""Host tensors onto a GPU at the copy floor: two pinned host slots, double buffered.

A host tensor (a shared-memory view, a memory-mapped safetensors file) copied straight to a CUDA device goes
through the driver's own small pinned bounce buffer, synchronously, at a fraction of the link's rate. Here the
bytes go through two pinned host slots instead: while the CPU copies the next bytes into one slot (`ops.copy_`,
streaming stores), the other slot's host-to-device copy runs, `non_blocking`, on a side stream. Small tensors are
packed into one slot and moved by one copy; a tensor larger than a slot is moved in slot-sized chunks.

Contracts of `HostStaging.stage(pairs)`:

- values and order: it yields one (name, tensor) per input pair, in input order, each bit for bit equal to its
  input (dtype and shape kept). Pairs that need no staging (a tensor already on the device, or anything that is
  not a tensor, such as a sparse delta's `Patch`) pass through unchanged, in their place;
- inputs may be views into a buffer that their producer reuses once asked for the next pair (a transport's
  contract, `WeightSource`): every byte of an input is copied into a slot before the next input is requested;
- outputs are fresh device tensors (a slot's tensors are views of one device allocation, made by the caching
  allocator): they stay valid as long as they are referenced, not only until the next pair;
- streams: an output may be read at once on the consumer's stream (the current stream of the thread at the
  moment it is yielded): that stream waits, without the host waiting, for the copy event of its slot, and the
  output's memory is recorded as used by that stream, so the allocator reuses it only after the consumer's reads;
- slots: a slot is refilled only after the host waited for the event of its previous copy; the two slots are
  allocated once per `HostStaging` and reused by every later `stage` call (no per-tensor host allocation);
- lookahead: the outputs of one slot are yielded once the next slot's copy was issued (or the input ended), so a
  consumer that waits on the host for each tensor (a finiteness check) still overlaps the link with the CPU copy.
  At most two slots' worth of outputs (or one large tensor and one slot) are held ahead of the consumer;
- one `stage` iteration at a time per `HostStaging` (the slots are shared): a second raises RuntimeError.

On the CPU (`HostStaging("cpu", pin=False)`) the same slot, chunk and packing logic runs with synchronous copies,
so it is tested without a GPU; `stage_to_device` passes a source through unchanged when its device is the CPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeGuard, TypeVar

import torch

from hotswap.kernels import ops
from hotswap.weights.update import WeightSource

T = TypeVar("T")  # what a stream's pairs carry: host tensors are staged, anything else passes through

DEFAULT_SLOT_BYTES = 64 * 1024 * 1024
_ALIGN = 64  # every packed tensor starts on a cache line (and so on its element size)


@dataclass
class StagingStats:
    """Running totals of a `HostStaging`: tensors staged, their bytes, host-to-device copies issued, device
    allocations made (one per slot flush or large tensor), host slots allocated (2 for its whole life), pairs
    passed through unchanged."""

    tensors: int = 0
    bytes: int = 0
    copies: int = 0
    device_allocations: int = 0
    slot_allocations: int = 0
    passed_through: int = 0


@dataclass
class _Group(Generic[T]):
    """Outputs whose bytes were all issued: (name, tensor) pairs, the event their copies end with (None on the
    CPU), and the device allocation(s) backing them."""

    items: list[tuple[str, T | torch.Tensor]]
    ready: torch.cuda.Event | None = None
    buffers: list[torch.Tensor] = field(default_factory=list)


class HostStaging:
    """Copies host tensors to `device` through two `slot_bytes` host slots (pinned where `pin`; default: pinned
    for a CUDA device, not on the CPU, where pinned memory needs CUDA). Reusable: the slots, the side stream and
    the events live as long as this object. See the module doc for the contracts of `stage`."""

    def __init__(
        self, device: str | torch.device, slot_bytes: int = DEFAULT_SLOT_BYTES, pin: bool | None = None
    ) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"HostStaging stages onto 'cpu' or a CUDA device, got {device!r}")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not isinstance(slot_bytes, int) or slot_bytes < _ALIGN:
            raise ValueError(f"slot_bytes must be an integer >= {_ALIGN}, got {slot_bytes!r}")
        self.slot_bytes = slot_bytes // _ALIGN * _ALIGN
        self.pin = self.device.type == "cuda" if pin is None else bool(pin)
        self.stats = StagingStats()
        self._slots: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]  # per slot: the end of its last host-to-device copy
        self._stream: torch.cuda.Stream | None = None
        self._active = False

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def slots(self) -> list[torch.Tensor]:
        """The two host slots (allocated on first use, then the same tensors for this object's life)."""
        if not self._slots:
            self._slots = [
                torch.empty(self.slot_bytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin) for _ in range(2)
            ]
            self.stats.slot_allocations += 2
        return self._slots

    def stage(
        self, pairs: Iterable[tuple[str, T]], skip: list[bool] | None = None
    ) -> Iterator[tuple[str, T | torch.Tensor]]:
        """`pairs` with every host tensor copied to the device (contracts: the module doc). `skip[i]` True passes
        pair i through unstaged (another rank's slice, dropped by its consumer)."""
        if self._active:
            raise RuntimeError(
                "this HostStaging is already staging another stream (one at a time: the slots are shared)"
            )
        self._active = True
        try:
            yield from self._stage(pairs, skip)
        finally:
            self._active = False

    # ---- the pipeline ---------------------------------------------------------------------------------------

    def _stage(self, pairs: Iterable[tuple[str, T]], skip: list[bool] | None) -> Iterator[tuple[str, T | torch.Tensor]]:
        slots = self.slots()
        if self.on_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        done: deque[_Group[T]] = deque()
        slot = 0  # the slot being filled
        fill = 0  # bytes packed into it
        packed: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []  # name, dtype, shape, offset, bytes

        def flush() -> None:
            nonlocal slot, fill, packed
            if not packed:
                return
            buffer = self._device_empty(fill)
            self._issue(buffer, slots[slot][:fill], slot)
            items: list[tuple[str, T | torch.Tensor]] = []
            for name, dtype, shape, offset, nbytes in packed:
                if nbytes == 0:
                    items.append((name, torch.empty(shape, dtype=dtype, device=self.device)))
                else:
                    items.append((name, buffer[offset : offset + nbytes].view(dtype).view(shape)))
            done.append(_Group(items, self._ready(), [buffer]))
            packed, fill, slot = [], 0, 1 - slot

        for index, item in enumerate(pairs):
            name, tensor = item
            if (skip is not None and index < len(skip) and skip[index]) or not self._stageable(tensor):
                flush()
                done.append(_Group([(name, tensor)]))
                self.stats.passed_through += 1
            else:
                source = _bytes_of(tensor)
                nbytes = source.numel()
                self.stats.tensors += 1
                self.stats.bytes += nbytes
                if nbytes > self.slot_bytes:  # chunked through the slots, into a device tensor of its own
                    flush()
                    buffer = self._device_empty(nbytes)
                    for start in range(0, nbytes, self.slot_bytes):
                        end = min(start + self.slot_bytes, nbytes)
                        self._wait_slot(slot)
                        ops.copy_(slots[slot][: end - start], source[start:end])
                        self._issue(buffer[start:end], slots[slot][: end - start], slot)
                        slot = 1 - slot
                    shaped = buffer.view(tensor.dtype).view(tensor.shape)
                    done.append(_Group([(name, shaped)], self._ready(), [buffer]))
                else:
                    if fill + nbytes > self.slot_bytes:
                        flush()
                    if not packed:
                        self._wait_slot(slot)
                    if nbytes:
                        ops.copy_(slots[slot][fill : fill + nbytes], source)
                    packed.append((name, tensor.dtype, tuple(tensor.shape), fill, nbytes))
                    fill += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            while len(done) > 1:  # the oldest group's copies were issued before the next group's
                yield from self._hand_over(done.popleft())
        flush()
        while done:
            yield from self._hand_over(done.popleft())

    def _stageable(self, tensor: object) -> TypeGuard[torch.Tensor]:
        """A host tensor with data (what is copied); anything else passes through."""
        return (
            isinstance(tensor, torch.Tensor)
            and tensor.device.type == "cpu"
            and tensor.layout is torch.strided
            and not tensor.is_quantized
            and not tensor.is_meta
        )

    def _device_empty(self, nbytes: int) -> torch.Tensor:
        """A device byte buffer, allocated on the side stream (it is first written there)."""
        self.stats.device_allocations += 1
        if not self.on_cuda:
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        with torch.cuda.stream(self._stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _wait_slot(self, slot: int) -> None:
        """Blocks the host until slot `slot`'s last host-to-device copy ended (it is about to be overwritten)."""
        event = self._events[slot]
        if event is not None:
            event.synchronize()
            self._events[slot] = None

    def _issue(self, dst: torch.Tensor, src: torch.Tensor, slot: int) -> None:
        """Copies slot bytes `src` to `dst`: on the side stream without blocking (CUDA), recording the slot's event;
        synchronously on the CPU."""
        self.stats.copies += 1
        if not self.on_cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[slot] = event

    def _ready(self) -> torch.cuda.Event | None:
        """An event after every copy issued so far (None on the CPU)."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _hand_over(self, group: _Group[T]) -> Iterator[tuple[str, T | torch.Tensor]]:
        """Yields a group's pairs, each made safe to read on the stream current when it is yielded."""
        for name, tensor in group.items:
            if group.ready is not None:
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_event(group.ready)
                for buffer in group.buffers:
                    buffer.record_stream(consumer)
            yield name, tensor


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `tensor`'s bytes (a contiguous copy first if it is not contiguous)."""
    flat = tensor.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    flat = flat.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def engine_device(device: object = None) -> str:
    """`device` normalised ("cpu", "cuda:N"), else the device of the engine whose config scope is current (the
    worker creates its transports and sources inside it), else "cpu". Raises ValueError for a malformed device or
    CUDA where none is visible."""
    from hotswap.config import current_config_or_none
    from hotswap.device import parse_device

    if device is None:
        config = current_config_or_none()
        device = config.model_config.device if config is not None else "cpu"
    return parse_device(str(device))


def staging_for(init_info: dict[str, Any]) -> HostStaging | None:
    """The `HostStaging` a host transport (shm, disk) streams its tensors through: onto init_info["device"], else
    the engine's device; None for the CPU (nothing to stage). init_info["staging_slot_bytes"] sizes its two
    slots (default 64 MiB each). Raises ValueError for a bad device or slot size."""
    device = engine_device(init_info.get("device"))
    if device == "cpu":
        return None
    slot_bytes = init_info.get("staging_slot_bytes", DEFAULT_SLOT_BYTES)
    if not isinstance(slot_bytes, int) or isinstance(slot_bytes, bool):
        raise ValueError(f"staging_slot_bytes must be an integer, got {slot_bytes!r}")
    return HostStaging(device, slot_bytes)


def stage_pairs(
    pairs: Iterable[tuple[str, T]], device: str | torch.device, staging: HostStaging | None = None
) -> Iterable[tuple[str, T | torch.Tensor]]:
    """`pairs` as they are when `device` is the CPU and no `staging` is given; else staged (through `staging`,
    or a new `HostStaging(device)`)."""
    if staging is None:
        if torch.device(device).type == "cpu":
            return pairs
        staging = HostStaging(device)
    return staging.stage(pairs)


def stage_to_device(
    source: WeightSource,
    device: str | torch.device | None = None,
    staging: HostStaging | None = None,
    in_memory: bool = False,
) -> WeightSource:
    """`source` with its host tensors arriving on the device: unchanged when the device (`staging.device`, else
    `device`) is the CPU and no `staging` is given; else the same declaration, flags and `verify`, its tensors
    streamed through `staging` (or a new `HostStaging(device)` per call of `tensors()`, whose pinned slots are
    cached by torch's host allocator). Entries the source marks `skip` pass through unstaged.

    `in_memory` False (the default) turns an in-memory source into a streaming one: `WeightUpdate.apply` collects
    an in-memory source's tensors before writing any (to check every value first), which on the device would
    hold a second copy of the whole update there. Streamed, each value is checked as it arrives and a bad one
    ends the update (rolled back in atomic mode) instead of being refused before the first write. True keeps the
    flag (and the whole update on the device at once)."""
    if staging is None:
        if device is None:
            raise ValueError("stage_to_device needs a device or a HostStaging")
        if torch.device(device).type == "cpu":
            return source
    inner, skip = source.tensors, source.skip
    target = device

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        stager = staging if staging is not None else HostStaging(target if target is not None else "cpu")
        return stager.stage(inner(), skip)

    return WeightSource(
        declared=source.declared,
        tensors=tensors,
        in_memory=source.in_memory and in_memory,
        complete=source.complete,
        pre_sliced=source.pre_sliced,
        skip=source.skip,
        verify=source.verify,
        description=source.description,
    )
