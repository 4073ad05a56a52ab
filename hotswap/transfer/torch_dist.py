"""torch.distributed transport: the trainer (rank 0) broadcasts packed buckets to the worker (gloo on CPU,
NCCL on CUDA).

Where the buckets land and which collective library moves them are two settings of both sides (init_info on the
worker, constructor arguments on the trainer): `device` ("cpu", "cuda", "cuda:N"; the worker's default is the
engine's own device) and `dist_backend` ("gloo" | "nccl"; default NCCL for a CUDA device, gloo on the CPU). Both
sides must name the same backend. gloo also broadcasts CUDA tensors (through host memory): that is how the device
path runs with a single GPU, where NCCL cannot pair two processes on one device. ("backend" itself names the
transport, "torch_dist", in init_info, so the collective library goes under "dist_backend", SGLang's name too.)

Tensors are packed in declared order into buckets of `bucket_size_bytes` (a larger tensor gets a bucket of its
own); both sides derive the same layout from the declaration. The worker receives into two alternating buffers,
so the next bucket arrives while the current one is copied into the parameters. Collectives time out after the
configured timeout, and a trainer that disconnects surfaces as an error on the worker.

Trainer side (in its own process):

    sender = TorchDistSender("127.0.0.1", port)           # blocks until the engine joins
    # engine: llm.init_weight_transfer_engine({"backend": "torch_dist", "master_address": "127.0.0.1",
    #                                          "master_port": port})
    info = sender.update_info(named_tensors)               # send to the engine: llm.update_weights(info)
    sender.send(named_tensors)                             # while the engine receives
    sender.close()
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch._C._distributed_c10d import BroadcastOptions, Store, TCPStore, Work
from torch.distributed import ProcessGroupGloo

from hotswap.config import WeightTransferConfig
from hotswap.device import parse_device
from hotswap.distributed import current_parallel
from hotswap.transfer.base import TransferEngine, check_interrupt, declare, declared_from_info
from hotswap.weights.host_staging import engine_device
from hotswap.weights.update import Declared, WeightSource

_ALIGN = 64
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


def bucket_layout(declared: Declared, bucket_size: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """[(bucket bytes, [(tensor index, byte offset)])] for the declared tensors, in order."""
    buckets: list[tuple[int, list[tuple[int, int]]]] = []
    current: list[tuple[int, int]] = []
    offset = 0
    for index, (_, dtype, shape) in enumerate(declared):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if current and offset + nbytes > bucket_size:
            buckets.append((offset, current))
            current, offset = [], 0
        current.append((index, offset))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    if current:
        buckets.append((offset, current))
    return buckets


def _tensor_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return buffer[offset : offset + nbytes].view(dtype).view(shape)


DIST_BACKENDS = ("gloo", "nccl")


def resolve_group_settings(device: object, dist_backend: object) -> tuple[str, str]:
    """(device, backend) validated and normalised: `device` "cpu", "cuda" (the current CUDA device) or "cuda:N"
    becomes "cpu" / "cuda:N"; `dist_backend` None picks NCCL for a CUDA device and gloo on the CPU. Raises
    ValueError for a malformed device (or CUDA where none is visible), an unknown backend, NCCL with a CPU device,
    and NCCL where this torch build has none."""
    name = parse_device(device) if isinstance(device, str) else None
    if name is None:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    backend = ("gloo" if name == "cpu" else "nccl") if dist_backend is None else dist_backend
    if not isinstance(backend, str) or backend not in DIST_BACKENDS:
        raise ValueError(f"dist_backend must be one of {list(DIST_BACKENDS)}, got {dist_backend!r}")
    if backend == "nccl" and name == "cpu":
        raise ValueError(
            "dist_backend 'nccl' moves CUDA tensors only, but the device is 'cpu'; name a CUDA device "
            "('cuda' or 'cuda:N') or use dist_backend 'gloo'"
        )
    if backend == "nccl":
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise ValueError(f"dist_backend 'nccl', but this torch build ({torch.__version__}) has no NCCL; use 'gloo'")
    return name, backend


def bind_device(device: str) -> None:
    """Makes `device` ("cuda:N") the calling thread's current CUDA device (NCCL creates its communicator and
    streams on the current device); nothing for the CPU."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def _group(
    address: str, port: int, rank: int, world: int, timeout_s: float, device: str, backend: str = "gloo"
) -> tuple[TCPStore, Any]:
    """(store, process group) of `backend`: the store hosted at (address, port) by rank 0. Every collective of
    the group, and its creation, time out after `timeout_s` (NCCL's through its options' `_timeout`, the same
    field torch.distributed's own group helper sets, so that its watchdog ends a broadcast whose peer is gone)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(address, port, world_size=world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        return store, ProcessGroupNCCL(store, rank, world, options)
    return store, ProcessGroupGloo(store, rank, world, timeout)


class TorchDistSender:
    """Trainer side: rank 0 of a group with the engine's `num_workers` workers (its tensor_parallel_size),
    hosting the rendezvous store at (address, port). `device`: where its buckets are packed ("cpu", "cuda",
    "cuda:N"; a CUDA device becomes this thread's current device); `dist_backend`: "gloo" or "nccl" (None: NCCL
    for a CUDA device, gloo on the CPU), the same as the engine's. Raises ValueError for bad settings."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        bucket_size_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 60.0,
        device: str = "cpu",
        num_workers: int = 1,
        dist_backend: str | None = None,
    ) -> None:
        self.bucket_size_bytes = bucket_size_bytes
        self.device, self.dist_backend = resolve_group_settings(device, dist_backend)
        bind_device(self.device)
        self.store: TCPStore | None  # None once closed
        self.store, self.group = _group(
            master_address, master_port, 0, 1 + num_workers, timeout_s, self.device, self.dist_backend
        )
        self._buffers: list[torch.Tensor] = []

    def update_info(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        pairs = [(name, t.detach()) for name, t in named_tensors]
        return {**declare(pairs), "bucket_size_bytes": self.bucket_size_bytes}

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcasts the tensors bucket by bucket (the engine must be receiving the same update)."""
        pairs = [(name, t.detach()) for name, t in named_tensors]
        declared = declared_from_info(declare(pairs))
        pending = None
        for i, (size, members) in enumerate(bucket_layout(declared, self.bucket_size_bytes)):
            buffer = self._buffer(i % 2, size)  # its previous broadcast (bucket i - 2) was waited on below
            for index, offset in members:
                _, dtype, shape = declared[index]
                _tensor_view(buffer, offset, dtype, shape).copy_(pairs[index][1])
            work = self.group.broadcast([buffer[:size]], _root(0))
            if pending is not None:
                pending.wait()
            pending = work
        if pending is not None:
            pending.wait()

    def _buffer(self, slot: int, size: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[slot].numel() < size:
            self._buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._buffers[slot]

    def close(self) -> None:
        self.group = None
        self.store = None
        self._buffers = []


def _root(rank: int) -> BroadcastOptions:
    opts = BroadcastOptions()
    opts.rootRank = rank
    opts.rootTensor = 0
    return opts


class TorchDistEngine(TransferEngine):
    """Worker side: joins the trainer's group as rank 1 + its tensor-parallel rank (init_info: master_address,
    master_port; the group has 1 + tensor_parallel_size members). Optional init_info: `device` (where buckets
    are received: "cpu", "cuda", "cuda:N"; default the engine's own device, read from its config scope, else the
    CPU), `dist_backend` ("gloo" | "nccl"; default NCCL for a CUDA device, gloo on the CPU; the trainer's must be
    the same), `rank_offset`, `world_size`. The joining thread makes a CUDA device its current one before the
    group is created, and NCCL's collectives time out after `timeout_s` like gloo's.

    Joining happens in a background thread, so that a trainer that is late (or a port where nobody listens)
    holds no engine lock: the engine polls `ready()` between steps, and generation goes on meanwhile. Every wait
    (joining, each bucket) is bounded by `timeout_s`; a bucket wait also ends at once on `interrupt_waits()`."""

    survives_failure = False

    def __init__(self, init_info: dict[str, Any], config: WeightTransferConfig) -> None:
        super().__init__(init_info, config)
        try:
            address, port = str(init_info["master_address"]), int(init_info["master_port"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"a 'torch_dist' init_info needs master_address and master_port: {err}") from None
        if not 0 < port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {port}")
        self.device, self.group_backend = resolve_group_settings(
            init_info["device"] if "device" in init_info else engine_device(), init_info.get("dist_backend")
        )
        offset = init_info.get("rank_offset", 1)  # vLLM's name: the trainer is rank 0, workers follow
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 1:
            raise ValueError(f"rank_offset must be an integer >= 1 (the trainer is rank 0), got {offset!r}")
        self.where = f"{address}:{port}"
        tp = current_parallel()
        self.store: Store | None = None  # set once joined; None again once shut down
        self.group: Any = None  # a process group (torch's stubs give its backends no collectives)
        self._buffers: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._closed = False
        self._works: list[Work] = []  # the broadcasts of the update being received
        self._lock = threading.Lock()
        key = (address, port, offset + tp.rank)
        world = init_info.get("world_size", offset + tp.size)
        if not isinstance(world, int) or world < offset + tp.size:
            raise ValueError(f"world_size must be an integer >= rank_offset + {tp.size} workers, got {world!r}")
        with _joins_lock:
            earlier = _joins.get(key)
            if earlier is not None and earlier.is_alive():
                raise RuntimeError(
                    f"an earlier init_weight_transfer_engine to {self.where} is still joining as rank "
                    f"{offset + tp.rank} (for up to {2 * config.timeout_s:g} s); wait for it to end, or use another "
                    "master_port"
                )
            args = (address, port, offset + tp.rank, world, config.timeout_s, self.device)
            self._joining = threading.Thread(target=self._join, args=args, name="torch_dist-join", daemon=True)
            _joins[key] = self._joining
            self._joining.start()

    def _connect(
        self, address: str, port: int, rank: int, world: int, timeout_s: float, device: str
    ) -> tuple[Store, Any]:
        """Joins the trainer's group over `group_backend`: (store, process group)."""
        return _group(address, port, rank, world, timeout_s, device, self.group_backend)

    def _join(self, address: str, port: int, rank: int, world: int, timeout_s: float, device: str) -> None:
        try:
            bind_device(self.device)  # this thread's: NCCL builds its communicator on the current device
            store, group = self._connect(address, port, rank, world, timeout_s, device)
        except BaseException as err:  # reported by ready()
            self._error = err
            return
        with self._lock:  # against shutdown(): a group joined after it is dropped, never installed
            if not self._closed:
                self.store, self.group = store, group

    def ready(self) -> bool:
        if self._joining.is_alive():
            return False
        if self._error is not None:
            raise RuntimeError(
                f"could not join the trainer's torch_dist group at {self.where} within {self.config.timeout_s:g} s "
                f"(is the trainer's TorchDistSender running there?): {self._error}"
            )
        return True

    def source(self, update_info: dict[str, Any]) -> WeightSource:
        declared = declared_from_info(update_info)
        bucket_size = int(update_info.get("bucket_size_bytes", self.config.bucket_size_bytes))
        layout = bucket_layout(declared, bucket_size)

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            if not layout:
                return
            self._joining.join()
            self.ready()
            works = self._works = [self._post(0, layout[0][0])]
            for i, (_, members) in enumerate(layout):
                _wait(works[i])
                if i + 1 < len(layout):
                    works.append(self._post((i + 1) % 2, layout[i + 1][0]))
                buffer = self._buffers[i % 2]
                for index, offset in members:
                    name, dtype, shape = declared[index]
                    yield name, _tensor_view(buffer, offset, dtype, shape)
            self._works = []

        return WeightSource(declared, tensors, description="torch_dist update")

    def _post(self, slot: int, size: int) -> Work:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[slot].numel() < size:
            self._buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        work: Work = self.group.broadcast([self._buffers[slot][:size]], _root(0))
        return work

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        if any(not work.is_completed() for work in self._works):
            # An interrupted broadcast is still in flight inside the group, writing into these buffers:
            # destroying the group would wait for it (up to its timeout), so both are parked instead.
            _abandoned.append((self.group, self.store, self._buffers))
            del _abandoned[:-4]
        self._works = []
        self.group = None
        self.store = None
        self._buffers = []


_abandoned: list[
    tuple[object, Store | None, list[torch.Tensor]]
] = []  # the last few shut-down groups and their buffers (see TorchDistEngine.shutdown)
# (address, port, rank) -> the thread joining that group: a second join as the same rank while the first still
# runs could pair the trainer with the stale one
_joins: dict[tuple[str, int, int], threading.Thread] = {}
_joins_lock = threading.Lock()


def _wait(work: Work) -> None:
    """Waits for a collective, checking for `interrupt_waits()` meanwhile; its own timeout still applies."""
    pause = 2e-5
    while not work.is_completed():
        check_interrupt()
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    work.wait()
