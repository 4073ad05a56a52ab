"""The kernel facade: plain functions with their torch path's signature and result, each taking its native
kernel where the policy (`policy.py`, decided once per process) chose it and the kernel applies to these inputs
(device, dtype, layout, batch size, no autograd), else computing the same thing with torch ops. Layers call
these and nothing else; they never hold a kernel handle or see None.

Deterministic mode is an argument (`deterministic=`), never ambient: a layer is built with it
(`hotswap.model.settings.LayerSettings`) and passes it to every call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hotswap.kernels import native
from hotswap.kernels import packed as packing
from hotswap.kernels.exact import exact as exact  # re-exported: layers wrap their own kernels in it
from hotswap.kernels.exact import needs_grad as _needs_grad
from hotswap.kernels.exact import product as _product
from hotswap.kernels.native import NativeOps
from hotswap.kernels.policy import (
    KernelPolicy,
    _torch_greedy,
    _torch_rms_norm,
    _torch_rotary,
    _torch_silu_and_mul,
    finite_check_faster,
    scatter_faster,
    stream_copy_faster,
)
from hotswap.kernels.policy import policy as policy  # re-exported: layers and the stack read it here

# From SMALL_BATCH_MIN_ROWS to SMALL_BATCH_ROWS rows (tokens: decode batches, short prefills), the native linear
# kernels stream each weight once instead of re-packing it (hotswap/kernels/linear.cpp). Above that range a BLAS
# GEMM is faster, and below it the BLAS's matrix-vector path.
SMALL_BATCH_MIN_ROWS = 4
SMALL_BATCH_ROWS = 64


def _ops() -> NativeOps | None:
    return native.ops()


def _kernels() -> NativeOps:
    """The native kernels, where the caller's path takes them (the policy chose them, or deterministic mode, whose
    user checked `require_native()`)."""
    kernels = _ops()
    if kernels is None:
        raise RuntimeError("the native kernels are not available (see `require_native`)")
    return kernels


# ---- deterministic mode -----------------------------------------------------------------------------------
# With `deterministic=True` every product, norm, activation and attention takes one path whatever the batch: the
# native kernels, which compute each output element from its own row alone, in a fixed order (no split of a
# reduction that depends on the batch size, the thread count or the neighbours). See docs/determinism.md. Whoever
# turns it on checks `require_native()` first (the model runner, the trainer's forward).


def require_native() -> None:
    """Raises RuntimeError naming the cause when the native kernels (which deterministic mode runs on) are not
    available."""
    if _ops() is None:
        why = "HOTSWAP_NATIVE_KERNELS turns them off" if not native.enabled() else "they failed to build (see the log)"
        raise RuntimeError(f"deterministic mode runs on hotswap's native kernels, and {why}")


def _canonical(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the batch-invariant product (the native small-batch kernel at any row count) takes these
    inputs: float32 CPU tensors, x 2-D, rows of x and of the weight contiguous."""
    return (
        x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and (bias is None or bias.is_contiguous())
    )


def _det_product(
    kernel: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """A product on deterministic mode's one path: x as rows ([..., K] flattened, made contiguous where needed),
    the weight with contiguous rows. Raises RuntimeError for inputs that path cannot take (another dtype or
    device) rather than computing them another way."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1 or (weight.shape[0] > 1 and weight.stride(0) < weight.shape[1]):
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if not _canonical(rows, weight, bias) or (bias is not None and bias.dtype != torch.float32):
        raise RuntimeError(
            f"deterministic mode multiplies float32 CPU tensors; got x {x.dtype} on {x.device.type}, "
            f"weight {weight.dtype} on {weight.device.type}"
        )
    if reference is F.linear:  # its gradient needs no second product
        out = _product(kernel, rows, weight, bias)
    else:
        out = exact(kernel, reference, rows, weight, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def _torch_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _torch_silu_and_mul(F.linear(x, weight, bias))


def _rows_fit(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, deterministic: bool = False) -> torch.Tensor:
    """`weight * x / rms(x)`, computed in float32 and cast back to x's dtype."""
    if deterministic and x.device.type == "cpu" and x.dim() >= 2:
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # per-head norms (q/k) come as [T, heads, D] views
        return exact(_kernels().rms_norm, _torch_rms_norm, rows, weight, eps).view(x.shape)
    if _rows_fit(x) and policy().uses("rms_norm", x.shape[0]):
        return _kernels().rms_norm(x, weight, eps)
    return _torch_rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, deterministic: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x). The sum may be written into `residual` in place: the caller owns
    it and must not need its old value."""
    if deterministic:
        if _rows_fit(x) and residual.is_contiguous() and not _needs_grad(x, residual, weight):
            return _kernels().add_rms_norm(x, residual, weight, eps), residual
        residual = residual + x  # one addition per element in float32, as the kernel's
        return rms_norm(residual, weight, eps, deterministic=True), residual
    if _rows_fit(x) and residual.is_contiguous() and policy().uses("add_rms_norm", x.shape[0]):
        return _kernels().add_rms_norm(x, residual, weight, eps), residual
    residual = residual + x
    return _torch_rms_norm(residual, weight, eps), residual


def small_batch_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, op: str = "linear") -> bool:
    """Whether the native small-batch kernel `op` ("linear" or "gated_linear") takes this product: chosen by the
    policy, a 2-D CPU `x` with contiguous rows, float32 of SMALL_BATCH_MIN_ROWS to SMALL_BATCH_ROWS rows or
    bfloat16 of 1 to SMALL_BATCH_ROWS (linear_bf16.cpp), a contiguous weight and bias of x's dtype, no autograd
    (the kernels have no backward)."""
    return (
        x.dim() == 2
        and (1 if x.dtype == torch.bfloat16 else SMALL_BATCH_MIN_ROWS) <= x.shape[0] <= SMALL_BATCH_ROWS
        and policy().uses(op, x.shape[0])
        and x.dtype == weight.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
        and x.stride(-1) == 1
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and not _needs_grad(x, weight, bias)
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; equal up to float32 rounding on the native path. `packed`: the weight's
    oneDNN-packed bf16 copy (`packed.weight_for`), used for bf16 inputs without autograd."""
    if deterministic:
        return _det_product(_kernels().small_batch_linear, F.linear, x, weight, bias)
    if small_batch_applies(x, weight, bias):
        return _kernels().small_batch_linear(x, weight, bias)
    if packed is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and not _needs_grad(x, bias):
        return packing.linear(x, packed, bias)
    if not _needs_grad(x, weight, bias) and packing.dense_applies(x, weight):
        return packing.dense_linear(x, weight, bias)  # fp32 where oneDNN beats the BLAS (kernels/packed.py)
    if not _needs_grad(x, weight, bias) and packing.upcast_applies(x, weight, SMALL_BATCH_ROWS):
        return packing.upcast_linear(x, weight, bias)  # bf16 without bf16 hardware in torch (kernels/packed.py)
    return F.linear(x, weight, bias)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, split: int) -> torch.Tensor:
    """Deterministic mode's row-parallel product on one rank: `x[:, :split] · weight[:, :split]ᵀ` plus
    `x[:, split:] · weight[:, split:]ᵀ`, each summed from zero, then the bias (the bits two ranks produce), in one
    native call."""

    def kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _kernels().small_batch_linear(x, weight, bias, split)

    return _det_product(kernel, F.linear, x, weight, bias)


def gated_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """`silu_and_mul(F.linear(x, weight, bias))` for a [gate; up] weight [2I, K]: on the native path the gate is
    applied as the product is written, so the [T, 2I] projection never reaches memory."""
    if deterministic:
        return _det_product(_kernels().small_batch_gated_linear, _torch_gated, x, weight, bias)
    if small_batch_applies(x, weight, bias, "gated_linear"):
        return _kernels().small_batch_gated_linear(x, weight, bias)
    return silu_and_mul(linear(x, weight, bias, packed))


def silu_and_mul(x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """[T, 2I] -> [T, I]: `F.silu(x[:, :I]) * x[:, I:]`."""
    if deterministic and x.device.type == "cpu":
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = exact(_kernels().silu_and_mul, _torch_silu_and_mul, rows)
        return out.view(*x.shape[:-1], out.shape[-1])
    if (
        x.device.type == "cpu"
        and x.dim() == 2
        and policy().uses("silu_and_mul", x.shape[0])
        and x.stride(-1) == 1
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not _needs_grad(x)
    ):
        return _kernels().silu_and_mul(x)
    return _torch_silu_and_mul(x)


def sigmoid(x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """`torch.sigmoid(x)`; in deterministic mode (float32 on the CPU) the native kernel, whose result for an
    element does not depend on its place in the tensor."""
    if deterministic and x.device.type == "cpu" and x.dtype == torch.float32:
        return exact(_kernels().sigmoid, torch.sigmoid, x)
    return torch.sigmoid(x)


def rotary_applies(positions: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the native kernels rotate these tokens (`rotary`, and inside `rope_paged_attention`)."""
    return q.device.type == "cpu" and positions.dtype == torch.long and not _needs_grad(q)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, KVH, D] by the float32 cos/sin tables [P, D] at `positions` [T]; returns
    new contiguous tensors."""
    if deterministic and q.device.type == "cpu" and positions.dtype == torch.long:
        return exact(_kernels().rotary, _torch_rotary, q, k, positions, cos, sin)
    if rotary_applies(positions, q) and policy().uses("rotary", q.shape[0]):
        return _kernels().rotary(q, k, positions, cos, sin)
    return _torch_rotary(q, k, positions, cos, sin)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes k/v [T, KVH, D] into the paged caches [blocks, block_size, KVH, D] at flat `slot_mapping` slots."""
    if policy().uses("write_kv_cache") and k.device.type == "cpu":
        _kernels().write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v)


def paged_attention_available(deterministic: bool = False) -> bool:
    """Whether attention runs in the native paged kernels (`paged_attention`, `rope_paged_attention`): then the
    batch needs none of the padded layout the torch path (SDPA) uses. Always in deterministic mode (its one
    attention path)."""
    return deterministic or policy().uses("paged_attention")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    kv_of_q: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The native `paged_attention`; only where `paged_attention_available()`."""
    return _kernels().paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale)


def rope_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    kv_of_q: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The native `rope_paged_attention`: rotates q/k, writes the cache and attends, in one call; only where
    `paged_attention_available()` and `rotary_applies`."""
    return _kernels().rope_paged_attention(
        q,
        k,
        v,
        positions,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        block_tables,
        context_lens,
        query_lens,
        kv_of_q,
        scale,
    )


@dataclass(frozen=True)
class PagedKernels:
    """One backend's paged attention: `paged` takes the arguments of the native `paged_attention`, `rope` those of the
    native `rope_paged_attention` (rotary, cache write and attention in one call) where `rotates(positions, q)`."""

    name: str
    paged: Callable[..., torch.Tensor]
    rope: Callable[..., torch.Tensor]

    def rotates(self, positions: torch.Tensor, q: torch.Tensor) -> bool:
        if self.name == "native":
            return rotary_applies(positions, q)
        return positions.dtype == torch.long and not _needs_grad(q)


NATIVE_ATTENTION = PagedKernels("native", paged_attention, rope_paged_attention)


def paged_kernels(backend: str, device: torch.device, deterministic: bool = False) -> PagedKernels | None:
    """The paged attention a model on `device` runs with `backend` ("auto": the native kernels on the CPU where
    the policy takes them, the Triton kernels on CUDA where triton imports; "native", "triton"; "torch": None, the
    padded SDPA path), a pair `device.check_attention_backend` accepted. Raises ValueError where the backend asked
    for is not available here."""
    if backend == "torch":
        return None
    if backend == "native" or (backend == "auto" and device.type == "cpu"):
        if paged_attention_available(deterministic):
            return NATIVE_ATTENTION
        if backend == "native":
            raise ValueError(
                "attention_backend='native': the native kernels are not available here (not built, "
                "turned off, or not taken by the kernel policy); use 'auto'"
            )
        return None
    try:
        from hotswap.kernels import triton_attention
    except ImportError as err:
        if backend == "triton":
            raise ValueError(f"attention_backend='triton' needs triton installed ({err})") from None
        return None
    return PagedKernels("triton", triton_attention.paged_attention, triton_attention.rope_paged_attention)


def greedy_native(logits: torch.Tensor, deterministic: bool = False) -> bool:
    """Whether `greedy_sample` takes its native kernel for these logits (the sampler's general path, which also
    serves logprobs and seeds, is as fast elsewhere). Never in deterministic mode: every row's logprob is then
    the general path's log-softmax, whatever the other rows ask."""
    if deterministic:
        return False
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and policy().uses("greedy_sample", len(logits))


def greedy_sample(logits: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax token [R], its log-probability [R]) per row of float32 `logits` [R, V], the first maximum on
    ties, without materialising the log-softmax."""
    if greedy_native(logits, deterministic):
        tokens, chosen = _kernels().greedy_sample(logits)
        return tokens, chosen
    return _torch_greedy(logits)


def decoder_stack_available(rows: int, deterministic: bool = False) -> bool:
    """Whether the native decoder stack (`decoder_layers`) may run the layers on a batch of `rows` tokens (see
    hotswap/worker/decoder_stack). Deterministic mode: at any row count, with every product native."""
    return deterministic or policy().uses("decoder_stack", rows)


def decoder_layers(
    x: torch.Tensor,
    positions: torch.Tensor,
    layers: Sequence[torch.Tensor | None],
    k_caches: Sequence[torch.Tensor | None],
    v_caches: Sequence[torch.Tensor | None],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    kv_of_q: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    eps: float,
    final_norm: torch.Tensor,
    native_linear: bool,
    native_gated: bool,
    native_silu: bool,
    o_split: int,
    down_split: int,
    lora: Sequence[torch.Tensor | None],
    lora_rows: Sequence[int],
    onednn: Sequence[bool],
) -> torch.Tensor:
    """The native decoder stack (decoder.cpp; arguments as `NativeOps.decoder_layers`); only where
    `decoder_stack_available`."""
    return _kernels().decoder_layers(
        x,
        positions,
        layers,
        k_caches,
        v_caches,
        slot_mapping,
        block_tables,
        context_lens,
        query_lens,
        kv_of_q,
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        eps,
        final_norm,
        native_linear,
        native_gated,
        native_silu,
        o_split,
        down_split,
        lora,
        lora_rows,
        onednn,
    )


# ---- copies of weights into place -------------------------------------------------------------------------
# A weight update writes every weight once, far more bytes than the caches hold: streaming stores skip reading
# each destination line before writing it (hotswap/kernels/stream_copy.cpp). A copy below this size is not worth
# the op's call (and its destination is the likeliest to be cached, where ordinary stores win).
STREAM_COPY_MIN_BYTES = 256 << 10


def stream_copy_applies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `copy_(dst, src)` takes the streaming-store kernel: CPU tensors of one dtype and shape, both
    contiguous, not overlapping, at least STREAM_COPY_MIN_BYTES, no autograd, and the policy takes it (native mode:
    always; auto: where `policy.stream_copy_faster` measured it faster)."""
    return _stream_kernel(dst, src) is not None


def _stream_kernel(dst: torch.Tensor, src: torch.Tensor) -> NativeOps | None:
    nbytes = dst.nbytes
    if (
        nbytes < STREAM_COPY_MIN_BYTES
        or dst.dtype != src.dtype
        or dst.shape != src.shape
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or not dst.is_contiguous()
        or not src.is_contiguous()
        or _needs_grad(dst, src)
    ):
        return None
    if dst.data_ptr() < src.data_ptr() + nbytes and src.data_ptr() < dst.data_ptr() + nbytes:
        return None
    return _gate("stream_copy", stream_copy_faster)


_GATES: dict[
    tuple[str, KernelPolicy, int], NativeOps | None
] = {}  # (gate, policy, threads) -> the kernels, or None: each decided once


def _gate(name: str, faster: Callable[[], bool]) -> NativeOps | None:
    """The native kernels if a measured native path is taken under the current policy, else None: never in torch
    mode or without the build, always in native mode, where `faster()` (measured once, cached) says so in auto
    mode."""
    current = policy()
    key = (name, current, torch.get_num_threads())
    if key not in _GATES:
        kernels = _ops() if current.mode != "torch" else None
        _GATES[key] = kernels if kernels is not None and (current.mode == "native" or faster()) else None
    return _GATES[key]


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)`, byte for byte the same result: through streaming stores where `stream_copy_applies`, else
    torch's copy (which also casts and broadcasts). Returns `dst`."""
    kernels = _stream_kernel(dst, src)
    if kernels is None:
        return dst.copy_(src)
    kernels.stream_copy_(dst, src)
    return dst


def scatter_(flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`flat.index_copy_(0, indices, values)` for a 1-D `flat` and int64 `indices` already checked to lie in
    range: the native scatter (requests each write's cache line ahead, hotswap/kernels/scatter.cpp) for a
    contiguous CPU `flat` of 2, 4 or 8-byte elements and `values` of its dtype, no autograd, where the policy takes
    it (native mode: always; auto: where `policy.scatter_faster` measured it faster); else `index_copy_`. A repeated
    index gets one of its values, either way. Returns `flat`."""
    if (
        flat.device.type == "cpu" == indices.device.type == values.device.type
        and flat.dim() == 1
        and flat.is_contiguous()
        and flat.element_size() in (2, 4, 8)
        and values.dtype == flat.dtype
        and indices.dtype == torch.int64
        and not _needs_grad(flat, values)
    ):
        kernels = _gate("scatter", scatter_faster)
        if kernels is not None:
            kernels.scatter_(flat, indices.contiguous(), values.contiguous())
            return flat
    return flat.index_copy_(0, indices, values)


def max_magnitude_bits(tensors: list[torch.Tensor]) -> list[int] | None:
    """For each tensor (contiguous CPU float32, bfloat16 or float16), the largest |x| bit pattern (sign cleared;
    NaN and Inf above every finite value), read in one pass over all of them (hotswap/kernels/magnitudes.cpp),
    where the policy takes it (native mode: always; auto: where `policy.finite_check_faster` measured it faster
    than a check per tensor); None where it does not (the caller checks each tensor with torch)."""
    if not tensors:
        return []
    kernels = _gate("finite_check", finite_check_faster)
    if kernels is None:
        return None
    bits: list[int] = kernels.max_magnitude_bits(tensors).tolist()
    return bits
