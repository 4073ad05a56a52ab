"""Adapter updates, engine side: the LoRA `ChangeTarget` ("lora:<name>") of `reload_weights` and of the transfer
session, and the reloads a fleet prepares on every replica.

The new version is loaded into a copy on every worker while requests go on (the adapter's current version, the
base model and other adapters are untouched, so nothing pauses); it becomes current only once every worker
holds it. Any failure, or an abort, drops the copy everywhere: the served adapter never changes. One change of
an adapter at a time: the registry refuses a second while one is open or prepared (`LoRARegistry.begin_update`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hotswap.engine.change import ChangeHost, ChangeTarget
from hotswap.engine.lora_registry import Adapter, LoRARegistry, Prepared
from hotswap.executor.base import Executor
from hotswap.weights.delta import check_encoding
from hotswap.weights.version import VersionArg
from hotswap.worker.commands import Abort, AdapterPart, Load, Pairs, Receive

PREFIX = "lora:"


def lora_target(target: object) -> str | None:
    """The adapter name of a "lora:<name>" target; None for any other target."""
    if isinstance(target, str) and target.startswith(PREFIX):
        name = target[len(PREFIX) :]
        if not name:
            raise ValueError("a LoRA target names its adapter: 'lora:<lora_name>'")
        return name
    return None


class AdapterTarget(ChangeTarget):
    """The next version of adapter `adapter_name`: a transfer session's (`start`), or a reload's (`load`: held
    on every worker, registered there already unless received in slices)."""

    pauses = False  # an adapter's next version is written beside the served one: nothing pauses
    packs_first = True
    strict_two_phase = False

    def __init__(self, registry: LoRARegistry, executor: Executor, adapter_name: str) -> None:
        self.registry = registry
        self.executor = executor
        self.adapter_name = adapter_name
        self.name = f"{PREFIX}{adapter_name}"
        self.prepared: Prepared | None = None  # a reload's next version
        self.open: tuple[Adapter, int] | None = None  # a session's: the adapter, its next version's uid
        self.on_workers = True  # the workers hold the change open (a session, a sliced reload): they commit it

    def part(self) -> AdapterPart:
        adapter, uid = self._open()
        return AdapterPart(adapter.current.uid, uid)

    def start(self, host: ChangeHost) -> None:
        adapter, uid = self.registry.begin_update(self.adapter_name)
        self.open = (adapter, uid)
        try:
            super().start(host)
        except BaseException:
            self.abort(host)
            raise

    def check_base(self, served: Callable[[VersionArg], None], base_version: VersionArg) -> None:
        self.registry.check_base(self.registry.get(self.adapter_name), base_version)

    def check_commit(self, weight_version: VersionArg, canary: object) -> None:
        if weight_version is not None or canary is not None:
            raise ValueError("weight_version and canary apply to the model; a LoRA update takes neither")

    def receive(self, host: ChangeHost, update_info: dict[str, Any], sliced: bool) -> None:
        adapter, _ = self._open()
        try:
            if isinstance(update_info, dict):
                self.registry.check_base(adapter, update_info.get("base_version"))
            host.executor.send(Receive(update_info))
        except BaseException as err:
            self.abort(host)
            if isinstance(err, ValueError) and "rolled back" not in str(err):
                raise ValueError(f"{err} (the LoRA update was dropped; {adapter.name!r} is unchanged)") from None
            raise

    def load(
        self,
        host: ChangeHost,
        weights_path: str | None,
        weights_iterator: Pairs | None,
        encoding: str | None,
        checksums: dict[str, str] | None,
        sliced: bool = False,
    ) -> None:
        """The next version on every worker: registered there at once (the commit only makes it current), or
        (`sliced`, from tensors) opened for `Advance` (the commit registers it)."""
        self.prepared = LoRAUpdates(self.registry, self.executor, 1).prepare_reload(
            self.adapter_name, weights_path, weights_iterator, encoding, None, checksums, sliced=sliced
        )
        self.on_workers = sliced

    def reload(
        self,
        host: ChangeHost,
        weights_path: str | None,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None,
        encoding: str | None,
        base_version: VersionArg,
        checksums: dict[str, str] | None,
        sliced: bool,
    ) -> bool:
        """`reload_weights` of the adapter: in one call (False), or (`sliced`, from tensors) only opened on every
        worker (True): the controller receives it between steps, then commits it."""
        if sliced and weights_iterator is not None:
            self.check_base(lambda _: None, base_version)
            self.load(host, None, list(weights_iterator), encoding, checksums, sliced=True)
            return True
        LoRAUpdates(self.registry, self.executor, 1).reload(
            self.adapter_name, weights_path, weights_iterator, encoding, base_version, checksums
        )
        return False

    def commit(self, host: ChangeHost) -> None:
        """The new version becomes current (the registry's "switch" policy moves requests still on the old one),
        registered first by every worker that holds it open. A failure drops it everywhere."""
        if self.on_workers:
            try:
                super().commit(host)
            except BaseException:
                self.abort(host)
                raise
        if self.prepared is not None:
            self.registry.commit_prepared(self.prepared)
            return
        adapter, uid = self._open()
        superseded = self.registry.commit(adapter, uid)
        if superseded and self.registry.on_superseded is not None:
            self.registry.on_superseded(adapter, superseded)

    def abort(self, host: ChangeHost) -> bool:
        try:
            if self.on_workers:
                host.executor.send(Abort())
        finally:
            self.dropped()
        return True

    def drop(self, host: ChangeHost) -> bool:
        return self.abort(host)

    def dropped(self) -> None:
        uid = self.prepared.uid if self.prepared is not None else self.open[1] if self.open is not None else None
        if uid is not None:
            self.registry.discard(uid)

    def _open(self) -> tuple[Adapter, int]:
        if self.open is not None:
            return self.open
        if self.prepared is not None:
            return self.registry.get(self.adapter_name), self.prepared.uid
        raise RuntimeError("no LoRA update session is open; call start_weight_update(target='lora:<name>')")


class LoRAUpdates:
    """The engine's adapter changes: targets for the controller, and reloads prepared on every worker."""

    def __init__(self, registry: LoRARegistry, executor: Executor, tp_size: int) -> None:
        self.registry = registry
        self.executor = executor
        self.tp_size = tp_size

    def target(self, name: str) -> AdapterTarget:
        """The change target of adapter `name`'s next version."""
        self.registry.get(name)  # raises for an adapter that is not loaded
        return AdapterTarget(self.registry, self.executor, name)

    def reload(
        self,
        name: str,
        weights_path: str | None,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None,
        encoding: str | None,
        base_version: VersionArg,
        checksums: dict[str, str] | None,
    ) -> None:
        """The next version of adapter `name`: a PEFT folder's (read once, here), or the current one updated by
        (name, tensor) pairs (PEFT names; a delta with `encoding`, refused unless `base_version` is the
        adapter's current version; `checksums` verified before the commit)."""
        self.registry.commit_prepared(
            self.prepare_reload(name, weights_path, weights_iterator, encoding, base_version, checksums)
        )

    def prepare_reload(
        self,
        name: str,
        weights_path: str | None,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None,
        encoding: str | None,
        base_version: VersionArg,
        checksums: dict[str, str] | None,
        sliced: bool = False,
    ) -> Prepared:
        """Phase one of `reload` (a fleet's): the next version is on every worker, served once the registry
        commits it (`commit_prepared`), or dropped (`abort_prepared`). `sliced` (tensors only): the workers only
        open the load; the controller receives it between steps, then commits it."""
        adapter = self.registry.get(name)
        if weights_path is not None and weights_iterator is not None:
            raise ValueError("give weights_path or weights_iterator, not both")
        self.registry.check_base(adapter, base_version)
        if weights_path is not None:
            if encoding is not None:
                raise ValueError("a LoRA folder holds the adapter whole; send a delta as tensors")
            return self.registry.prepare(name, str(weights_path), load_inplace=True)
        if weights_iterator is None:
            raise ValueError("a LoRA reload needs weights_path (a PEFT folder) or weights_iterator")
        check_encoding(encoding)
        _, uid = self.registry.begin_update(name)
        load = Load(
            AdapterPart(adapter.current.uid, uid),
            weights_iterator=list(weights_iterator),
            encoding=encoding,
            checksums=checksums,
            commit=not sliced,
            sliced=sliced,
        )
        try:
            self.executor.send(load)
        except BaseException:
            self.registry.discard(uid)
            raise
        # its weights are no longer the folder's
        return Prepared(name, uid, adapter.spec, adapter.int_id, None, adapter.pinned)
