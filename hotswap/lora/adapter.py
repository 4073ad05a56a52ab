"""One adapter version as a module: its parameters are the adapter's factors under PEFT's saved names, each with
the `ShardedWeights` layout of the base layer it adapts, so the one weight path (validation, transports, deltas,
checksums, rollback) loads and updates it like the model.

Tensor parallelism follows the base layer: a column-parallel layer's lora_B keeps this rank's output rows (lora_A
whole); a row-parallel layer's lora_A keeps this rank's input columns (lora_B whole; its rank-sized partial
products are summed across ranks before lora_B).

`packs()` fuses, per base linear layer, the factors of every projection it holds (q/k/v, gate/up) into one
shrink [in, sum of ranks] and one expand [sum of ranks, out] with the scale folded in (zeros outside each
projection's rows): two products per layer and adapter in the forward pass.
"""

from __future__ import annotations

import torch
from torch import nn

from hotswap.lora.batch import Pack
from hotswap.lora.peft_format import PREFIX, LoRASpec
from hotswap.model.layers.linear import Linear
from hotswap.weights.index import WeightIndex
from hotswap.weights.sharded import Narrowing


class LoRAFactor(nn.Module):
    """One factor (lora_A or lora_B) of one adapted projection: `weight` is this rank's part of the full
    [rows, cols] checkpoint tensor, cut by `plan`."""

    def __init__(self, full_shape: tuple[int, int], plan: Narrowing, dtype: torch.dtype) -> None:
        super().__init__()
        shape = list(full_shape)
        for dim, _, length in plan:
            shape[dim] = length
        self.full_shape = full_shape
        self.plan = plan
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)

    def checkpoint_shape(self, param: nn.Parameter, shard_id: object = None) -> tuple[int, ...]:
        return self.full_shape

    def local_view(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        return param.data

    def narrowings(self, param: nn.Parameter, shard_id: object = None) -> Narrowing:
        return list(self.plan)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None,
                    pre_sliced: bool = False) -> None:
        part = loaded
        if not pre_sliced:
            for dim, start, length in self.plan:
                part = part.narrow(dim, start, length)
        param.data.copy_(part)


class LoRAAdapter(nn.Module):
    """The factors of one adapter version for `base` (a model whose linear layers it adapts), all zero until
    loaded. Raises ValueError for a module of `spec` that the model lacks or that is not a linear layer this
    engine adapts (embeddings, the LM head, mixture-of-experts experts)."""

    def __init__(self, spec: LoRASpec, base: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        index = WeightIndex.of(base)
        # base linear module name -> [(shard id, lora_A factor, lora_B factor)]
        self.targets: dict[str, list[tuple[object, LoRAFactor, LoRAFactor]]] = {}
        self.layers: dict[str, Linear] = {}
        for module in spec.modules:
            target = index.targets.get(f"{module}.weight")
            layer = target.layout if target is not None else None
            if target is None or not isinstance(layer, Linear) or target.param is not layer.weight:
                raise ValueError(f"LoRA target module {module!r} is not a linear layer of this model that adapters "
                                 "can change (attention and MLP projections)")
            out_full, in_full = target.full_shape
            a_plan: Narrowing = []
            b_plan: Narrowing = []
            if layer.parallel == "row":
                a_plan = [(1, layer.in_start, layer.in_local)]
            elif layer.parallel == "column":
                spec_rows = layer.shard_specs[target.shard_id]
                b_plan = [(0, spec_rows.ckpt_start, spec_rows.size)]
            lora_a = LoRAFactor((spec.rank, in_full), a_plan, dtype)
            lora_b = LoRAFactor((out_full, spec.rank), b_plan, dtype)
            _place(self, f"{PREFIX}{module}.lora_A", lora_a)
            _place(self, f"{PREFIX}{module}.lora_B", lora_b)
            self.targets.setdefault(target.module_name, []).append((target.shard_id, lora_a, lora_b))
            self.layers[target.module_name] = layer
        self._packs: dict[str, Pack] | None = None

    def weight_index(self) -> WeightIndex:
        """The adapter's weight index: its PEFT names; loading it never makes the served model valid or
        invalid."""
        index = WeightIndex.of(self)
        index.validating_keys = frozenset()
        return index

    def copy_from(self, other: LoRAAdapter) -> None:
        """This adapter's factors := `other`'s (same spec)."""
        with torch.no_grad():
            for mine, theirs in zip(self.parameters(), other.parameters(), strict=True):
                mine.copy_(theirs)
        self._packs = None

    def packs(self) -> dict[str, Pack]:
        """Per base linear module name, its fused (shrink, expand) pair (see the module doc); built on first use
        after a load, then kept."""
        if self._packs is None:
            scale = self.spec.scaling
            packs: dict[str, Pack] = {}
            for name, parts in self.targets.items():
                layer = self.layers[name]
                shrink = torch.cat([a.weight for _, a, _ in parts]).t().contiguous()
                expand = torch.zeros(shrink.shape[1], layer.out_local, dtype=self.dtype)
                col = 0
                for shard, _, b in parts:
                    rank, start = b.weight.shape[1], layer.shard_specs[shard].local_offset
                    expand[col : col + rank, start : start + b.weight.shape[0]] = b.weight.t() * scale
                    col += rank
                packs[name] = (shrink, expand)
            self._packs = packs
        return self._packs

    def invalidate_packs(self) -> None:
        self._packs = None


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Registers `module` at the dotted `path` under `root`, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(leaf, module)
