"""oneDNN for the linear products torch would hand to its BLAS: packed copies of bf16 weights (the bf16 products'
fast path on CPUs with AVX512-BF16 / AMX), and fp32 products with the weight as it is. Where torch has no bf16
hardware path (AVX2-only CPUs), bf16 products above the small-batch rows run in float32 (`upcast_linear`) where
that measured faster than torch's bf16 `F.linear`.

fp32 (`dense_linear`, `dense_faster`): torch's fp32 `F.linear` on x86 is MKL's sgemm, which on AMD Zen runs 2.5-4x
slower than oneDNN's product on the same plain weight (docs/log.md). No copy is packed: oneDNN reorders the weight
per call, which at these sizes costs about 10 % of what a packed copy saves, and a packed fp32 copy would double
the weights' memory and need packing again after every update. Taken only for a weight shape where oneDNN measured
at least 5 % faster than `F.linear` at both 32 and 256 rows, timed once per shape and process: a CPU where MKL
wins (Intel's, mostly) keeps MKL.

`F.linear` in bf16 reorders its weight into oneDNN's blocked layout on every call; a copy packed once
(`torch.ops.mkldnn._reorder_linear_weight`) and multiplied with `_linear_pointwise` skips that (on the AMX Xeon
of docs/performance.md: the 125M model's LM head at 64 rows 10.3 ms -> 3.7 ms). Both are torch's own oneDNN
paths, bf16 inputs with float32 accumulation.

Where it is taken: bf16 weights on the CPU, autograd off, torch built with oneDNN bf16 support, and only for a
weight shape where the packed product measured at least 5 % faster than `F.linear` at both 1 and 32 rows, on
weights streamed from memory (`faster`, timed once per shape, machine and ISA cap, under whatever cap the process
runs: a CPU where it loses does not take it).

The copy is the module's (`weight_for(module, weight)`), built on first use and dropped whenever the weights may
have changed: a layer's `load_weight` (every load and update writes through it), a rollback, sleep, and user code
run on the model (`drop_all`). A copy also remembers the storage it was packed from, so a weight whose storage
moved is packed again. It costs a second copy of the bf16 weights in memory.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.kernels.measurements import measured

_ATTR = "_hotswap_packed"  # module attribute: a PackedEntry
PackedEntry = tuple[int, torch.Size, torch.Tensor]  # (the weight's data_ptr, its shape, its packed copy)
PACK_ROWS = 32  # the batch size oneDNN is told to pick its blocked layout for (decode batches)


@functools.cache
def supported() -> bool:
    """Whether torch can pack and multiply bf16 weights with oneDNN on this CPU."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return cast(torch.Tensor, torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS))


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the weight `packed` holds; x [..., in] in bf16."""
    return _onednn_linear(x, packed, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product of x [..., in] with `weight` (packed, or a plain [out, in] tensor)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = cast(torch.Tensor, torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], ""))
    return out.view(*x.shape[:-1], out.shape[-1])


def _time_ratio(candidate: Callable[[], object], baseline: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` calls of `candidate` over the fastest of `baseline`'s, the two taking turns (after one
    warm-up call each)."""
    calls = (candidate, baseline)
    best = [float("inf"), float("inf")]
    for fn in calls:
        fn()
    for _ in range(reps):
        for i, fn in enumerate(calls):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0] / best[1]


STREAM_BYTES = 128 << 20  # weights the bf16 gate cycles through: more than a last-level cache holds
MAX_COPIES = 256  # ... in at most this many copies (a small model's weights stay in cache anyway)


@functools.cache
def faster(out_features: int, in_features: int) -> bool:
    """Whether the packed product measured at least 5 % faster than `F.linear` for a bf16 weight of this shape,
    at 1 and at 32 rows (decode batches; the fastest of 5 passes each, in turn). Each pass multiplies by enough
    copies of the weight (STREAM_BYTES, at most MAX_COPIES) that they come from memory, as a model's weights do in a
    decode step: a weight that stays in cache measures the arithmetic alone, and a shape's verdict then flipped from
    process to process. Measured once per machine, ISA cap and thread count: cached with the policy's calibration."""

    def measure() -> dict[int, float]:
        gen = torch.Generator().manual_seed(0)
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(torch.bfloat16)
        copies = [weight.clone() for _ in range(min(MAX_COPIES, -(-STREAM_BYTES // (weight.numel() * 2))))]
        packs = [pack(w) for w in copies]
        ratios = {}
        for rows in (1, PACK_ROWS):
            x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
            ratios[rows] = _time_ratio(
                lambda: [linear(x, p, None) for p in packs],  # noqa: B023 (called at once)
                lambda: [F.linear(x, w) for w in copies],  # noqa: B023
                5,
            )
        return ratios

    return measured("packed_bf16_linear", f"{out_features}x{in_features}", (1, PACK_ROWS), measure)


@functools.cache
def dense_supported() -> bool:
    """Whether torch has oneDNN's linear for plain fp32 weights."""
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN, the fp32 weight [out, in] as it is."""
    return _onednn_linear(x, weight, bias)


DENSE_ROWS = (32, 256)  # the batch sizes oneDNN must win at: decode batches and prefill chunks


@functools.cache
def dense_faster(out_features: int, in_features: int) -> bool:
    """Whether oneDNN's fp32 product measured at least 5 % faster than `F.linear` for a weight of this shape at
    each of DENSE_ROWS (the fastest of 3 calls each, in turn). Measured once per machine, ISA cap and thread count:
    the ratios are cached beside the kernel build with the policy's calibration."""
    if not dense_supported():
        return False

    def measure() -> dict[int, float]:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(out_features, in_features, generator=gen) * 0.02
        ratios = {}
        for rows in DENSE_ROWS:
            x = torch.randn(rows, in_features, generator=gen)
            ratios[rows] = _time_ratio(
                functools.partial(dense_linear, x, weight, None), functools.partial(F.linear, x, weight), 3
            )
        return ratios

    return measured("dense_fp32_linear", f"{out_features}x{in_features}", DENSE_ROWS, measure)


UPCAST_ROWS = 256  # the batch a bf16 product above the small-batch kernels' rows is timed at (prefill chunks)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bf16 tensors computed in float32 (x, the weight and the bias widened, exactly;
    torch's fp32 product; the result rounded back to x's dtype)."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


@functools.cache
def upcast_faster(out_features: int, in_features: int) -> bool:
    """Whether, on a CPU where torch has no oneDNN bf16 (`supported()` False: AVX2-only hosts, where torch's bf16
    `F.linear` runs without bf16 hardware), `upcast_linear` measured at least 5 % faster than `F.linear` for a
    bf16 weight of this shape at UPCAST_ROWS rows (the fastest of 3 calls each, in turn). Cached with the
    calibration, once per machine, ISA cap and thread count."""
    if supported():
        return False

    def measure() -> dict[int, float]:
        gen = torch.Generator().manual_seed(0)
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(torch.bfloat16)
        x = torch.randn(UPCAST_ROWS, in_features, generator=gen).to(torch.bfloat16)
        return {
            UPCAST_ROWS: _time_ratio(
                functools.partial(upcast_linear, x, weight, None), functools.partial(F.linear, x, weight), 3
            )
        }

    return measured("upcast_bf16_linear", f"{out_features}x{in_features}", (UPCAST_ROWS,), measure)


def upcast_applies(x: torch.Tensor, weight: torch.Tensor, above_rows: int) -> bool:
    """Whether `F.linear(x, weight)` runs as `upcast_linear` here: bf16 on the CPU, more than `above_rows` rows (the
    small-batch kernels' range), and measured faster for the weight's shape (`upcast_faster`). The caller checks
    autograd."""
    return (
        x.dtype == weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.dim() == 2
        and x.numel() > above_rows * x.shape[-1]
        and upcast_faster(weight.shape[0], weight.shape[1])
    )


def dense_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `F.linear(x, weight)` goes through oneDNN here: fp32 on the CPU, a 2-D weight, and oneDNN measured
    faster for its shape (`dense_faster`). The caller checks that autograd is not needed."""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and x.shape[-1] == weight.shape[1]
        and dense_faster(weight.shape[0], weight.shape[1])
    )


def weight_for(module: nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """`module`'s packed copy of `weight` where the packed path applies and wins (see the module docstring),
    else None (the caller multiplies by `weight` itself)."""
    if (
        weight.dtype != torch.bfloat16
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or (torch.is_grad_enabled() and weight.requires_grad)
        or not supported()
        or not faster(weight.shape[0], weight.shape[1])
    ):
        return None
    entry: PackedEntry | None = module.__dict__.get(_ATTR)
    if entry is None or entry[0] != weight.data_ptr() or entry[1] != weight.shape:
        entry = (weight.data_ptr(), weight.shape, pack(weight))
        module.__dict__[_ATTR] = entry
    return entry[2]


def drop(module: nn.Module) -> None:
    """Forgets `module`'s packed copy (its weights are about to change, or changed)."""
    module.__dict__.pop(_ATTR, None)


def take(module: nn.Module) -> PackedEntry | None:
    """Removes and returns `module`'s packed copy (None: it has none), to `put` back later (staged weights)."""
    entry: PackedEntry | None = module.__dict__.pop(_ATTR, None)
    return entry


def put(module: nn.Module, entry: PackedEntry | None) -> None:
    """Gives `module` a packed copy `take` returned (None: none); used only if it was packed from the weight's
    present storage."""
    if entry is None:
        module.__dict__.pop(_ATTR, None)
    else:
        module.__dict__[_ATTR] = entry


def drop_all(model: nn.Module) -> None:
    """Forgets every packed copy under `model`."""
    for module in model.modules():
        drop(module)
