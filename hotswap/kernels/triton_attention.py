"""Triton kernels for paged attention over the block-structured KV cache: the GPU counterparts of the native CPU
operators in paged_attention.cpp, with their signatures and semantics, so that one facade can call either.

paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale), all on one device:
  q            [T, H, D] contiguous       the new tokens' queries, sequence by sequence
  k/v_cache    [num_blocks, bs, KVH, D]   the paged cache of one layer, contiguous (the new tokens already written)
  block_tables [B, W] int64               block ids of each sequence, in order; only the first
                                          ceil(context_lens[b] / bs) entries are read
  context_lens [B] int64                  keys per sequence, the new tokens included (>= 1)
  query_lens   [B] int64 or None          new tokens per sequence (1 <= query_lens[b] <= context_lens[b], summing to
                                          T); None means one each (T = B). New token j of sequence b sits at position
                                          context_lens[b] - query_lens[b] + j and sees the keys up to it.
  kv_of_q      [H] int64 or None          KV head of each query head; None means h // (H // KVH)
Returns [T, H * D] in q's dtype (float32, bfloat16 or float16, the cache's). Scores and accumulation are float32.

write_kv_cache(k, v [T, KVH, D] with contiguous rows and any token stride, k/v_cache, slot_mapping [T] int64)
copies each token's keys and values to its slot (block * bs + offset) of the cache.

rope_paged_attention(q, k, v, positions, cos, sin, k/v_cache, slot_mapping, block_tables, context_lens, query_lens,
kv_of_q, scale) rotates q and k at `positions` (cos/sin float32 [P, D], rotary.py's half-split layout, each product
rounded to q's dtype as torch rounds it), writes the rotated keys and the values straight into their cache slots,
then attends as paged_attention; q [T, H, D] and k/v need contiguous heads only.

Every argument is checked, its values included (one transfer to the host), before anything is written: bad input
raises ValueError and leaves the cache as it was.

The kernels, and how a decode batch and a longer query are split over programs, are in triton_attention_kernels.py;
the checks in triton_attention_checks.py. Here: the launches (grids, tiles, splits) and the entry points.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton

from hotswap.kernels.triton_attention_checks import (
    Checks,
    Problem,
    check_int64,
    check_kv_write,
    prepare,
    require,
    same_device,
    trusted_values,
)
from hotswap.kernels.triton_attention_kernels import decode_kernel as _decode_kernel
from hotswap.kernels.triton_attention_kernels import extend_kernel as _extend_kernel
from hotswap.kernels.triton_attention_kernels import merge_kernel as _merge_kernel
from hotswap.kernels.triton_attention_kernels import rope_write_kernel as _rope_write_kernel
from hotswap.kernels.triton_attention_kernels import write_kernel as _write_kernel

MIN_SPLIT_KEYS = 256  # a decode split holds at least this many keys: fewer, and merging costs more than it spreads
MAX_SPLITS = 32
ATTENTION_WARPS = 8
_LOG2E = 1.4426950408889634


def _cdiv(a: int, b: int) -> int:
    return int(triton.cdiv(a, b))


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(int(n), 1)))


# ---- launches -----------------------------------------------------------------------------------------------


@functools.cache
def _grouped_heads(num_heads: int, num_kv_heads: int, group: int, device: torch.device) -> torch.Tensor:
    """[KVH, group] int64: row h holds query heads h * H/KVH .. (h + 1) * H/KVH - 1, then -1 (the decode tile's
    rows). Cached: a graph capturing the decode step reads it, never rebuilds it."""
    per_kv = num_heads // num_kv_heads
    columns = torch.arange(group, device=device)
    table = torch.arange(num_kv_heads, device=device)[:, None] * per_kv + columns[None, :]
    return torch.where(columns[None, :] < per_kv, table, torch.full_like(table, -1))


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 elsewhere (Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _device_of(x: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """x's CUDA device made the current one (Triton launches on the current device); nothing elsewhere."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def _check_tuning(block_m: int | None, block_n: int | None, split_keys: int | None) -> None:
    for name, n in (("block_m", block_m), ("block_n", block_n)):
        require(n is None or (n >= 16 and n & (n - 1) == 0), f"{name} must be a power of two >= 16, got {n}")
    require(split_keys is None or split_keys >= 1, f"split_keys must be positive, got {split_keys}")


def _attend(
    p: Problem, values: list[int], block_m: int | None, block_n: int | None, split_keys: int | None
) -> torch.Tensor:
    """Attention of a checked problem; `values` as `Checks.run` returned them."""
    q, k_cache = p.q.contiguous(), p.k_cache
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, width = p.block_tables.shape
    num_kv_heads, bs = k_cache.shape[2], k_cache.shape[1]
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if out.numel() == 0:
        return out
    device = q.device
    d_pad = max(16, _pow2(head_dim))
    exact = q.dtype == torch.float32
    qk_scale = float(p.scale) * _LOG2E
    max_len = values[p.max_len]
    max_query_len = 1 if p.query_lens is None else values[p.max_query_len]
    # the defaults compile for sm_90 without register spills at ATTENTION_WARPS, float32 tiles included
    block_n = block_n or max(16, min(32, 4096 // d_pad))
    if p.kv_of_q is None:
        per_kv = num_heads // num_kv_heads
        kv_index = torch.arange(num_heads, device=device) // per_kv
    else:
        per_kv = values[p.group]
        kv_index = p.kv_of_q
    if max_query_len > 1:
        assert p.query_lens is not None  # max_query_len is 1 without it
        block_m = block_m or (16 if max_query_len <= 16 or d_pad > 128 else 32)
        q_start = torch.cumsum(p.query_lens, 0) - p.query_lens
        grid = (num_seqs, _cdiv(max_query_len, block_m), num_heads)
        _extend_kernel[grid](
            q,
            k_cache,
            p.v_cache,
            p.block_tables,
            p.context_lens,
            p.query_lens,
            q_start,
            kv_index,
            out,
            qk_scale,
            num_heads,
            num_kv_heads,
            head_dim,
            bs,
            width,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            D_PAD=d_pad,
            EXACT=exact,
            num_warps=ATTENTION_WARPS,
        )
        return out
    # decode: the query heads of each KV head, a [group, D] tile (rows of -1 pad it to a power of two >= 16)
    group = max(16, _pow2(per_kv))
    if p.kv_of_q is None:  # consecutive heads per KV head: a table made once per shape (nothing runs per call)
        heads = _grouped_heads(num_heads, num_kv_heads, group, device)
    else:  # bincount reads its input on the host: never under a graph (the trusted mode takes no kv_of_q)
        heads = torch.full((num_kv_heads, group), -1, dtype=torch.int64, device=device)
        order = torch.argsort(kv_index, stable=True)
        counts = torch.bincount(kv_index, minlength=num_kv_heads)
        first = torch.cumsum(counts, 0) - counts
        sorted_kv = kv_index[order]
        heads[sorted_kv, torch.arange(num_heads, device=device) - first[sorted_kv]] = order
    if split_keys is None:
        programs = num_seqs * num_kv_heads
        wanted = min(_cdiv(2 * _sm_count(device), programs), _cdiv(max_len, MIN_SPLIT_KEYS), MAX_SPLITS)
        split_keys = _cdiv(max_len, max(1, wanted))
    split_keys = _cdiv(split_keys, block_n) * block_n  # whole tiles
    num_splits = _cdiv(max_len, split_keys)
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out  # not written
    else:
        part_o = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        p.v_cache,
        p.block_tables,
        p.context_lens,
        heads,
        out,
        part_o,
        part_lse,
        qk_scale,
        num_heads,
        num_kv_heads,
        head_dim,
        bs,
        width,
        split_keys,
        num_splits,
        GROUP=group,
        BLOCK_N=block_n,
        D_PAD=d_pad,
        EXACT=exact,
        DIRECT=direct,
        num_warps=ATTENTION_WARPS,
    )
    if not direct:
        _merge_kernel[(num_tokens, num_heads)](
            part_o,
            part_lse,
            out,
            num_heads,
            head_dim,
            num_splits,
            SPLITS=max(2, _pow2(num_splits)),
            D_PAD=d_pad,
            num_warps=4,
        )
    return out


# ---- entry points -------------------------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    kv_of_q: torch.Tensor | None,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    split_keys: int | None = None,
    max_context: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens q [T, H, D] over the paged cache (see the top of the file); returns
    [T, H * D] in q's dtype. Tuning, each a power of two >= 16 where given: `block_m` new tokens and `block_n` keys
    per tile; `split_keys`, keys per split of a decode batch (rounded up to whole tiles; None: from the lengths and
    the device's multiprocessors). Raises ValueError for bad input.

    `max_context` (decode batches, `query_lens` and `kv_of_q` None): the trusted mode a CUDA graph captures. The
    caller vouches for the values of the metadata (the engine builds them on the host), so none is checked and
    nothing is read back to the host; the grid is sized for `max_context` keys per sequence."""
    require(q.is_contiguous(), "q must be contiguous")
    _check_tuning(block_m, block_n, split_keys)
    checks = Checks(trusted=max_context is not None)
    problem = prepare(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale, checks)
    values = checks.run() if max_context is None else trusted_values(problem, max_context)
    with _device_of(q):
        return _attend(problem, values, block_m, block_n, split_keys)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Copies k/v [T, KVH, D] (contiguous rows, any token stride) into the caches at flat `slot_mapping` slots
    (block * bs + offset). Raises ValueError for bad input, the cache untouched."""
    checks = Checks()
    check_kv_write(k, v, k_cache, v_cache, slot_mapping, checks)
    checks.run()
    row = k_cache.shape[2] * k_cache.shape[3]
    if k.shape[0] == 0 or row == 0:
        return
    block = min(1024, _pow2(row))
    with _device_of(k):
        _write_kernel[(k.shape[0], _cdiv(row, block))](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            v.stride(0),
            row,
            BLOCK=block,
            num_warps=4,
        )


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
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    split_keys: int | None = None,
    max_context: int | None = None,
) -> torch.Tensor:
    """Rotates q [T, H, D] and k [T, KVH, D] at `positions` [T] int64 with cos/sin float32 [P, D], writes the
    rotated keys and v to the cache at `slot_mapping`, then returns paged_attention of the rotated queries (tuning
    as there; `max_context`: paged_attention's trusted mode, positions and slots unchecked too). q, k and v need
    contiguous heads only. Every check runs before the cache is written: bad input raises ValueError and leaves it
    as it was."""
    _check_tuning(block_m, block_n, split_keys)
    checks = Checks(trusted=max_context is not None)
    check_kv_write(k, v, k_cache, v_cache, slot_mapping, checks)
    problem = prepare(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale, checks)
    num_tokens, num_heads, head_dim = q.shape
    require(
        q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], f"bad q/k shapes: {list(q.shape)} and {list(k.shape)}"
    )
    require(q.stride(2) == 1 and q.stride(1) == head_dim, "q and k must have contiguous heads")
    require(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    require(
        cos.dtype == torch.float32
        and sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.dim() == 2
        and cos.shape[1] == head_dim
        and sin.shape == cos.shape,
        f"cos/sin must be contiguous float32 [P, {head_dim}], got {cos.dtype} {list(cos.shape)} and "
        f"{sin.dtype} {list(sin.shape)}",
    )
    check_int64(positions, num_tokens, "positions", "[T]")
    same_device(q, positions, cos, sin, k_cache)
    if not checks.trusted:
        checks.fail_if(
            ((positions < 0) | (positions >= cos.shape[0])).any(),
            f"position out of range of the cos/sin table ({cos.shape[0]})",
        )
    values = checks.run() if max_context is None else trusted_values(problem, max_context)
    q_rot = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    num_kv_heads = k.shape[1]
    with _device_of(q):
        if num_tokens > 0 and head_dim > 0:
            half = head_dim // 2
            block_h = min(_pow2(max(num_heads, num_kv_heads)), max(1, 2048 // _pow2(half)))
            q_blocks = _cdiv(num_heads, block_h)
            _rope_write_kernel[(num_tokens, q_blocks + _cdiv(num_kv_heads, block_h))](
                q,
                k,
                v,
                positions,
                cos,
                sin,
                q_rot,
                k_cache,
                v_cache,
                slot_mapping,
                q.stride(0),
                k.stride(0),
                v.stride(0),
                num_heads,
                num_kv_heads,
                head_dim,
                half,
                q_blocks,
                BLOCK_H=block_h,
                HALF_PAD=_pow2(half),
                num_warps=4,
                enable_fp_fusion=False,  # no fused multiply-add, as torch rounds
            )
        return _attend(dataclasses.replace(problem, q=q_rot), values, block_m, block_n, split_keys)
