"""The engine's weight-change calls to a worker, as data: each is one frozen dataclass, sent through
`Executor.send` and dispatched in one place (`Worker.apply`), as a message is. A change names what it writes with
a `Part`: the served model, the speculative draft or both (`ModelPart`), or the next version of a LoRA adapter
(`AdapterPart`); the worker keeps the open change's part in its `WeightSession`, so later commands of that change
(`Receive`, `Commit`, `Abort`) need not repeat it.

    InitTransport -> TransportReady* -> StartUpdate -> Receive* [-> Advance*] -> Commit(prepare_only=True)? ->
        Commit() | Abort()
    Load(commit=False) [-> Advance*] -> Commit(prepare_only=True)? -> Commit() | Abort()     (a two-phase reload)
    Load(commit=True)                                                                      (one worker, one call)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hotswap.weights.target import WeightTarget


@dataclass(frozen=True)
class ModelPart:
    """The served model ("model"), the speculative draft ("draft"), or both ("all": committed or rolled back
    together)."""

    name: WeightTarget = "model"


@dataclass(frozen=True)
class AdapterPart:
    """Version `new` of a LoRA adapter, a copy of version `old` written by the change (nothing serves it before
    the commit)."""

    old: int
    new: int


Part = ModelPart | AdapterPart
Pairs = list[tuple[str, torch.Tensor]]  # (checkpoint name, tensor) pairs, read once
MODEL = ModelPart()  # the served model alone


@dataclass(frozen=True)
class InitTransport:
    """Creates the receiving side of a transport (`init_info["backend"]`), without waiting for its trainer."""

    init_info: dict[str, Any]


@dataclass(frozen=True)
class TransportReady:
    """Whether the transport connected; a failed one is dropped and its error raised."""


@dataclass(frozen=True)
class ShutdownTransport:
    """Ends an open change (rolled back), then releases the transport and the rollback buffers."""


@dataclass(frozen=True)
class StartUpdate:
    """Opens a transfer session writing `part`."""

    part: Part


@dataclass(frozen=True)
class Receive:
    """One update of the open session (its declaration, as the transport reads it). `sliced` (a staged session):
    only opened; `Advance` receives it."""

    update_info: dict[str, Any]
    sliced: bool = False


@dataclass(frozen=True)
class Load:
    """A reload of `part` from a checkpoint folder or (name, tensor) pairs (neither: the current folder of a
    model part); `encoding` / `checksums`: a delta and the trainer's digests of its results. `commit` False keeps
    the change open for `Commit` or `Abort` (the first phase); `sliced` (with `commit` False) only opens it for
    `Advance`."""

    part: Part
    weights_path: str | None = None
    weights_iterator: Pairs | None = None
    encoding: str | None = None
    checksums: dict[str, str] | None = None
    commit: bool = True
    sliced: bool = False


@dataclass(frozen=True)
class Advance:
    """Receives the sliced change for about `budget_s` seconds (None: to its end)."""

    budget_s: float | None = None


@dataclass(frozen=True)
class ViewStaged:
    """Serves the open staged change's weights (`on`, a canary's probes) or the committed ones again."""

    on: bool


@dataclass(frozen=True)
class Commit:
    """Ends the open change: committed, or with `prepare_only` post-processed with its rollback copies kept (the
    first phase of a change every worker makes together)."""

    prepare_only: bool = False


@dataclass(frozen=True)
class Abort:
    """Ends the open change, rolled back (a no-op without one)."""


@dataclass(frozen=True)
class AddAdapter:
    """Loads adapter version `uid` of `spec` (LoRASpec.as_dict) whole from its tensors by PEFT name (a new adapter,
    or a version of other shapes); nothing is loaded where a tensor is refused."""

    uid: int
    spec: dict[str, Any]
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class RemoveAdapter:
    """Forgets adapter version `uid` (False where it was not loaded)."""

    uid: int


@dataclass(frozen=True)
class RecordFolder:
    """Records `folder` as the checkpoint of the model or ("draft") the draft, once every rank committed it."""

    folder: str
    target: WeightTarget = "model"


@dataclass(frozen=True)
class ReadState:
    """Whether this rank's weights are valid, and what the last committed change wrote."""


Command = (
    InitTransport
    | TransportReady
    | ShutdownTransport
    | StartUpdate
    | Receive
    | Load
    | Advance
    | ViewStaged
    | Commit
    | Abort
    | AddAdapter
    | RemoveAdapter
    | RecordFolder
    | ReadState
)
