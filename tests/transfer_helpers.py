"""Trainer-side helpers for tests: run a whole update session through each transport."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import tempfile
import threading
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from hotswap import LLM
from hotswap.testing import free_port
from hotswap.transfer.shm import SEGMENT_PREFIX, ShmSender, segment_creator
from hotswap.transfer.tensors import tensors_update_info
from hotswap.transfer.torch_dist import TorchDistSender

BACKENDS = ["tensors", "shm", "torch_dist", "disk"]


def workers_of(llm) -> int:
    """Workers a group transport's trainer broadcasts to: an engine's tensor_parallel_size, every replica's in a
    fleet."""
    return llm.get_world_size() if hasattr(llm, "get_world_size") else llm.config.parallel_config.tensor_parallel_size


class Pusher:
    """Drives `llm` through init -> start -> update(s) -> finish for one backend, sending from this process
    (a thread for torch_dist). Keeps the sender between pushes so buffers are reused."""

    def __init__(self, llm: LLM, backend: str, bucket_size_bytes: int = 1 << 16, sender_timeout_s: float = 10) -> None:
        self.llm, self.backend = llm, backend
        self.bucket_size_bytes = bucket_size_bytes
        self.sender_timeout_s = sender_timeout_s
        self.shm = ShmSender() if backend == "shm" else None
        self.dist: TorchDistSender | None = None
        self.tmp = tempfile.TemporaryDirectory()
        self.count = 0
        self.connect()

    def connect(self) -> None:
        info: dict = {"backend": self.backend}
        if self.backend == "torch_dist":
            port = free_port()
            box: dict = {}
            thread = threading.Thread(
                target=lambda: box.setdefault(
                    "s",
                    TorchDistSender(
                        "127.0.0.1",
                        port,
                        self.bucket_size_bytes,
                        self.sender_timeout_s,
                        num_workers=workers_of(self.llm),
                    ),
                )
            )
            thread.start()
            info.update(master_address="127.0.0.1", master_port=port, dist_backend="gloo")  # the sender's (CPU)
            self.llm.init_weight_transfer_engine(info)
            thread.join()
            self.dist = box["s"]
        else:
            self.llm.init_weight_transfer_engine(info)

    def update(self, named: list[tuple[str, torch.Tensor]], extra: dict | None = None) -> None:
        """One update_weights call of an open session (`extra`: more update_info fields, e.g. a delta's encoding);
        raises what the engine raises."""
        extra = extra or {}
        if self.backend == "tensors":
            self.llm.update_weights({**tensors_update_info(named), **extra})
        elif self.backend == "shm":
            self.llm.update_weights({**self.shm.write(named), **extra})
        elif self.backend == "disk":
            self.count += 1
            folder = Path(self.tmp.name) / f"u{self.count}"
            folder.mkdir()
            files: list[dict[str, torch.Tensor]] = []
            for n, t in named:  # a repeated name goes to another file, as a malformed checkpoint would have it
                target = next((f for f in files if n not in f), None)
                if target is None:
                    files.append(target := {})
                target[n] = t.contiguous()
            for i, f in enumerate(files):
                save_file(f, str(folder / f"model-{i:05d}.safetensors"))
            self.llm.update_weights({"path": str(folder), **extra})
        else:
            info = {**self.dist.update_info(named), **extra}
            errors: list[BaseException] = []

            def send() -> None:
                try:
                    self.dist.send(named)
                except BaseException as err:
                    errors.append(err)

            thread = threading.Thread(target=send)
            thread.start()
            try:
                self.llm.update_weights(info)
            finally:
                thread.join()
            if errors:  # the engine took the update, so the trainer's side must have succeeded too
                raise errors[0]

    def push(
        self, named: list[tuple[str, torch.Tensor]], weight_version: int | None = None, extra: dict | None = None
    ) -> None:
        self.llm.start_weight_update()
        self.update(named, extra)
        self.llm.finish_weight_update(weight_version)

    def close(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
        if self.shm is not None:
            self.shm.close()
        if self.dist is not None:
            self.dist.close()
        self.tmp.cleanup()


def shm_segments(creators: Collection[int] | None = None) -> set[str]:
    """The hotswap_* segments in /dev/shm; with `creators`, only those one of these processes created (a segment's
    name carries its creator's pid), so that a test sees its own and not those of tests running beside it."""
    names = {f for f in os.listdir("/dev/shm") if f.startswith(SEGMENT_PREFIX)}
    return names if creators is None else {n for n in names if segment_creator(n) in creators}


@contextlib.contextmanager
def children_started() -> Iterator[set[int]]:
    """Yields the set of pids of the multiprocessing children started inside the block (filled as they start)."""
    pids: set[int] = set()
    original = multiprocessing.process.BaseProcess.start

    def start(self: multiprocessing.process.BaseProcess) -> None:
        original(self)
        if self.pid is not None:
            pids.add(self.pid)

    multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]
    try:
        yield pids
    finally:
        multiprocessing.process.BaseProcess.start = original  # type: ignore[method-assign]


# ---- trainer processes (spawned) used by the dead-trainer tests ----------------------------------------------


SHM_TRAINER = """
import json, sys, time
from safetensors.torch import load_file
from hotswap.testing import free_port
from hotswap.transfer.shm import SEGMENT_PREFIX, ShmSender, segment_creator
tensors = list(load_file(sys.argv[1]).items())
sender = ShmSender()
print(json.dumps(sender.write(tensors[:10])), flush=True)
sys.stdin.readline()  # the engine took the first update
info, _ = sender.prepare(tensors[10:])  # never published: the parent kills this process
print(json.dumps(info), flush=True)
time.sleep(600)
"""


def start_shm_trainer(checkpoint_file: str):
    """A trainer as its own program (with its own resource tracker, as in production)."""
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-c", SHM_TRAINER, checkpoint_file], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def torch_dist_trainer_dies_mid_stream(queue, go, port, named, bucket_size, buckets_to_send, num_workers=1) -> None:
    """Declares all of `named` but broadcasts only the first `buckets_to_send` buckets, then exits."""
    from hotswap.transfer.base import declared_from_info
    from hotswap.transfer.torch_dist import bucket_layout

    sender = TorchDistSender("127.0.0.1", port, bucket_size, timeout_s=30, num_workers=num_workers)
    info = sender.update_info(named)
    queue.put(info)
    layout = bucket_layout(declared_from_info(info), bucket_size)
    count = sum(len(members) for _, members in layout[:buckets_to_send])
    go.get()  # the engine is receiving
    sender.send(named[:count])
    os._exit(1)


def sglang_trainer(port: int, world_size: int, group_name: str, checkpoint_file: str, commands, done) -> None:
    """A trainer the way slime / AReaL build theirs for SGLang: `init_custom_process_group` (rendezvous over
    tcp://, a store prefixed with the group name, a gloo group, rank 0), then per command from `commands`
    ("names": one async broadcast per tensor in list order; "bucket": one flattened uint8 buffer; "stop") it sends
    the checkpoint's tensors and reports on `done`."""
    import datetime

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=60)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world,
        rank,
        [],
        "gloo",
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    tensors = list(load_file(checkpoint_file).items())
    while True:
        command = commands.get()
        if command == "stop":
            return
        if command == "names":
            works = [dist.broadcast(t.contiguous(), 0, group=group, async_op=True) for _, t in tensors]
            for work in works:
                work.wait()
        else:
            flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in tensors])
            dist.broadcast(flat, 0, group=group)
        done.put(command)


def torch_dist_trainer(port, named, device, dist_backend, bucket_size, infos, go) -> None:
    """A trainer process: rank 0 of a torch_dist group with one worker, packing on `device` over `dist_backend`.
    Puts its update_info on `infos`, sends `named` (moved to `device`) each time `go` says "send" (then puts
    "sent"), and closes on anything else."""
    sender = TorchDistSender("127.0.0.1", port, bucket_size, timeout_s=60, device=device, dist_backend=dist_backend)
    moved = [(n, t.to(sender.device)) for n, t in named]
    infos.put(sender.update_info(moved))
    while go.get() == "send":
        sender.send(moved)
        infos.put("sent")
    sender.close()
