"""Adapter updates, engine side: a LoRA target ("lora:<name>") of `reload_weights` and of the transfer session.

The new version is loaded into a copy on every worker while requests go on (the adapter's current version, the
base model and other adapters are untouched, so nothing pauses); it becomes current only once every worker
holds it. Any failure, or an abort, drops the copy everywhere: the served adapter never changes.
"""

from __future__ import annotations

from typing import Any

from hotswap.engine.lora_registry import Adapter, LoRARegistry, Prepared
from hotswap.executor.base import Executor
from hotswap.weights.delta import check_encoding

PREFIX = "lora:"


def lora_target(target: object) -> str | None:
    """The adapter name of a "lora:<name>" target; None for any other target."""
    if isinstance(target, str) and target.startswith(PREFIX):
        name = target[len(PREFIX) :]
        if not name:
            raise ValueError("a LoRA target names its adapter: 'lora:<lora_name>'")
        return name
    return None


class LoRAUpdates:
    def __init__(self, registry: LoRARegistry, executor: Executor, tp_size: int) -> None:
        self.registry = registry
        self.executor = executor
        self.tp_size = tp_size
        self.open: tuple[Adapter, int] | None = None  # the open session's adapter and its new version's uid
        self.prepared = False  # the open session's workers hold the new version, awaiting commit()

    def reload(
        self,
        name: str,
        weights_path: str | None,
        weights_iterator: Any,
        encoding: str | None,
        base_version: Any,
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
        weights_iterator: Any,
        encoding: str | None,
        base_version: Any,
        checksums: dict[str, str] | None,
        sliced: bool = False,
    ) -> Prepared:
        """Phase one of `reload` (a fleet's): the next version is on every worker, served once the registry
        commits it (`commit_prepared`), or dropped (`abort_prepared`). `sliced` (tensors only): the workers only
        open the load; `advance_weight_update` receives it and `finish_sliced` commits it."""
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
        kwargs = {
            "weights_iterator": list(weights_iterator),
            "encoding": encoding,
            "checksums": checksums,
            **({"commit": False, "sliced": True} if sliced else {}),
        }
        try:
            self.executor.collective_rpc("reload_lora", (adapter.current.uid, uid), kwargs)
        except BaseException:
            self.registry.discard(uid)
            raise
        # its weights are no longer the folder's
        return Prepared(name, uid, adapter.spec, adapter.int_id, None, adapter.pinned)

    def finish_sliced(self, prepared: Prepared) -> None:
        """After a sliced `prepare_reload` was received: every worker registers the new version, which becomes
        current. A failure drops it everywhere."""
        try:
            self.executor.collective_rpc("finish_weight_update")
        except BaseException:
            self.registry.discard(prepared.uid)
            raise
        self.registry.commit_prepared(prepared)

    def start(self, name: str) -> None:
        """Opens a session whose updates load the next version of adapter `name`."""
        if self.open is not None:
            raise RuntimeError(f"a LoRA update of {self.open[0].name!r} is open; finish or abort it first")
        adapter, uid = self.registry.begin_update(name)
        try:
            self.executor.collective_rpc("start_lora_update", (adapter.current.uid, uid))
        except BaseException:
            self._abort_everywhere(uid)
            raise
        self.open = (adapter, uid)
        self.registry.updating.add(name)

    def update(self, update_info: dict[str, Any]) -> None:
        adapter, uid = self._session()
        try:
            if isinstance(update_info, dict):
                self.registry.check_base(adapter, update_info.get("base_version"))
            self.executor.collective_rpc("update_weights", (update_info,))
        except BaseException as err:
            self.open = None
            self._abort_everywhere(uid)
            if isinstance(err, ValueError) and "rolled back" not in str(err):
                raise ValueError(f"{err} (the LoRA update was dropped; {adapter.name!r} is unchanged)") from None
            raise

    def finish(self) -> None:
        """Commits the session's version on every worker (two phases with several), then makes it current."""
        if self.tp_size > 1 or self.prepared:
            self.prepare()
        self.commit()

    def prepare(self) -> None:
        """Phase one of finishing: every worker holds the new version, nothing served changed; a failure drops
        it everywhere and ends the session."""
        _, uid = self._session()
        if self.prepared:
            return
        try:
            self.executor.collective_rpc("finish_weight_update", (), {"commit": False})
        except BaseException:
            self.open = None
            self._abort_everywhere(uid)
            raise
        self.prepared = True

    def commit(self) -> None:
        """Phase two (or the one call on one worker): the new version is current."""
        adapter, uid = self._session()
        self.open, self.prepared = None, False
        try:
            self.executor.collective_rpc("finish_weight_update")
        except BaseException:
            self._abort_everywhere(uid)
            raise
        self._commit(adapter, uid)

    def abort(self) -> None:
        if self.open is None:
            return
        _, uid = self.open
        self.open, self.prepared = None, False
        self._abort_everywhere(uid)

    def _session(self) -> tuple[Adapter, int]:
        if self.open is None:
            raise RuntimeError("no LoRA update session is open; call start_weight_update(target='lora:<name>')")
        return self.open

    def _abort_everywhere(self, uid: int) -> None:
        self.registry.updating.clear()  # one session at a time
        try:
            self.executor.collective_rpc("abort_weight_update")
        finally:
            self.registry.discard(uid)

    def _commit(self, adapter: Adapter, uid: int) -> None:
        self.registry.updating.clear()
        superseded = self.registry.commit(adapter, uid)
        if superseded and self.registry.on_superseded is not None:
            self.registry.on_superseded(adapter, superseded)
