"""The receiving side of a transport, and the metadata every update declares before data moves.

An update declares `names`, `dtypes` (strings such as "float32") and `shapes`; a transport turns its update_info
into a `WeightSource` (hotswap/weights/update.py), whose declaration the worker checks against the model before
it reads a byte of data.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any

import torch

from hotswap.config import WeightTransferConfig
from hotswap.weights.update import Declared, WeightSource

BACKENDS = {
    "tensors": "hotswap.transfer.tensors:TensorsEngine",
    "shm": "hotswap.transfer.shm:ShmEngine",
    "torch_dist": "hotswap.transfer.torch_dist:TorchDistEngine",
    "disk": "hotswap.transfer.disk:DiskEngine",
    "sglang_dist": "hotswap.transfer.sglang_dist:SglangDistEngine",
    "cuda_ipc": "hotswap.transfer.cuda_ipc:CudaIpcEngine",
    "ipc": "hotswap.transfer.cuda_ipc:CudaIpcEngine",  # vLLM's name for the same transport
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: object) -> torch.dtype:
    """torch dtype from its name ("float32", "torch.bfloat16"). Raises ValueError for anything else."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def declared_from_info(update_info: dict[str, Any]) -> Declared:
    """Reads `names`, `dtypes` (or vLLM's `dtype_names`), `shapes` (equal lengths) from an update. Raises
    ValueError if malformed."""
    try:
        dtypes = update_info["dtypes"] if "dtypes" in update_info else update_info["dtype_names"]
        names, shapes = update_info["names"], update_info["shapes"]
    except (KeyError, TypeError) as err:
        raise ValueError(f"update_info must declare 'names', 'dtypes' and 'shapes'; missing {err}") from None
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"update_info declares {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes; "
            "they must have equal lengths"
        )
    return [(str(n), parse_dtype(d), tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]


def declare(named_tensors: list[tuple[str, torch.Tensor]]) -> dict[str, list[Any]]:
    """The `names` / `dtypes` / `shapes` part of an update for these tensors (trainer side)."""
    return {
        "names": [n for n, _ in named_tensors],
        "dtypes": [dtype_name(t.dtype) for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
    }


class TransferEngine(ABC):
    """Receives weights for one worker. Created by `init_weight_transfer_engine(init_info)`.

    `survives_failure`: the channel stays usable after a failed update; if not (a collective stream that may be
    out of step), the worker shuts the engine down and a new `init_weight_transfer_engine` is needed."""

    survives_failure = True

    def __init__(self, init_info: dict[str, Any], config: WeightTransferConfig) -> None:
        self.init_info = init_info
        self.config = config

    @abstractmethod
    def source(self, update_info: dict[str, Any]) -> WeightSource:
        """The update as a source: its declaration (read without touching data) and its tensors in declared order.
        Raises ValueError for a malformed update_info; its stream raises on a lost or late trainer."""

    def ready(self) -> bool:
        """Whether the channel is connected. A transport that joins its trainer in the background (torch_dist)
        answers False until then; raises the connection's error (the channel is then unusable)."""
        return True

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Releases connections and buffers."""


# Interrupts are counted, not flagged: a signal handler may run `interrupt_waits` between any two bytecodes of
# this process's main thread, so nothing here takes a lock (a lock held by the interrupted code would deadlock).
_interrupts = [0, 0]  # [interrupts requested, count when the current update began]


def interrupt_waits() -> None:
    """Makes every transport wait in this process (a trainer that has not published yet) give up at once, with
    an error that ends its update (rolled back). Safe from any thread and from a signal handler. An interrupt
    that lands while a session is open but before its update began receiving ends that update as soon as it
    waits (an abort racing an update_weights call is not lost)."""
    _interrupts[0] += 1


def clear_interrupt() -> None:
    """Called as a session opens: an interrupt meant for an earlier session does not end this one's waits."""
    _interrupts[1] = _interrupts[0]


def check_interrupt() -> None:
    """Raises RuntimeError if `interrupt_waits()` was called since the session opened; transports call it while
    they wait."""
    if _interrupts[0] != _interrupts[1]:
        raise RuntimeError("the update was aborted while waiting for the trainer")


def create_engine(init_info: dict[str, Any], config: WeightTransferConfig) -> TransferEngine:
    """The engine named by `init_info["backend"]` (torch_dist for an init_info without one that names a
    master_address, as vLLM's clients send it). Raises ValueError listing the backends for another name."""
    if not isinstance(init_info, dict):
        raise ValueError(f"init_info must be a dict with a 'backend' key, got {type(init_info).__name__}")
    backend = init_info.get("backend")
    if backend is None and "master_address" in init_info:  # vLLM's clients name no backend: a trainer's group
        backend = "torch_dist"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown weight transfer backend {backend!r}; expected one of {sorted(BACKENDS)}")
    module_name, class_name = BACKENDS[backend].split(":")
    engine: type[TransferEngine] = getattr(importlib.import_module(module_name), class_name)
    return engine(init_info, config)
