"""Shared-memory transport for a trainer process on the same host.

The trainer writes every tensor once into a shared segment; the worker maps the same segment and copies straight
from it into the parameters. The segment starts with a 64-byte header: magic, a generation counter (written
last, after the data, to publish an update) and the trainer's pid. The worker waits, up to the configured
timeout, for the generation its update names; it fails early if the trainer process has died, and re-checks the
generation after the data was copied into the model, so a trainer that overwrote the buffer mid-read is caught
and the update rolled back.

Trainer side:

    sender = ShmSender()
    info = sender.write(model.named_parameters())   # or prepare(...) then publish(...) to write later
    llm.update_weights(info)
    sender.close()                                   # unlinks the segment

Segments are reused across updates while they are large enough, and unlinked by `close()` (or by Python's
resource tracker if the trainer dies). A sender prepares its next update only after the engine's
`update_weights` for the previous one has returned: the buffer is rewritten in place.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator
from multiprocessing import shared_memory
from typing import Any

import torch

from hotswap.config import WeightTransferConfig
from hotswap.transfer.base import TransferEngine, check_interrupt, declare, declared_from_info
from hotswap.weights.host_staging import HostStaging, stage_to_device, staging_for
from hotswap.weights.update import WeightSource

_MAGIC = 0x48535750  # "HSWP"
SEGMENT_PREFIX = "hotswap_"  # every ShmSender's segment; an update naming another is refused before any mapping
_HEADER = struct.Struct("<QQQ")  # magic, generation, trainer pid
_HEADER_BYTES = 64
_ALIGN = 64


def segment_name() -> str:
    """A new segment's name: the prefix, the creating process's pid (a segment left in /dev/shm names who made
    it), and a random part."""
    return f"{SEGMENT_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"


def segment_creator(name: str) -> int | None:
    """The pid of the process that created the segment `name` (see `segment_name`), or None for another name."""
    pid, sep, _ = name.removeprefix(SEGMENT_PREFIX).partition("_")
    return int(pid) if name.startswith(SEGMENT_PREFIX) and sep and pid.isdigit() else None


def _layout(shapes_dtypes: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    offsets, offset = [], _HEADER_BYTES
    for shape, dtype in shapes_dtypes:
        offsets.append(offset)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, offset


def _view(buf: memoryview, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `buf` (it keeps `buf` alive). For the engine's read-only mapping the tensor is only read."""
    count = torch.Size(shape).numel()
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    if buf.readonly:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)


class ShmSender:
    """Trainer-side writer. Not thread-safe; one sender per trainer process."""

    def __init__(self) -> None:
        self.segment: shared_memory.SharedMemory | None = None
        self.generation = 0

    def prepare(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
        """Makes room for these tensors and returns (update_info, pairs) without publishing them yet."""
        pairs = [(name, t.detach()) for name, t in named_tensors]
        offsets, size = _layout([(tuple(t.shape), t.dtype) for _, t in pairs])
        if self.segment is None or self.segment.size < size:
            self.close()
            self.segment = shared_memory.SharedMemory(name=segment_name(), create=True, size=size)
        self.generation += 1
        buf = self.segment.buf
        assert buf is not None  # None only once the segment is closed
        _HEADER.pack_into(buf, 0, _MAGIC, 0, os.getpid())  # unpublished while writing
        info = {
            **declare(pairs),
            "shm_name": self.segment.name,
            "offsets": offsets,
            "generation": self.generation,
            "trainer_pid": os.getpid(),
        }
        return info, pairs

    def publish(self, info: dict[str, Any], pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Writes the tensors, then the generation that tells the worker they are complete."""
        assert self.segment is not None
        buf = self.segment.buf
        assert buf is not None  # None only once the segment is closed
        for (_, tensor), offset in zip(pairs, info["offsets"], strict=True):
            _view(buf, offset, tensor.dtype, tuple(tensor.shape)).copy_(tensor)
        _HEADER.pack_into(buf, 0, _MAGIC, info["generation"], os.getpid())

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """prepare + publish: the update_info of a complete update."""
        info, pairs = self.prepare(named_tensors)
        self.publish(info, pairs)
        return info

    def close(self) -> None:
        """Unlinks the segment. Safe to call twice."""
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class _Mapping:
    """A read-only mapping of a trainer's segment: the engine can never write into the trainer's buffer. Unlike
    `SharedMemory(name)`, it does not register the segment with this process's resource tracker: the trainer
    owns it and unlinks it. It is never unmapped explicitly: tensor views keep the buffer alive, and the OS
    mapping goes when the last of them (and this object) is collected, so no view can outlive its memory."""

    def __init__(self, name: str) -> None:
        import _posixshmem

        if not isinstance(name, str) or not name.startswith(SEGMENT_PREFIX) or "/" in name:
            raise ValueError(
                f"shm_name must name a segment of a hotswap ShmSender ('{SEGMENT_PREFIX}...'), got {name!r}"
            )
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
        except FileNotFoundError:
            raise ValueError(f"shared memory segment {name!r} does not exist (trainer gone?)") from None
        try:
            self.size = os.fstat(fd).st_size
            header = os.pread(fd, _HEADER.size, 0)  # checked before anything is mapped
            if len(header) < _HEADER.size or _HEADER.unpack(header)[0] != _MAGIC:
                raise ValueError(f"shared memory segment {name!r} is not a hotswap weight buffer")
            self.map = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self.map)


class ShmEngine(TransferEngine):
    """Worker side (init_info: {"backend": "shm"}, optionally "device" and "staging_slot_bytes"). On an engine
    whose model is on a CUDA device (or init_info "device" naming one), the segment's tensors are streamed to the
    device through two pinned host slots (hotswap/weights/host_staging.py, `staging_for`); "device": "cpu"
    turns that off."""

    def __init__(self, init_info: dict[str, Any], config: WeightTransferConfig) -> None:
        super().__init__(init_info, config)
        self.segments: dict[str, _Mapping] = {}
        self.staging: HostStaging | None = staging_for(init_info)

    def _attach(self, name: str, offsets: list[int], expected: list[int], size: int) -> _Mapping:
        """The mapping of `name`, kept for later updates only once the declared layout fits it (a refused
        segment is unmapped as soon as this returns)."""
        segment = self.segments.get(name) or _Mapping(name)
        if list(offsets) != expected or size > segment.size:
            raise ValueError("shm update layout does not match its declaration or exceeds the segment")
        if name not in self.segments:
            self.shutdown()
            self.segments = {name: segment}
        return segment

    def _wait_published(self, segment: _Mapping, generation: int, pid: int) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            magic, current, _ = _HEADER.unpack_from(segment.buf, 0)
            if magic != _MAGIC:
                raise ValueError(f"shared memory segment {segment.name!r} is not a hotswap weight buffer")
            if current == generation:
                return
            if not _process_alive(pid):
                self._forget(segment)  # nothing more will come through it: not held until the transport closes
                raise RuntimeError(f"trainer process {pid} exited before publishing update generation {generation}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"timed out after {self.config.timeout_s:.0f} s waiting for the trainer to publish generation "
                    f"{generation} in {segment.name!r}"
                )
            check_interrupt()
            time.sleep(0.001)

    def source(self, update_info: dict[str, Any]) -> WeightSource:
        """The published update as an in-memory source over views of the segment (staged: a stream of device
        tensors, see `stage_to_device`). Its `verify`, run after the data was copied into the model, rejects an
        update the trainer overwrote meanwhile (the copy is then rolled back)."""
        declared = declared_from_info(update_info)
        try:
            name, offsets = update_info["shm_name"], update_info["offsets"]
            generation, pid = int(update_info["generation"]), int(update_info["trainer_pid"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"an 'shm' update needs shm_name, offsets, generation and trainer_pid: {err}") from None
        if len(offsets) != len(declared):
            raise ValueError(f"update declares {len(declared)} tensors but {len(offsets)} offsets")
        expected_offsets, size = _layout([(shape, dtype) for _, dtype, shape in declared])
        segment = self._attach(name, offsets, expected_offsets, size)

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            self._wait_published(segment, generation, pid)
            for (tensor_name, dtype, shape), offset in zip(declared, offsets, strict=True):
                yield tensor_name, _view(segment.buf, offset, dtype, shape)

        def verify() -> None:
            _, current, _ = _HEADER.unpack_from(segment.buf, 0)
            if current != generation:
                raise RuntimeError("the trainer overwrote the shared buffer while the worker was reading it")

        source = WeightSource(declared, tensors, in_memory=True, verify=verify, description="shm update")
        return source if self.staging is None else stage_to_device(source, staging=self.staging)

    def _forget(self, segment: _Mapping) -> None:
        """Drops a segment whose trainer is gone and unmaps it now, unless a tensor view of it remains (then it
        goes with the last view)."""
        self.segments.pop(segment.name, None)
        try:
            segment.buf.release()
            segment.map.close()
        except BufferError:
            pass

    def shutdown(self) -> None:
        """Drops the mappings; each is unmapped once no tensor view of it remains (see `_Mapping`)."""
        self.segments = {}
