"""Mixture-of-experts: top-k routing and one fused experts layer, with FP8 and expert parallelism.

`FusedMoE` stacks the experts in place: `w13_weight` [E_local, 2 I_local, H] (gate rows, then up rows) and
`w2_weight` [E_local, H, I_local]. Across ranks the experts are either split along I (every rank holds every
expert's share; tensor parallelism) or, with `enable_expert_parallel`, placed whole (each rank holds its experts;
`expert_placement`). Either way each rank computes its part for every token it sees and the ranks' outputs are
summed (`all_reduce`), so a token's result is the same as on one rank up to the summation order.

Checkpoint names (relative to the layer; see `WeightIndex`): per expert `{e}.{gate}.weight`, `{e}.{up}.weight`,
`{e}.{down}.weight` (hub checkpoints, Megatron converters; `gate`/`up`/`down` are `gate_proj`/`up_proj`/`down_proj`
or Mixtral's `w1`/`w3`/`w2`), and the fused `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] that a
transformers 5 model's `named_parameters()` yields. A fused tensor covers every expert's shards.

Forward: tokens are grouped by expert with one stable sort, then every expert's rows go through two grouped
matrix products (`torch._grouped_mm`, no Python loop over experts); the router's probabilities and the weighted
combine are float32.

FP8 (`quantization="fp8"`): weights are float8 with one float32 scale per output row of each expert
(`w13_weight_scale`), or with `weight_block_size` one per tile (`w13_weight_scale_inv`, as DeepSeek / Qwen FP8
checkpoints store them). High-precision loads go to a stage; post-processing quantizes exactly the staged
projections (a row's or tile's scale depends on it alone), so an update re-quantizes exactly the experts, and
the projections of them, that it rewrote. Tensors that already are FP8 (`{e}.{proj}.weight` in float8 with its
`{e}.{proj}.weight_scale` [rows, 1] or `.weight_scale_inv` [row tiles, column tiles] in the same update) are
copied as they are.

The layer is built with its `LayerSettings` (hotswap/model/settings.py): the rank, the quantization, deterministic
mode, and the live parallel section whose `expert_placement` may change on a live engine (`gather_placement` /
`take_placement` move the experts to it). Post-processing (`process_weights_after_loading`) builds the dispatch
state: the expert map (global expert -> local slot) of this rank's experts, and (FP8) the quantized weights.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.distributed import split
from hotswap.kernels import ops
from hotswap.model.layers.quant.fp8 import FP8_DTYPE, dequantize_blocks, quantize_blocks, quantize_per_channel
from hotswap.model.lora_batch import LoRABatch
from hotswap.model.settings import LayerSettings
from hotswap.weights.sharded import Narrowing

_GATE, _UP, _DOWN = "gate", "up", "down"
FUSED_GATE_UP, FUSED_DOWN = "gate_up_proj", "down_proj"


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, deterministic: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, k], expert ids [T, k]) of the top-k experts by softmax probability of `logits`;
    `renormalize`: the k weights sum to one (Qwen3-MoE `norm_topk_prob`, Mixtral)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        if deterministic:  # the k weights added left to right, whatever the batch's shape
            total = weights[:, 0]
            for j in range(1, top_k):
                total = total + weights[:, j]
            weights = weights / total[:, None]
        else:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_placement(num_experts: int, num_ranks: int) -> list[list[int]]:
    """Which experts each rank holds under expert parallelism: contiguous, the first E % N ranks one more.
    Raises ValueError when there are fewer experts than ranks."""
    if num_experts < num_ranks:
        raise ValueError(
            f"expert parallelism over {num_ranks} ranks needs at least {num_ranks} experts, the model has "
            f"{num_experts}; disable enable_expert_parallel (the experts are then split along their "
            "intermediate size)"
        )
    return [list(range(start, start + n)) for start, n in (split(num_experts, r, num_ranks) for r in range(num_ranks))]


@functools.cache
def _grouped_mm_works(device: str, dtype: torch.dtype) -> bool:
    """Whether this torch build runs `torch._grouped_mm` on `device` for `dtype` (checked once, on a product
    whose result is known)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:  # [E, N, K] weights transposed, as the layer passes them; 16-byte aligned strides, as torch requires
        a = torch.ones(3, 8, dtype=dtype, device=device)
        b = torch.ones(2, 4, 8, dtype=dtype, device=device).transpose(1, 2)
        out = torch._grouped_mm(a, b, offs=torch.tensor([1, 3], dtype=torch.int32, device=device))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(out.shape == (3, 4) and torch.all(out == 8))


def _aligned(*tensors: torch.Tensor) -> bool:
    """Whether every stride but the unit one, and the data, are 16-byte aligned (what `_grouped_mm` needs)."""
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1) for t in tensors
    )


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` grouped by expert (`counts[e]` consecutive rows for expert e) times `weights[e]`ᵀ
    ([E, N, K]): [rows, N]."""
    transposed = weights.transpose(1, 2)
    if _grouped_mm_works(x.device.type, x.dtype) and _aligned(x, transposed):
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, transposed, offs=offs)
    parts, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            parts.append(F.linear(x[start : start + n], weights[e]))
            start += n
    return torch.cat(parts) if parts else x.new_empty(0, weights.shape[1])


def _param(shape: tuple[int, ...], dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class FusedMoE(nn.Module):
    """The experts of one sparse layer (see the module doc). `forward(x, weights, ids)` takes the router's
    float32 weights and expert ids [T, k] and returns the experts' weighted sum [T, H], summed over ranks."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        settings: LayerSettings,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ) -> None:
        super().__init__()
        self.tp, self.layout, self.deterministic = settings.parallel, settings.experts, settings.deterministic
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.names = dict(zip((_GATE, _UP, _DOWN), names, strict=True))
        self.expert_parallel = self.layout.enable_expert_parallel and self.tp.size > 1
        self.placement = self._placement()
        self.local_experts = self.placement[self.tp.rank]
        if self.expert_parallel:
            self.i_start, self.i_local = 0, intermediate_size
        else:
            self.i_start, self.i_local = split(intermediate_size, self.tp.rank, self.tp.size)
        self.slot = {e: s for s, e in enumerate(self.local_experts)}
        local = len(self.local_experts)
        self.fp8 = settings.fp8
        dtype = FP8_DTYPE if self.fp8 else None
        self.w13_weight = _param((local, 2 * self.i_local, hidden_size), dtype)
        self.w2_weight = _param((local, hidden_size, self.i_local), dtype)
        self.stage_dtype = settings.dtype if self.fp8 else None
        self.block = settings.weight_block_size if self.fp8 else None
        self.scale_leaf = "weight_scale_inv" if self.block else "weight_scale"
        if self.fp8:
            b0, b1 = self.block or (1, 1)
            if self.i_local % b0 or self.i_local % b1 or self.i_start % b1:
                raise ValueError(
                    f"weight_block_size={self.block} does not tile this rank's share of the experts' intermediate "
                    f"size ({self.i_local} of {intermediate_size}); use a divisor of it, or per-row scales"
                )
            for prefix, rows, cols in (("w13", 2 * self.i_local, hidden_size), ("w2", hidden_size, self.i_local)):
                scale = _param(self._scale_shape(local, rows, cols), torch.float32)
                self.register_parameter(f"{prefix}_{self.scale_leaf}", scale)
            self._stages: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # param -> (stage, staged rows)
        # global expert id -> local slot (-1: another rank's); built by post-processing
        self.expert_map: torch.Tensor | None = None

    def _placement(self) -> list[list[int]]:
        """Every rank's experts under the live layout: its `expert_placement`, or contiguous; all of them on every
        rank without expert parallelism."""
        if not self.expert_parallel:
            return [list(range(self.num_experts))] * self.tp.size
        placement = self.layout.expert_placement
        return [list(p) for p in placement] if placement else expert_placement(self.num_experts, self.tp.size)

    def gather_placement(self) -> dict[str, torch.Tensor] | None:
        """The first half of moving the experts to the live layout's `expert_placement`: this rank's new experts'
        tensors, gathered from every rank (a collective: every rank calls it for every layer in the same order),
        or None when the placement is unchanged. Changes nothing."""
        new = self._placement()
        if new == self.placement:
            return None
        most = max(len(p) for p in self.placement)
        moved: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters(recurse=False):
            data = param.data.view(torch.uint8) if param.element_size() == 1 else param.data  # gloo has no fp8
            padded = data.new_zeros(most, *data.shape[1:])
            padded[: len(self.local_experts)] = data
            parts = [torch.empty_like(padded) for _ in range(self.tp.size)]
            self.tp.group.allgather([parts], [padded]).wait()
            every = data.new_empty(self.num_experts, *data.shape[1:])
            for rank, experts in enumerate(self.placement):
                every[experts] = parts[rank][: len(experts)]
            moved[name] = every[new[self.tp.rank]].view(param.dtype)
        return moved

    def take_placement(self, moved: dict[str, torch.Tensor]) -> None:
        """The second half (local, no collective): the parameters take the gathered experts (in place when the
        rank keeps its expert count, else in new storage), and post-processing rebuilds the dispatch state under
        the new placement."""
        for name, value in moved.items():
            param = getattr(self, name)
            if param.shape == value.shape:
                param.data.copy_(value)
            else:
                setattr(self, name, nn.Parameter(value, requires_grad=False))
        self.placement = self._placement()
        self.local_experts = self.placement[self.tp.rank]
        self.slot = {e: s for s, e in enumerate(self.local_experts)}
        self.discard_stage()
        self.process_weights_after_loading()

    def _scale_shape(self, experts: int, rows: int, cols: int) -> tuple[int, ...]:
        if self.block is None:
            return (experts, rows)
        return (experts, -(-rows // self.block[0]), -(-cols // self.block[1]))

    def scale_of(self, param: nn.Parameter) -> nn.Parameter:
        """The scale parameter of an fp8 weight (`w13_weight` -> `w13_weight_scale` or `..._scale_inv`)."""
        scale: nn.Parameter = getattr(self, f"{'w13' if param is self.w13_weight else 'w2'}_{self.scale_leaf}")
        return scale

    # ---- checkpoint layout (ShardedWeights) ----------------------------------------------------------------

    def checkpoint_names(self, leaf: str) -> list[tuple[str, object, tuple[object, ...] | None]]:
        """(name relative to this module, shard id, the shard ids it covers or None) for parameter `leaf`."""
        e_range = range(self.num_experts)
        if leaf == "w13_weight":
            per_expert: list[tuple[str, object, tuple[object, ...] | None]] = [
                (f"{e}.{self.names[part]}.weight", (e, part), None) for e in e_range for part in (_GATE, _UP)
            ]
            return [*per_expert, (FUSED_GATE_UP, FUSED_GATE_UP, tuple((e, p) for e in e_range for p in (_GATE, _UP)))]
        if leaf == "w2_weight":
            per_expert = [(f"{e}.{self.names[_DOWN]}.weight", (e, _DOWN), None) for e in e_range]
            return [*per_expert, (FUSED_DOWN, FUSED_DOWN, tuple((e, _DOWN) for e in e_range))]
        parts = {f"w13_{self.scale_leaf}": (_GATE, _UP), f"w2_{self.scale_leaf}": (_DOWN,)}.get(leaf)
        if parts is None:
            raise ValueError(f"FusedMoE has no loadable parameter {leaf!r}")
        # the scales of tensors that arrive already quantized: optional (covering nothing), never required
        return [(f"{e}.{self.names[p]}.{self.scale_leaf}", (e, p), ()) for e in e_range for p in parts]

    def _is_scale(self, param: nn.Parameter) -> bool:
        return param is not self.w13_weight and param is not self.w2_weight

    def checkpoint_shape(self, param: nn.Parameter, shard_id: object = None) -> tuple[int, ...]:
        e, i, h = self.num_experts, self.intermediate_size, self.hidden_size
        if shard_id == FUSED_GATE_UP:
            return (e, 2 * i, h)
        if shard_id == FUSED_DOWN:
            return (e, h, i)
        _, part = self._expert_shard(shard_id)
        rows, cols = (h, i) if part == _DOWN else (i, h)
        if not self._is_scale(param):
            return (rows, cols)
        return (rows, 1) if self.block is None else self._scale_shape(1, rows, cols)[1:]

    def _expert_shard(self, shard_id: object) -> tuple[int, str]:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in (_GATE, _UP, _DOWN)):
            raise ValueError(f"unknown FusedMoE shard {shard_id!r}")
        return int(shard_id[0]), str(shard_id[1])

    def _rows(self, part: str) -> tuple[int, int]:
        """(start, length) of a projection's rows in a local w13 slot."""
        return (0, self.i_local) if part == _GATE else (self.i_local, self.i_local)

    def local_view(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        """This rank's part of the shard: a whole parameter for a fused name; an expert's rows, or nothing
        (an empty view) for another rank's expert."""
        if shard_id in (FUSED_GATE_UP, FUSED_DOWN):
            return param.data
        e, part = self._expert_shard(shard_id)
        slot = self.slot.get(e)
        if slot is None:
            view = param.data[0, :0]  # nothing of another rank's expert; the shape a zero-length cut gives
            return view.unsqueeze(-1) if self._is_scale(param) and self.block is None else view
        view = param.data[slot]
        if part != _DOWN:
            start, rows = self._rows(part)
            if self._is_scale(param) and self.block is not None:
                start, rows = start // self.block[0], rows // self.block[0]
            view = view.narrow(0, start, rows)
        return view.unsqueeze(-1) if self._is_scale(param) and self.block is None else view

    def narrowings(self, param: nn.Parameter, shard_id: object = None) -> Narrowing:
        """For a canonical (per-expert) name: the rows (gate, up) or columns (down) of this rank's share of
        the intermediate size; another rank's expert: nothing (a zero-length cut)."""
        e, part = self._expert_shard(shard_id)
        if e not in self.slot:
            return [(0, 0, 0)]
        if self.i_local == self.intermediate_size:
            return []
        start, length = self.i_start, self.i_local
        if self._is_scale(param):
            if self.block is None:
                return [] if part == _DOWN else [(0, start, length)]
            start, length = start // self.block[part == _DOWN], length // self.block[part == _DOWN]
        return [(1 if part == _DOWN else 0, start, length)]

    def load_weight(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None, pre_sliced: bool = False
    ) -> None:
        """Copies this rank's part of `loaded` into place (fp8: into the stage). A fused tensor is cut to the
        local experts and, split along I, to this rank's gate and up rows (or down columns)."""
        share = (self.i_start, self.i_local)
        if shard_id in (FUSED_GATE_UP, FUSED_DOWN):
            experts = loaded if pre_sliced else loaded[self.local_experts]
            if shard_id == FUSED_DOWN:
                self._write(param, slice(None), None, experts if pre_sliced else experts.narrow(2, *share))
                return
            for part, start in ((_GATE, 0), (_UP, self.intermediate_size)):
                rows = self._rows(part)
                cut = rows if pre_sliced else (start + self.i_start, self.i_local)
                value = experts.narrow(1, *cut)
                self._write(param, slice(None), rows, value)
            return
        e, part = self._expert_shard(shard_id)
        slot = self.slot.get(e)
        if slot is None:
            return  # another rank's expert
        if self._is_scale(param):
            if not pre_sliced:
                for dim, start, length in self.narrowings(param, shard_id):
                    loaded = loaded.narrow(dim, start, length)
            ops.copy_(self.local_view(param, shard_id), loaded)
            return
        value = loaded if pre_sliced else loaded.narrow(1 if part == _DOWN else 0, *share)
        self._write(param, slot, None if part == _DOWN else self._rows(part), value)

    def _write(
        self, param: nn.Parameter, slots: int | slice, rows: tuple[int, int] | None, value: torch.Tensor
    ) -> None:
        """Writes `value` into `param[slots]` (rows `rows` of it), or for fp8 into the stage, marking the rows; an
        fp8 `value` (already quantized, its scale in the same update) is copied as it is."""
        if not self.fp8 or value.dtype == FP8_DTYPE:
            target = param.data[slots]
            ops.copy_(target if rows is None else target.narrow(-2, *rows), value)
            if self.fp8:
                self._unstage(param, slots, rows)
            return
        name = "w13_weight" if param is self.w13_weight else "w2_weight"
        if name not in self._stages:
            self._stages[name] = (
                torch.empty(param.shape, dtype=self.stage_dtype, device=param.device),
                torch.zeros(param.shape[:2], dtype=torch.bool, device=param.device),
            )
        stage, staged = self._stages[name]
        target, marks = stage[slots], staged[slots]
        if rows is not None:
            target, marks = target.narrow(-2, *rows), marks.narrow(-1, *rows)
        target.copy_(value)
        marks.fill_(True)

    def _unstage(self, param: nn.Parameter, slots: int | slice, rows: tuple[int, int] | None) -> None:
        """Rows written already quantized are no longer staged (post-processing must not overwrite them)."""
        entry = self._stages.get("w13_weight" if param is self.w13_weight else "w2_weight")
        if entry is not None:
            marks = entry[1][slots]
            (marks if rows is None else marks.narrow(-1, *rows)).fill_(False)

    def check_update(self, entries: list[tuple[object, nn.Parameter, torch.dtype]]) -> None:
        """Raises ValueError for an update that would leave FP8 weights without their scales: a float8 weight
        needs quantization="fp8" and its per-expert scale in the same update (fused names are high precision)."""
        scales = {shard for shard, param, _ in entries if self._is_scale(param)}
        quantized = {shard for shard, param, dtype in entries if not self._is_scale(param) and dtype == FP8_DTYPE}
        for shard in scales - quantized:
            raise ValueError(
                f"the {self.scale_leaf} of expert shard {shard} arrives without its float8 weight in the same update "
                "(a scale alone would rescale the weight quantized on load)"
            )
        for shard, param, dtype in entries:
            if dtype in (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
                raise ValueError(f"expert weights must be float8_e4m3fn (or high precision), got {dtype} for {shard}")
            if dtype != FP8_DTYPE or self._is_scale(param):
                continue
            if not self.fp8:
                raise ValueError(f"expert weights in float8 ({shard}) need quantization='fp8'")
            if shard in (FUSED_GATE_UP, FUSED_DOWN):
                raise ValueError(
                    f"fused expert weights ({shard}) must be high precision; send FP8 experts by "
                    f"per-expert names with their {self.scale_leaf}"
                )
            if shard not in scales:
                raise ValueError(
                    f"expert {shard[0]}'s {shard[1]} weight arrives in float8 without its "  # type: ignore[index]
                    f"{self.scale_leaf} in the same update"
                )

    @property
    def stages_weights(self) -> bool:
        """fp8: loads go to a high-precision stage; only post-processing writes the parameters."""
        return self.fp8

    # ---- post-processing ----------------------------------------------------------------------------------

    def process_weights_after_loading(self) -> None:
        """Builds the dispatch state of this rank's experts, and (fp8) quantizes the staged rows in place. Raises
        RuntimeError where the live layout places the experts elsewhere than they are (a placement changed without
        moving them)."""
        if self._placement() != self.placement:
            raise RuntimeError(
                "the live config places the experts elsewhere; change the placement through update_config("
                "{'parallel_config': {'expert_placement': ...}}), which moves them"
            )
        device = self.w13_weight.device
        expert_map = torch.full((self.num_experts,), -1, dtype=torch.int64, device=device)
        local = torch.tensor(self.local_experts, dtype=torch.int64, device=device)
        expert_map[local] = torch.arange(len(self.local_experts), device=device)
        self.expert_map = expert_map
        if self.fp8:
            for name, (stage, staged) in self._stages.items():
                param = getattr(self, name)
                regions = [self._rows(_GATE), self._rows(_UP)] if name == "w13_weight" else [(0, self.hidden_size)]
                for slot in staged.any(dim=1).nonzero().flatten().tolist():
                    for start, rows in regions:
                        marks = staged[slot, start : start + rows]
                        if marks.any():
                            assert marks.all(), "a projection is staged whole"  # loads write whole projections
                            self._quantize(param, slot, start, rows, stage[slot, start : start + rows])
            self.discard_stage()

    def _quantize(self, param: nn.Parameter, slot: int, start: int, rows: int, values: torch.Tensor) -> None:
        scale = self.scale_of(param)
        if self.block is None:
            q, s = quantize_per_channel(values)
            scale.data[slot, start : start + rows] = s
        else:
            q, s = quantize_blocks(values, self.block)
            scale.data[slot, start // self.block[0] : -(-(start + rows) // self.block[0])] = s
        param.data[slot, start : start + rows] = q

    def discard_stage(self) -> None:
        if self.fp8:
            self._stages = {}

    # ---- forward ------------------------------------------------------------------------------------------

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, lora: LoRABatch | None = None
    ) -> torch.Tensor:
        """The experts' weighted sum for the tokens `x` routed to `ids` with `weights`, plus the pass's adapters
        `lora` on the experts they adapt."""
        assert self.expert_map is not None, "FusedMoE used before its weights were post-processed"
        if self.deterministic:
            return self._forward_deterministic(x, weights, ids)
        tokens, k = ids.shape
        local = self.expert_map[ids.flatten()] if self.expert_parallel else ids.flatten()
        num_local = len(self.local_experts)
        keyed = torch.where(local >= 0, local, num_local)  # another rank's experts sort last
        order = torch.argsort(keyed, stable=True)
        counts = torch.bincount(keyed, minlength=num_local + 1)[:num_local]
        picked = order[: int(counts.sum())]
        rows = picked // k
        w13, w2 = self._weights(x.dtype, counts)
        if lora is not None and not lora.touches(self.lora_key):
            lora = None
        expert_counts = counts  # every local expert's rows (fp8 keeps only the experts with rows, below)
        if self.fp8:
            counts = counts[counts > 0]
        xs = x[rows]
        h = grouped_mm(xs, w13, counts)
        if lora is not None:
            h = self._add_lora(lora, "w13", xs, h, rows, expert_counts, tokens)
        gate, up = h.split(self.i_local, dim=-1)
        act = F.silu(gate) * up
        out = grouped_mm(act, w2, counts)
        if lora is not None:
            out = self._add_lora(lora, "w2", act, out, rows, expert_counts, tokens)
        combined = torch.zeros(tokens, self.hidden_size, dtype=torch.float32, device=x.device)
        combined.index_add_(0, rows, out.float() * weights.flatten()[picked, None])
        return self.tp.all_reduce(combined).to(x.dtype)

    # this module's name in the model, set where LoRA adapters are enabled (hotswap/lora/manager.py)
    lora_key: str | None = None

    def _add_lora(
        self,
        lora: LoRABatch,
        which: str,
        x: torch.Tensor,
        out: torch.Tensor,
        rows: torch.Tensor,
        counts: torch.Tensor,
        lora_rows: int,
    ) -> torch.Tensor:
        """`out` (the experts' product `which` for rows `x`, grouped by expert as `counts` says; `rows`: each
        one's token, of `lora_rows` in the pass) plus every adapter's expert factors for the tokens it serves."""
        assert self.lora_key is not None  # set with the adapters
        for group in lora.groups:
            pack = group.packs.get(self.lora_key)
            if not isinstance(pack, dict) or which not in pack:
                continue
            shrink, expand = pack[which]  # float32 beside a half-precision model (see LoRABatch._apply_upcast)
            h = grouped_mm(x.to(shrink.dtype), shrink, counts)
            if group.span != (0, int(lora_rows)):  # the adapter's tokens only
                h = h * group.token_mask(rows).to(h.dtype)[:, None]
            out = (out.to(h.dtype) + grouped_mm(h, expand, counts)).to(out.dtype)
        return out

    def _forward_deterministic(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`forward` with batch-invariant products (`ops`, one expert at a time) and a fixed order of sums: each
        token adds its experts' outputs in ascending expert id, one sum per half of the intermediate size that two
        ranks hold, then the halves in rank order (one rank equals two; no expert parallelism, see
        `config.check_deterministic`)."""
        tokens, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        w13, w2 = self._weights(x.dtype, counts)
        if self.tp.size > 1:
            halves = [(0, self.i_local)]
        else:
            first = split(self.intermediate_size, 0, 2)[1]
            halves = [(0, first), (first, self.intermediate_size - first)]
        parts = [torch.zeros(tokens, self.hidden_size, dtype=torch.float32, device=x.device) for _ in halves]
        scale = weights.flatten()
        start, slot = 0, 0
        for n in counts.tolist():
            if n:
                picked = order[start : start + n]
                rows = picked // k
                h = ops.gated_linear(x[rows], w13[slot], deterministic=True)
                for part, (a, width) in zip(parts, halves, strict=True):
                    out = ops.linear(h[:, a : a + width], w2[slot][:, a : a + width], deterministic=True)
                    part.index_add_(0, rows, out.float() * scale[picked, None])
                start += n
            slot += 1 if (n or not self.fp8) else 0  # fp8: `_weights` holds the experts with rows only
        total = parts[0] if len(parts) == 1 else parts[0] + parts[1]
        return self.tp.sum_in_rank_order(total).to(x.dtype)

    def _weights(self, dtype: torch.dtype, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert weights to multiply by: the parameters, or (fp8) the dequantized experts that have rows."""
        if not self.fp8:
            return self.w13_weight, self.w2_weight
        active = counts.nonzero().squeeze(1)
        w13, w2 = self.w13_weight[active], self.w2_weight[active]
        s13, s2 = self.scale_of(self.w13_weight)[active], self.scale_of(self.w2_weight)[active]
        if self.block is not None:
            return dequantize_blocks(w13, s13, self.block, dtype), dequantize_blocks(w2, s2, self.block, dtype)
        return (w13.float() * s13[..., None]).to(dtype), (w2.float() * s2[..., None]).to(dtype)
