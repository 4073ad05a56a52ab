"""The worker's adapters: every adapter version the engine holds, by its uid (never reused), built on this rank's
model. A version is immutable once committed: an update builds the next version as a copy of the current one,
loads the update into the copy through the worker's weight session (validated, decoded, checksummed), and the
engine switches to it only once every rank committed; a failure discards the copy, so the version in use never
changes."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch
from torch import nn

from hotswap.lora.adapter import LoRAAdapter
from hotswap.lora.peft_format import LoRASpec
from hotswap.model.layers.fused_moe import FusedMoE
from hotswap.model.layers.linear import Linear
from hotswap.model.lora_batch import LoRABatch, LoRAGroup
from hotswap.weights.update import WeightSource, WeightUpdate


class LoRAManager:
    """The adapters of `model` (its dtype `dtype`), each built on `device`, the model's device: factors, packs and
    a pass's row indices live there."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, max_rank: int, device: torch.device | str) -> None:
        self.model = model
        self.device = torch.device(device)
        # the factors' dtype: float32 beside a half-precision model (PEFT's default, autocast_adapter_dtype)
        self.dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        self.max_rank = max_rank
        self.adapters: dict[int, LoRAAdapter] = {}
        self.pending: tuple[int, LoRAAdapter] | None = None  # a version being loaded by an open update
        self.pending_packed = False  # its packs were built after its last write (prepare_pending)
        # a dropped version's module per spec, reused by the next update of that shape: building one (a module
        # and an index entry per factor) costs more than copying its values
        self.spare: dict[LoRASpec, LoRAAdapter] = {}
        for name, module in model.named_modules():
            if isinstance(module, (Linear, FusedMoE)):
                module.lora_key = name

    def build(self, spec: dict[str, Any]) -> LoRAAdapter:
        """An all-zero adapter of `spec` (LoRASpec.as_dict) on this model. Raises ValueError for a module the model
        cannot adapt."""
        return LoRAAdapter(LoRASpec.from_dict(spec), self.model, self.dtype, self.max_rank, self.device)

    def add(self, uid: int, spec: dict[str, Any], source: WeightSource, check_finite: bool) -> None:
        """Builds adapter `uid` and loads every one of its tensors from `source` (PEFT names). Raises ValueError
        for a missing, unknown, mis-shaped or non-finite tensor; nothing is registered then."""
        if uid in self.adapters:
            raise ValueError(f"adapter uid {uid} is already loaded")
        adapter = self.build(spec)
        update = WeightUpdate(adapter.weight_index(), atomic=False, check_finite=check_finite)
        source.complete = True
        with torch.no_grad():
            update.apply(source, final=True)
            update.finish()
        adapter.packs()  # built now, not by the first request that uses it
        self.adapters[uid] = adapter

    def begin(self, old: int, new: int, fill: bool = True) -> LoRAAdapter:
        """Starts version `new` as a copy of `old`, pending until `commit_pending` (or `drop_pending`). `fill`
        False: the copy's factors are left for the caller to copy (`fill_pairs`), e.g. in slices."""
        current = self.get(old)
        if new in self.adapters:
            raise ValueError(f"adapter uid {new} is already loaded")
        self.drop_pending()
        copy = self.spare.pop(current.spec, None) or LoRAAdapter(
            current.spec, self.model, self.dtype, self.max_rank, self.device
        )
        if fill:
            copy.copy_from(current)
        self.pending = (new, copy)
        self.pending_packed = False
        return copy

    def fill_pairs(self, old: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(the pending version's factor, version `old`'s) pairs: what `begin(..., fill=False)` left to copy."""
        assert self.pending is not None, "no pending version"
        return list(zip(self.pending[1].factors(), self.get(old).factors(), strict=True))

    def pack_steps(self) -> Generator[None, None, None]:
        """Builds the pending version's packs one base module per step (its tensors have all arrived); then
        `prepare_pending` and `commit_pending` only register it. A sliced reload runs these as its last steps."""
        assert self.pending is not None, "no pending version"
        yield from self.pending[1].pack_steps()
        self.pending_packed = True

    def prepare_pending(self) -> None:
        """Builds the pending version's packs now (its tensors have all arrived) unless `pack_steps` did, so that
        `commit_pending` only registers it: a serving engine runs the two between different steps."""
        if self.pending is not None and not self.pending_packed:
            self.pending[1].invalidate_packs()
            self.pending[1].packs()
            self.pending_packed = True

    def commit_pending(self) -> int | None:
        """Registers the pending version (its packs rebuilt on first use); returns its uid (None: none pending)."""
        if self.pending is None:
            return None
        uid, adapter = self.pending
        if not self.pending_packed:
            adapter.invalidate_packs()
            adapter.packs()  # built now, not by the first request that uses it
        self.adapters[uid] = adapter
        self.pending, self.pending_packed = None, False
        return uid

    def drop_pending(self) -> None:
        if self.pending is not None:
            self._keep_spare(self.pending[1])
        self.pending = None

    def remove(self, uid: int) -> bool:
        adapter = self.adapters.pop(uid, None)
        if adapter is not None:
            self._keep_spare(adapter)
        return adapter is not None

    def _keep_spare(self, adapter: LoRAAdapter) -> None:
        adapter.invalidate_packs()  # its packs' memory goes; its factors are overwritten before any use
        self.spare[adapter.spec] = adapter

    def get(self, uid: int) -> LoRAAdapter:
        adapter = self.adapters.get(uid)
        if adapter is None:
            raise ValueError(f"no adapter with uid {uid} is loaded on this worker")
        return adapter

    def batch(self, token_uids: list[tuple[int, int, int]], num_tokens: int) -> LoRABatch | None:
        """The adapters of a pass over `num_tokens` flat rows, where each (uid, start, end) gives rows [start, end)
        to adapter `uid`; None when no row uses an adapter. An adapter whose rows are consecutive gets a span."""
        if not token_uids:
            return None
        ranges: dict[int, list[tuple[int, int]]] = {}
        for uid, start, end in token_uids:
            ranges.setdefault(uid, []).append((start, end))
        groups = []
        for uid, parts in ranges.items():
            parts.sort()
            packs = self.get(uid).packs()
            if all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1)):
                groups.append(LoRAGroup(packs, (parts[0][0], parts[-1][1] - parts[0][0])))
            else:
                rows = torch.tensor([r for a, b in parts for r in range(a, b)], dtype=torch.long, device=self.device)
                groups.append(LoRAGroup(packs, None, rows))
        return LoRABatch(groups)
