"""The kernel facade: plain functions with their torch path's signature and result, each taking its native
kernel where the policy (`policy.py`, decided once per process) chose it and the kernel applies to these inputs
(device, dtype, layout, batch size, no autograd), else computing the same thing with torch ops. Layers call
these and nothing else; they never hold a kernel handle or see None."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F

from hotswap.kernels import native
from hotswap.kernels import packed as packing
from hotswap.kernels.policy import _torch_greedy, _torch_rms_norm, _torch_rotary, _torch_silu_and_mul
from hotswap.kernels.policy import policy as policy  # re-exported: layers and the stack read it here

# From SMALL_BATCH_MIN_ROWS to SMALL_BATCH_ROWS rows (tokens: decode batches, short prefills), the native linear
# kernels stream each weight once instead of re-packing it (hotswap/kernels/linear.cpp). Above that range a BLAS
# GEMM is faster, and below it the BLAS's matrix-vector path.
SMALL_BATCH_MIN_ROWS = 4
SMALL_BATCH_ROWS = 64


def _ops() -> Any:
    return native.ops()


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _rows_fit(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)`, computed in float32 and cast back to x's dtype."""
    if _rows_fit(x) and policy().uses("rms_norm", x.shape[0]):
        return cast(torch.Tensor, _ops().rms_norm(x, weight, eps))
    return _torch_rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x). The sum may be written into `residual` in place: the caller owns
    it and must not need its old value."""
    if _rows_fit(x) and residual.is_contiguous() and policy().uses("add_rms_norm", x.shape[0]):
        return _ops().add_rms_norm(x, residual, weight, eps), residual
    residual = residual + x
    return _torch_rms_norm(residual, weight, eps), residual


def small_batch_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, op: str = "linear") -> bool:
    """Whether the native small-batch kernel `op` ("linear" or "gated_linear") takes this product: chosen by the
    policy, a 2-D float32 CPU `x` of SMALL_BATCH_MIN_ROWS to SMALL_BATCH_ROWS rows with contiguous rows, a
    contiguous weight, no autograd (the kernels have no backward)."""
    return (
        x.dim() == 2
        and SMALL_BATCH_MIN_ROWS <= x.shape[0] <= SMALL_BATCH_ROWS
        and policy().uses(op, x.shape[0])
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.stride(-1) == 1
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        and not _needs_grad(x, weight, bias)
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; equal up to float32 rounding on the native path. `packed`: the weight's
    oneDNN-packed bf16 copy (`packed.weight_for`), used for bf16 inputs without autograd."""
    if packed is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and not _needs_grad(x, bias):
        return packing.linear(x, packed, bias)
    if small_batch_applies(x, weight, bias):
        return cast(torch.Tensor, _ops().small_batch_linear(x, weight, bias))
    if not _needs_grad(x, weight, bias) and packing.dense_applies(x, weight):
        return packing.dense_linear(x, weight, bias)  # fp32 where oneDNN beats the BLAS (kernels/packed.py)
    return F.linear(x, weight, bias)


def gated_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """`silu_and_mul(F.linear(x, weight, bias))` for a [gate; up] weight [2I, K]: on the native path the gate is
    applied as the product is written, so the [T, 2I] projection never reaches memory."""
    if small_batch_applies(x, weight, bias, "gated_linear"):
        return cast(torch.Tensor, _ops().small_batch_gated_linear(x, weight, bias))
    return silu_and_mul(linear(x, weight, bias, packed))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: `F.silu(x[:, :I]) * x[:, I:]`."""
    if (
        x.device.type == "cpu"
        and x.dim() == 2
        and policy().uses("silu_and_mul", x.shape[0])
        and x.stride(-1) == 1
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not _needs_grad(x)
    ):
        return cast(torch.Tensor, _ops().silu_and_mul(x))
    return _torch_silu_and_mul(x)


def rotary_applies(positions: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the native kernels rotate these tokens (`rotary`, and inside `rope_paged_attention`)."""
    return q.device.type == "cpu" and positions.dtype == torch.long and not _needs_grad(q)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, KVH, D] by the float32 cos/sin tables [P, D] at `positions` [T]; returns
    new contiguous tensors."""
    if rotary_applies(positions, q) and policy().uses("rotary", q.shape[0]):
        return cast(tuple[torch.Tensor, torch.Tensor], _ops().rotary(q, k, positions, cos, sin))
    return _torch_rotary(q, k, positions, cos, sin)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes k/v [T, KVH, D] into the paged caches [blocks, block_size, KVH, D] at flat `slot_mapping` slots."""
    if policy().uses("write_kv_cache") and k.device.type == "cpu":
        _ops().write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v)


def paged_attention_available() -> bool:
    """Whether attention runs in the native paged kernels (`paged_attention`, `rope_paged_attention`): then the
    batch needs none of the padded layout the torch path (SDPA) uses."""
    return policy().uses("paged_attention")


def paged_attention(*args: Any) -> torch.Tensor:
    """The native `paged_attention` (q, k_cache, v_cache, block_tables, context_lens, query_lens?, kv_of_q?,
    scale); only where `paged_attention_available()`."""
    return cast(torch.Tensor, _ops().paged_attention(*args))


def rope_paged_attention(*args: Any) -> torch.Tensor:
    """The native `rope_paged_attention`: rotates q/k, writes the cache and attends, in one call (arguments as
    the kernel's); only where `paged_attention_available()` and `rotary_applies`."""
    return cast(torch.Tensor, _ops().rope_paged_attention(*args))


def greedy_native(logits: torch.Tensor) -> bool:
    """Whether `greedy_sample` takes its native kernel for these logits (the sampler's general path, which also
    serves logprobs and seeds, is as fast elsewhere)."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and policy().uses("greedy_sample", len(logits))


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax token [R], its log-probability [R]) per row of float32 `logits` [R, V], the first maximum on
    ties, without materialising the log-softmax."""
    if greedy_native(logits):
        tokens, chosen = _ops().greedy_sample(logits)
        return tokens, chosen
    return _torch_greedy(logits)


def decoder_stack_available(rows: int) -> bool:
    """Whether the native decoder stack (`decoder_layers`) may run the layers on a batch of `rows` tokens (see
    hotswap/worker/decoder_stack)."""
    return policy().uses("decoder_stack", rows)


def decoder_layers(*args: Any) -> torch.Tensor:
    return cast(torch.Tensor, _ops().decoder_layers(*args))
