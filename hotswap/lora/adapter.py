"""One adapter version as a module: its parameters are the adapter's factors under PEFT's saved names, each with
the `ShardedWeights` layout of the base layer it adapts, so the one weight path (validation, transports, deltas,
checksums, rollback) loads and updates it like the model.

Tensor parallelism follows the base layer: a column-parallel layer's lora_B keeps this rank's output rows (lora_A
whole); a row-parallel layer's lora_A keeps this rank's input columns (lora_B whole; its rank-sized partial
products are summed across ranks before lora_B).

`packs()` fuses, per base linear layer, the factors of every projection it holds (q/k/v, gate/up) into one
shrink [in, sum of ranks] and one expand [sum of ranks, out] with the scale folded in (zeros outside each
projection's rows), both transposed views of row-major copies: two products per layer and adapter in the forward
pass.
"""

from __future__ import annotations

from collections.abc import Generator

import torch
from torch import nn

from hotswap.lora.peft_format import PREFIX, LoRASpec
from hotswap.model.layers.fused_moe import FusedMoE
from hotswap.model.layers.linear import Linear
from hotswap.model.lora_batch import Pack, Packs
from hotswap.weights.index import WeightIndex
from hotswap.weights.sharded import Narrowing


class LoRAFactor(nn.Module):
    """One factor (lora_A or lora_B) of one adapted projection: `weight` is this rank's part of the full
    [rows, cols] checkpoint tensor, cut by `plan`, on `device` (the model's: a loaded tensor read on the host is
    copied there once, by `load_weight`)."""

    def __init__(self, full_shape: tuple[int, int], plan: Narrowing, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = list(full_shape)
        for dim, _, length in plan:
            shape[dim] = length
        self.full_shape = full_shape
        self.plan = plan
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)

    def checkpoint_shape(self, param: nn.Parameter, shard_id: object = None) -> tuple[int, ...]:
        return self.full_shape

    def local_view(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        return param.data

    def narrowings(self, param: nn.Parameter, shard_id: object = None) -> Narrowing:
        return list(self.plan)

    def load_weight(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None, pre_sliced: bool = False
    ) -> None:
        part = loaded
        if not pre_sliced:
            for dim, start, length in self.plan:
                part = part.narrow(dim, start, length)
        param.data.copy_(part)


class LoRAAdapter(nn.Module):
    """The factors of one adapter version for `base` (a model whose linear layers and experts it adapts), all
    zero until loaded, on `device` (the model's; so are its packs). Raises ValueError for a module of `spec` that
    the model lacks or that this engine cannot adapt (embeddings, the LM head), or a rank over `max_rank`."""

    def __init__(
        self, spec: LoRASpec, base: nn.Module, dtype: torch.dtype, max_rank: int, device: torch.device
    ) -> None:
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        self.device = device
        index = WeightIndex.of(base)
        # base linear module name -> [(shard id, checkpoint module path, lora_A factor, lora_B factor)]
        self.targets: dict[str, list[tuple[object, str, LoRAFactor, LoRAFactor]]] = {}
        self.layers: dict[str, Linear] = {}
        # fused experts module name -> {"w13" | "w2": (lora_A, lora_B, per-expert rank, PEFT's parameter key)}
        self.expert_targets: dict[str, dict[str, tuple[LoRAFactor, LoRAFactor, int, str]]] = {}
        self.expert_layers: dict[str, FusedMoE] = {}
        for module, rows, in_features, out_features in spec.ranks:
            if module.endswith(".experts") or ".experts.base_layer" in module:
                self._add_experts(base, module, rows, (in_features, out_features), max_rank)
                continue
            target = index.targets.get(f"{module}.weight")
            layer = target.layout if target is not None else None
            if target is None or not isinstance(layer, Linear) or target.param is not layer.weight:
                raise ValueError(
                    f"LoRA target module {module!r} is not a linear layer of this model that adapters "
                    "can change (attention and MLP projections, experts)"
                )
            out_full, in_full = target.full_shape
            a_plan: Narrowing = []
            b_plan: Narrowing = []
            if layer.parallel == "row":
                a_plan = [(1, layer.in_start, layer.in_local)]
            elif layer.parallel == "column":
                spec_rows = layer.shard_specs[target.shard_id]
                b_plan = [(0, spec_rows.ckpt_start, spec_rows.size)]
            lora_a = LoRAFactor((rows, in_full), a_plan, dtype, device)
            lora_b = LoRAFactor((out_full, rows), b_plan, dtype, device)
            _place(self, f"{PREFIX}{module}.lora_A", lora_a)
            _place(self, f"{PREFIX}{module}.lora_B", lora_b)
            self.targets.setdefault(target.module_name, []).append((target.shard_id, module, lora_a, lora_b))
            self.layers[target.module_name] = layer
        self._packs: Packs | None = None
        self._factors: list[torch.Tensor] | None = None

    def _add_experts(self, base: nn.Module, wrapper: str, rows: int, features: tuple[int, int], max_rank: int) -> None:
        """A targeted expert parameter (PEFT's `target_parameters`): which one follows from its factors' (in, out)
        features: (hidden, 2 x intermediate) for gate_up, (intermediate, hidden) for down."""
        path = wrapper.replace(".base_layer", "")
        try:
            layer = base.get_submodule(path)
        except AttributeError:
            layer = None
        if not isinstance(layer, FusedMoE):
            raise ValueError(f"LoRA target {wrapper!r} names no mixture-of-experts block of this model")
        experts, hidden, inter = layer.num_experts, layer.hidden_size, layer.intermediate_size
        if rows % experts:
            raise ValueError(f"{wrapper}: lora_A has {rows} rows, not a multiple of the {experts} experts")
        rank = rows // experts
        if rank > max_rank:
            raise ValueError(
                f"the adapter's rank {rank} per expert ({wrapper}) exceeds max_lora_rank={max_rank}; "
                "start the engine with a larger max_lora_rank"
            )
        if features == (hidden, 2 * inter):
            which, param = "w13", "gate_up_proj"
        elif features == (inter, hidden):
            which, param = "w2", "down_proj"
        else:
            raise ValueError(
                f"LoRA target {wrapper!r}: factors of {features[0]} inputs and {features[1]} outputs fit "
                f"neither gate_up_proj ({hidden} -> {2 * inter}) nor down_proj ({inter} -> {hidden})"
            )
        if which in self.expert_targets.get(path, {}):
            raise ValueError(f"LoRA target {wrapper!r}: {path}.{param} is adapted twice")
        lora_a = LoRAFactor((rows, features[0]), [], self.dtype, self.device)  # [experts x rank, in]
        lora_b = LoRAFactor((features[1], rows), [], self.dtype, self.device)
        _place(self, f"{PREFIX}{wrapper}.lora_A", lora_a)
        _place(self, f"{PREFIX}{wrapper}.lora_B", lora_b)
        self.expert_targets.setdefault(path, {})[which] = (lora_a, lora_b, rank, f"{path}.{param}")
        self.expert_layers[path] = layer

    def weight_index(self) -> WeightIndex:
        """The adapter's weight index: its PEFT names; loading it never makes the served model valid or
        invalid."""
        index = WeightIndex.of(self)
        index.validating_keys = frozenset()
        return index

    def factors(self) -> list[torch.Tensor]:
        """Every factor's values, in the order of `parameters()` (listed once: walking the module tree costs
        milliseconds, and the factors are fixed at construction)."""
        if self._factors is None:
            self._factors = [p.data for p in self.parameters()]
        return self._factors

    def copy_from(self, other: LoRAAdapter) -> None:
        """This adapter's factors := `other`'s (same spec)."""
        with torch.no_grad():
            for mine, theirs in zip(self.factors(), other.factors(), strict=True):
                mine.copy_(theirs)
        self._packs = None

    def packs(self) -> Packs:
        """Per base module name, what its forward adds: a linear layer's fused (shrink, expand) pair (see the
        module doc); a fused experts module's {"w13" | "w2": (shrink [experts, rank, in], expand [experts, out,
        rank])} over this rank's experts and intermediate rows. Built on first use after a load, then kept."""
        if self._packs is None:
            for _ in self.pack_steps():
                pass
        assert self._packs is not None
        return self._packs

    def pack_steps(self) -> Generator[None, None, None]:
        """Builds `packs()` again, one base module per step (a yield after each): a serving engine builds a new
        version's packs in slices between its steps. They are kept once the last step ran."""
        packs: Packs = {}
        for name, parts in self.targets.items():
            layer = self.layers[name]
            # [R, in] and [out, R], used transposed (views): the products read them in place
            shrink = torch.cat([a.weight for _, _, a, _ in parts]) if len(parts) > 1 else parts[0][2].weight
            expand = torch.zeros(layer.out_local, shrink.shape[0], dtype=self.dtype, device=self.device)
            col = 0
            for shard, module, _, b in parts:
                rows, rank = b.weight.shape
                start = layer.shard_specs[shard].local_offset
                block = expand[start : start + rows, col : col + rank]
                torch.mul(b.weight, self.spec.scaling(module, rank), out=block)
                col += rank
            packs[name] = (shrink.t(), expand.t())
            yield
        for name, factors in self.expert_targets.items():
            packs[name] = {
                which: self._expert_pack(self.expert_layers[name], which, *part) for which, part in factors.items()
            }
            yield
        self._packs = packs

    def _expert_pack(
        self, layer: FusedMoE, which: str, lora_a: LoRAFactor, lora_b: LoRAFactor, rank: int, key: str
    ) -> Pack:
        """PEFT's layout for a [experts, out, in] parameter: lora_A rows are expert-major ([experts, rank, in]),
        lora_B columns rank-major ([out, rank, experts]); expert e adds scale * B_e @ A_e."""
        experts = layer.num_experts
        local = torch.tensor(layer.local_experts, dtype=torch.long, device=lora_a.weight.device)
        a = lora_a.weight.reshape(experts, rank, -1)[local]
        b = lora_b.weight.reshape(lora_b.weight.shape[0], rank, experts).permute(2, 0, 1)[local]
        start, width, inter = layer.i_start, layer.i_local, layer.intermediate_size
        if which == "w13":  # this rank's gate rows and up rows
            b = torch.cat([b[:, start : start + width], b[:, inter + start : inter + start + width]], dim=1)
        else:  # this rank's intermediate columns (the partial products are summed with the experts' outputs)
            a = a[:, :, start : start + width]
        return a.contiguous(), (b * self.spec.scaling(key, rank)).contiguous()

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
