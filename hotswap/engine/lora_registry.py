"""The engine's adapters: names, integer ids, versions, and the requests using each version.

Every committed change of an adapter makes a new version with a fresh uid (never reused, so it also keys the
prefix cache: KV computed under one adapter version is never served to another). A version stays on the workers
while it is current or while a request uses it (policy "finish_on_old"); with "switch", requests move to the new
version at the commit. `max_cpu_loras` bounds the versions held at once, `max_loras` (the scheduler's) the
versions one step may use.

    load (folder, tensors) ----------------> version 1 (current)
    update (reload, session, load_inplace) -> version v+1 (current); v held until its last request ends
    unload -------------------------------> the name is gone; its versions go once no request uses them
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hotswap.config import LoRAConfig
from hotswap.executor.base import Executor
from hotswap.lora.peft_format import LoRASpec, canonical_name, read_folder, spec_of
from hotswap.lora.request import LoRARequest
from hotswap.worker.commands import AdapterPart, AddAdapter, Load, RemoveAdapter


@dataclass
class AdapterVersion:
    uid: int  # unique over the engine's life
    version: int  # 1, 2, ... per adapter name
    users: int = 0  # requests running on it


@dataclass(frozen=True)
class Prepared:
    """A version loaded on every worker but not yet served (see `LoRARegistry.prepare`)."""

    name: str
    uid: int
    spec: LoRASpec
    int_id: int
    path: str | None
    pinned: bool


@dataclass
class Adapter:
    name: str
    int_id: int
    spec: LoRASpec
    current: AdapterVersion
    path: str | None = None
    pinned: bool = False
    old: dict[int, AdapterVersion] = field(default_factory=dict)  # superseded versions still in use


class LoRARegistry:
    def __init__(self, config: LoRAConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.adapters: dict[str, Adapter] = {}
        self.retired: dict[int, AdapterVersion] = {}  # versions of unloaded adapters still in use
        self._uids = itertools.count(1)
        self.pending: set[int] = set()  # versions on the workers that no adapter serves yet (loads, updates)
        # adapters with a next version being loaded, prepared or received (one change of an adapter at a time;
        # they cannot be unloaded meanwhile): name -> that version's uid
        self.updating: dict[str, int] = {}
        self.prepared_loads: dict[
            str, Prepared
        ] = {}  # loads prepared by `hold`, awaiting `commit_held` or `abort_held`
        # called when a commit supersedes a version that requests still use (the engine's "switch" policy)
        self.on_superseded: Callable[[Adapter, list[AdapterVersion]], None] | None = None

    # ---- queries ----------------------------------------------------------------------------------------------

    def held(self) -> int:
        """Adapter versions on the workers."""
        return sum(1 + len(a.old) for a in self.adapters.values()) + len(self.retired) + len(self.pending)

    def get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded; loaded: {sorted(self.adapters)}")
        return adapter

    def resolve(self, request: LoRARequest) -> Adapter:
        """The adapter `request` names, loaded from its `lora_path` on first use. A loaded adapter is never read
        from disk again, whatever the request says (its `load_inplace` included: vLLM's re-read of the folder on
        every generation, vllm PR 41482); new weights arrive through `load(..., load_inplace=True)` or a weight
        update with target "lora:<name>". Raises ValueError for an id that another name holds, or for a load that
        fails."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        adapter = self.adapters.get(request.lora_name)
        if adapter is not None and adapter.int_id != request.lora_int_id:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} has lora_int_id {adapter.int_id}, not {request.lora_int_id}"
            )
        for other in self.adapters.values():
            if other.int_id == request.lora_int_id and other.name != request.lora_name:
                raise ValueError(f"lora_int_id {request.lora_int_id} belongs to adapter {other.name!r}")
        if adapter is not None:
            return adapter
        if not request.lora_path:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is not loaded and the request gives no lora_path")
        return self.load(request.lora_name, request.lora_path, int_id=request.lora_int_id)

    # ---- loading and unloading --------------------------------------------------------------------------------

    def load(
        self,
        name: str,
        path: str | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
        peft_config: dict[str, Any] | None = None,
        int_id: int | None = None,
        load_inplace: bool = False,
        pinned: bool = False,
    ) -> Adapter:
        """Loads adapter `name` from a PEFT folder `path`, or from `tensors` (PEFT names) with `peft_config`
        (adapter_config.json's fields). A name already loaded is refused unless `load_inplace`, which makes the
        new weights its next version (the same shapes: validated and atomic; another rank or target modules: a
        new adapter under the same name). Raises ValueError naming the problem; nothing changes then."""
        return self.commit_prepared(self.prepare(name, path, tensors, peft_config, int_id, load_inplace, pinned))

    def prepare(
        self,
        name: str,
        path: str | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
        peft_config: dict[str, Any] | None = None,
        int_id: int | None = None,
        load_inplace: bool = False,
        pinned: bool = False,
    ) -> Prepared:
        """Phase one of `load`: the new version is loaded on every worker under a fresh uid, but nothing served
        changes until `commit_prepared` (or `abort_prepared` drops it): how a fleet loads an adapter on every
        replica or on none. Raises RuntimeError while another change of the adapter is open or prepared (one at a
        time), ValueError for a bad name, id or adapter."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
        self._check_idle(name)
        if (path is None) == (tensors is None):
            raise ValueError("give a LoRA adapter's lora_path or its tensors (with its config)")
        if path is not None:
            peft_config, tensors = read_folder(str(path))
        assert tensors is not None
        tensors = {canonical_name(n): t for n, t in tensors.items()}
        spec = spec_of(peft_config or {}, tensors, self.config.max_lora_rank)
        existing = self.adapters.get(name)
        if existing is not None and not load_inplace:
            raise ValueError(
                f"LoRA adapter {name!r} is already loaded; unload it first, or load it with "
                "load_inplace=true to replace its weights"
            )
        folder = None if path is None else str(path)
        if existing is not None:
            _, uid = self.begin_update(name)
            if spec == existing.spec:  # the same shapes: the current version updated, validated like any update
                load = Load(AdapterPart(existing.current.uid, uid), weights_iterator=list(tensors.items()))
                try:
                    self.executor.send(load)
                except BaseException:
                    self.discard(uid)
                    raise
            else:  # another rank or other modules: loaded whole
                self._all_or_none(AddAdapter(uid, spec.as_dict(), tensors))
            return Prepared(name, uid, spec, existing.int_id, folder, pinned)
        if int_id is None:
            int_id = max((a.int_id for a in self.adapters.values()), default=0) + 1
        elif any(a.int_id == int_id for a in self.adapters.values()):
            raise ValueError(f"lora_int_id {int_id} is already used by another adapter")
        self._check_room()
        uid = next(self._uids)
        self.pending.add(uid)
        self._all_or_none(AddAdapter(uid, spec.as_dict(), tensors))
        return Prepared(name, uid, spec, int_id, folder, pinned)

    def commit_prepared(self, prepared: Prepared) -> Adapter:
        """Phase two: the prepared version is what `prepared.name` serves from now on."""
        existing = self.adapters.get(prepared.name)
        self._settled(prepared.uid)
        if existing is None:
            adapter = Adapter(
                prepared.name,
                prepared.int_id,
                prepared.spec,
                AdapterVersion(prepared.uid, 1),
                prepared.path,
                prepared.pinned,
            )
            self.adapters[prepared.name] = adapter
            return adapter
        before = existing.current
        self.commit(existing, prepared.uid, prepared.spec)
        existing.path = prepared.path
        if before.users and self.on_superseded is not None:
            self.on_superseded(existing, [before])
        return existing

    def abort_prepared(self, prepared: Prepared) -> None:
        self.discard(prepared.uid)

    def unload(self, name: str) -> None:
        """Forgets adapter `name`: new requests cannot use it; requests running on it finish on their version."""
        adapter = self.get(name)
        if name in self.updating:
            raise ValueError(f"LoRA adapter {name!r} has an open update session; finish or abort it first")
        if name in self.prepared_loads:
            raise ValueError(f"a load of LoRA adapter {name!r} is prepared; commit or abort it first")
        del self.adapters[name]
        for version in [adapter.current, *adapter.old.values()]:
            if version.users:
                self.retired[version.uid] = version
            else:
                self._remove(version.uid)

    # ---- requests ---------------------------------------------------------------------------------------------

    def acquire(self, adapter: Adapter) -> AdapterVersion:
        adapter.current.users += 1
        return adapter.current

    def release(self, version: AdapterVersion) -> None:
        """A request that ran on `version` ended; a superseded version no request uses is dropped."""
        version.users -= 1
        if version.users > 0:
            return
        if self.retired.pop(version.uid, None) is not None:
            self._remove(version.uid)
            return
        for adapter in self.adapters.values():
            if adapter.old.pop(version.uid, None) is not None:
                self._remove(version.uid)
                return

    # ---- updates (a new version) ------------------------------------------------------------------------------

    def begin_update(self, name: str) -> tuple[Adapter, int]:
        """Room and a uid for the next version of `name` (the caller loads it on the workers, then `commit`s).
        Raises RuntimeError while another change of `name` is open or prepared: two versions computed against
        the same one must not both commit (the second would silently undo the first)."""
        adapter = self.get(name)
        self._check_idle(name)
        # the current version goes at the commit unless requests still run on it
        kept = 1 if adapter.current.users else 0
        self._check_room(
            f"requests still run on version {adapter.current.version} of {name!r}, so it is held beside the new one"
            if kept
            else "",
            free=1 - kept,
        )
        uid = next(self._uids)
        self.pending.add(uid)
        self.updating[name] = uid
        return adapter, uid

    def _check_idle(self, name: str) -> None:
        """Raises RuntimeError while a change of adapter `name` is open or prepared."""
        if name in self.updating or name in self.prepared_loads:
            raise RuntimeError(
                f"another change of LoRA adapter {name!r} is open or prepared; commit or abort it first (two "
                "versions computed against the same one cannot both be served)"
            )

    def commit(self, adapter: Adapter, uid: int, spec: LoRASpec | None = None) -> list[AdapterVersion]:
        """Makes version `uid` (loaded on every worker) the adapter's current one. Returns the superseded version
        when requests still use it (the caller moves them under the "switch" policy), else []."""
        self._settled(uid)
        previous = adapter.current
        adapter.current = AdapterVersion(uid, previous.version + 1)
        if spec is not None:
            adapter.spec = spec
        if previous.users:
            adapter.old[previous.uid] = previous
            return [previous]
        self._remove(previous.uid)
        return []

    def discard(self, uid: int) -> None:
        """Drops a version that was being loaded (a failed or aborted update) from every worker."""
        self._settled(uid)
        self._remove(uid)

    def _settled(self, uid: int) -> None:
        """Version `uid` is no longer being loaded (committed or dropped)."""
        self.pending.discard(uid)
        for name in [n for n, u in self.updating.items() if u == uid]:
            del self.updating[name]

    # ---- loads prepared on every worker, committed or dropped later (a fleet's, on each replica) --------------

    def hold(self, prepared: Prepared) -> Prepared:
        """Keeps `prepared` (from `prepare`, which refuses a second change of one adapter) until `commit_held` or
        `abort_held` of its name."""
        assert prepared.name not in self.prepared_loads, "prepare() refuses a second change of one adapter"
        self.prepared_loads[prepared.name] = prepared
        return prepared

    def commit_held(self, name: str) -> Adapter:
        """The held load of `name` is served from now on."""
        prepared = self.prepared_loads.pop(name, None)
        if prepared is None:
            raise RuntimeError(f"no load of LoRA adapter {name!r} is prepared")
        return self.commit_prepared(prepared)

    def abort_held(self, name: str) -> bool:
        """Drops the held load of `name`; False if none was held."""
        prepared = self.prepared_loads.pop(name, None)
        if prepared is not None:
            self.abort_prepared(prepared)
        return prepared is not None

    def description(self, name: str) -> dict[str, Any]:
        """`describe()`'s entry of adapter `name`."""
        return next(d for d in self.describe() if d["lora_name"] == name)

    def check_base(self, adapter: Adapter, base_version: Any) -> None:
        """Raises ValueError unless a delta's `base_version` (None: no check) is the adapter's current version."""
        if base_version is None:
            return
        if str(base_version) != str(adapter.current.version):
            raise ValueError(
                f"this delta applies on top of version {base_version!r} of LoRA adapter "
                f"{adapter.name!r}, which is at version {adapter.current.version}; send its full "
                f"tensors, or a delta against version {adapter.current.version}"
            )

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _all_or_none(self, add: AddAdapter) -> None:
        """Loads `add` on every worker; if any fails, its version is dropped wherever it was loaded."""
        try:
            self.executor.send(add)
        except BaseException:
            self.discard(add.uid)
            raise

    def _remove(self, uid: int) -> None:
        try:
            self.executor.send(RemoveAdapter(uid))
        except Exception:  # a dead worker: health_problem reports it; nothing is left to free
            pass

    def _check_room(self, why: str = "", free: int = 0) -> None:
        """Raises ValueError unless one more version fits in `max_cpu_loras` (`free`: versions that go once it
        is committed)."""
        limit = self.config.max_cpu_loras
        if self.held() - free >= (limit or 0):
            raise ValueError(
                f"too many LoRA adapter versions held ({self.held()}, max_cpu_loras={limit})"
                f"{': ' + why if why else ''}; unload an adapter, or start the engine with a larger "
                "max_cpu_loras"
            )

    def describe(self) -> list[dict[str, Any]]:
        """What `/v1/models` and `list_loras()` report: per adapter, its name, id, version, rank and path."""
        return [
            {
                "lora_name": a.name,
                "lora_int_id": a.int_id,
                "version": a.current.version,
                "rank": a.spec.rank,
                "lora_path": a.path,
                "pinned": a.pinned,
            }
            for a in self.adapters.values()
        ]
