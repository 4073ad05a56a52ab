"""The trainer's side of delta updates: what changed since the last push, encoded for any sender.

    encoder = DeltaEncoder("sparse", dtype=torch.bfloat16)     # the engine's weight dtype
    named, extra = encoder.encode(model.named_parameters())     # skips tensors that did not change
    info = {**sender.update_info(named), **extra}               # or sender.write(named) (shm), then the extras
    ... start_weight_update / update_weights(info) / finish_weight_update ...
    encoder.committed(new_version)                              # only after the engine committed

The first push (or any after `reset()`) is full. Later ones carry `encoding` and `base_version` (the version the
engine must serve for the delta to apply, else it refuses before anything moves) and, with `checksums=True`, the
SHA-256 of each result, verified by the engine before it commits. `xor` sends each changed tensor as the XOR of
its bits (the same bytes as the tensor: for a transport that compresses, or to keep one encoding); `sparse` sends
changed elements as (indices, values), a tensor whole where that is smaller. The engine's side:
hotswap/weights/delta.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hotswap.weights.checksum import tensor_sha256
from hotswap.weights.delta import INDICES, VALUES, xor_dtype
from hotswap.weights.version import VersionArg


def xor_delta(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The bitwise XOR of `new` and `old` (same dtype and shape) as the integer tensor of their element size."""
    bits = xor_dtype(new.dtype)
    return torch.bitwise_xor(new.contiguous().view(bits), old.contiguous().view(bits))


def sparse_delta(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat int64 indices, new values) of the elements whose bits differ."""
    bits = xor_dtype(new.dtype)
    changed = (new.contiguous().view(bits) != old.contiguous().view(bits)).reshape(-1).nonzero().squeeze(1)
    return changed, new.reshape(-1)[changed].clone()


class DeltaEncoder:
    """Remembers the state the engine holds (as of the last committed push) and encodes the next push against it.
    `dtype`: the engine's weight dtype; tensors are cast to it before comparing, as the engine stores them."""

    def __init__(self, encoding: str = "sparse", dtype: torch.dtype | None = None, checksums: bool = False) -> None:
        if encoding not in ("xor", "sparse"):
            raise ValueError(f"encoding must be 'xor' or 'sparse', got {encoding!r}")
        self.encoding, self.dtype, self.checksums = encoding, dtype, checksums
        self.base: dict[str, torch.Tensor] | None = None
        self.base_version: VersionArg = None
        self._pending: dict[str, torch.Tensor] | None = None
        self.last_bytes = 0  # of the latest encode's tensors
        self.last_full_bytes = 0  # what a full push of the same tensors would send

    def reset(self) -> None:
        """Forget the engine's state: the next push is full (after a failed push, or a reload from elsewhere)."""
        self.base, self.base_version, self._pending = None, None, None

    def encode(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """(the tensors to send, the update_info fields to add). Full when there is no committed base."""
        current = {
            name: (t.detach().to(self.dtype) if self.dtype is not None else t.detach()).clone()
            for name, t in named_tensors
        }
        self._pending = current
        self.last_full_bytes = sum(t.numel() * t.element_size() for t in current.values())
        extra: dict[str, Any] = {}
        if self.checksums:
            extra["checksums"] = {name: tensor_sha256(t) for name, t in current.items()}
        if self.base is None:
            out = list(current.items())
        else:
            extra.update(encoding=self.encoding, base_version=self.base_version)
            out = []
            for name, new in current.items():
                old = self.base.get(name)
                if old is None or old.shape != new.shape or old.dtype != new.dtype:
                    out.append((name, new))  # whole (sparse), or refused by the engine (xor: no base value)
                    continue
                if self.encoding == "xor":
                    delta = xor_delta(old, new)
                    if bool(delta.any()):
                        out.append((name, delta))
                    continue
                indices, values = sparse_delta(old, new)
                if not len(indices):
                    continue
                if len(indices) * (8 + new.element_size()) < new.numel() * new.element_size():
                    out += [(name + INDICES, indices), (name + VALUES, values)]
                else:
                    out.append((name, new))
            if "checksums" in extra:
                sent = {n.removesuffix(INDICES).removesuffix(VALUES) for n, _ in out}
                extra["checksums"] = {n: d for n, d in extra["checksums"].items() if n in sent}
        self.last_bytes = sum(t.numel() * t.element_size() for _, t in out)
        return out, extra

    def committed(self, version: VersionArg) -> None:
        """The engine committed the latest encoded push as `version`: it becomes the base of the next delta."""
        if self._pending is None:
            raise RuntimeError("committed() without a push encoded since the last commit")
        if self.base is None:
            self.base = self._pending
        else:
            self.base.update(self._pending)
        self.base_version, self._pending = version, None
