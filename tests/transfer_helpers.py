"""Trainer-side helpers for tests: run a whole update session through each transport."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file

from hotswap import LLM
from hotswap.transfer.shm import ShmSender
from hotswap.transfer.tensors import tensors_update_info
from hotswap.transfer.torch_dist import TorchDistSender

BACKENDS = ["tensors", "shm", "torch_dist", "disk"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pusher:
    """Drives `llm` through init -> start -> update(s) -> finish for one backend, sending from this process
    (a thread for torch_dist). Keeps the sender between pushes so buffers are reused."""

    def __init__(self, llm: LLM, backend: str, bucket_size_bytes: int = 1 << 16) -> None:
        self.llm, self.backend = llm, backend
        self.bucket_size_bytes = bucket_size_bytes
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
                target=lambda: box.setdefault("s", TorchDistSender("127.0.0.1", port, self.bucket_size_bytes, 10))
            )
            thread.start()
            info.update(master_address="127.0.0.1", master_port=port)
            self.llm.init_weight_transfer_engine(info)
            thread.join()
            self.dist = box["s"]
        else:
            self.llm.init_weight_transfer_engine(info)

    def update(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """One update_weights call of an open session; raises what the engine raises."""
        if self.backend == "tensors":
            self.llm.update_weights(tensors_update_info(named))
        elif self.backend == "shm":
            self.llm.update_weights(self.shm.write(named))
        elif self.backend == "disk":
            self.count += 1
            folder = Path(self.tmp.name) / f"u{self.count}"
            folder.mkdir()
            save_file({n: t.contiguous() for n, t in named}, str(folder / "model.safetensors"))
            self.llm.update_weights({"path": str(folder)})
        else:
            info = self.dist.update_info(named)
            errors: list[BaseException] = []

            def send() -> None:
                try:
                    self.dist.send(named)
                except BaseException as err:  # noqa: BLE001 - reported through `errors`
                    errors.append(err)

            thread = threading.Thread(target=send)
            thread.start()
            try:
                self.llm.update_weights(info)
            finally:
                thread.join()

    def push(self, named: list[tuple[str, torch.Tensor]], weight_version: int | None = None) -> None:
        self.llm.start_weight_update()
        self.update(named)
        self.llm.finish_weight_update(weight_version)

    def close(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
        if self.shm is not None:
            self.shm.close()
        if self.dist is not None:
            self.dist.close()
        self.tmp.cleanup()


def shm_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("hotswap_")}
