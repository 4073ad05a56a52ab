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

Kernels: a decode batch (one new token per sequence) runs split-KV ("flash decoding"): one program per (sequence,
KV head, split of its keys) scores the query heads of that KV head together, a [GROUP, D] tile (GROUP a power of two
>= 16, its spare rows masked) against tiles of BLOCK_N keys gathered through the block table, with an online
softmax; a second kernel merges the splits by their log-sum-exp. A split holds at least MIN_SPLIT_KEYS keys, and
there are as many (up to MAX_SPLITS) as bring the programs to about twice the device's multiprocessors. Longer
queries run one program per (sequence, block of BLOCK_M new tokens, query head) over the sequence's keys with the
causal mask. Tiles enter the dots as float32 (Triton's interpreter, which runs the tests, multiplies no 16-bit
tiles): exact ("ieee") for a float32 cache; "tf32" for a 16-bit one, which holds bfloat16 and float16 values
exactly, with the probabilities rounded to float16 before they weight the values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_SPLIT_KEYS = 256  # a decode split holds at least this many keys: fewer, and merging costs more than it spreads
MAX_SPLITS = 32
ATTENTION_WARPS = 8
_LOG2E = 1.4426950408889634
_NEG = tl.constexpr(-1.0e30)  # the score of a masked key: finite, so that a row with every key masked stays finite


def _jit(fn: Any) -> Any:
    """triton.jit, typed for the checker (triton ships no annotations)."""
    return triton.jit(fn)


def _cdiv(a: int, b: int) -> int:
    return int(triton.cdiv(a, b))


def _pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(int(n), 1)))


# ---- kernels ------------------------------------------------------------------------------------------------


@_jit
def _kv_offsets(
    tables_ptr: tl.tensor,
    seq: tl.tensor,
    table_width: tl.tensor,
    pos: tl.tensor,
    kmask: tl.tensor,
    block_size: tl.tensor,
    kv_row: tl.tensor,
    kvh: tl.tensor,
    head_dim: tl.tensor,
    d: tl.tensor,
) -> tl.tensor:
    """[BLOCK_N, D_PAD] element offsets into a cache of KV head `kvh` at sequence `seq`'s key positions `pos`,
    through its block table (positions outside `kmask` read block 0, and are masked by the caller)."""
    block = tl.load(tables_ptr + seq * table_width + pos // block_size, mask=kmask, other=0)
    return (block * block_size + pos % block_size)[:, None] * kv_row + kvh * head_dim + d[None, :]


@_jit
def _dot(a: tl.tensor, b: tl.tensor, EXACT: tl.constexpr) -> tl.tensor:
    """a @ b of float32 tiles: IEEE products where EXACT, else tf32 (exact for 16-bit inputs widened to float32)."""
    if EXACT:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32")


@_jit
def _weights(p: tl.tensor, EXACT: tl.constexpr) -> tl.tensor:
    """The probabilities as they weight the values: as they are for a float32 cache, else rounded to nearest
    float16, which tf32 holds exactly (what a tf32 dot does to wider values is the hardware's)."""
    if EXACT:
        return p
    else:
        return p.to(tl.float16).to(tl.float32)


@_jit
def _decode_kernel(
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    tables_ptr: tl.tensor,
    lens_ptr: tl.tensor,
    heads_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_o_ptr: tl.tensor,
    part_lse_ptr: tl.tensor,
    qk_scale: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    table_width: int,
    split_keys: int,
    num_splits: int,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    EXACT: tl.constexpr,
    DIRECT: tl.constexpr,
) -> None:
    """Program (sequence, KV head, split): the query heads heads_ptr[kvh, :GROUP] (-1: none) of the sequence's one
    new token over keys [split * split_keys, +split_keys) of its context, in tiles of BLOCK_N keys. DIRECT (one
    split): writes the output rows; else each head's normalised partial output and its log2-sum-exp."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    start = split * split_keys
    end = tl.minimum(start + split_keys, ctx)
    head = tl.load(heads_ptr + kvh * GROUP + tl.arange(0, GROUP))
    live = head >= 0
    d = tl.arange(0, D_PAD)
    dmask = d < head_dim
    row = (seq.to(tl.int64) * num_heads + head) * head_dim  # each head's row in q and in the output
    q = tl.load(q_ptr + row[:, None] + d[None, :], mask=live[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    kv_row = num_kv_heads * head_dim
    m_i = tl.full([GROUP], _NEG, tl.float32)
    l_i = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        kmask = pos < end
        offs = _kv_offsets(tables_ptr, seq, table_width, pos, kmask, block_size, kv_row, kvh, head_dim, d)
        tile_mask = kmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=tile_mask, other=0.0).to(tl.float32)
        s = _dot(q, tl.trans(k), EXACT) * qk_scale
        s = tl.where(kmask[None, :], s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs, mask=tile_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + _dot(_weights(p, EXACT), v, EXACT)
        m_i = m_new
    has = l_i > 0.0
    denom = tl.where(has, l_i, 1.0)
    o = acc / denom[:, None]
    if DIRECT:
        tl.store(
            out_ptr + row[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=live[:, None] & dmask[None, :]
        )
    else:
        part = (seq.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_o_ptr + part[:, None] * head_dim + d[None, :], o, mask=live[:, None] & dmask[None, :])
        tl.store(part_lse_ptr + part, tl.where(has, m_i + tl.log2(denom), float("-inf")), mask=live)


@_jit
def _merge_kernel(
    part_o_ptr: tl.tensor,
    part_lse_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_heads: int,
    head_dim: int,
    num_splits: int,
    SPLITS: tl.constexpr,
    D_PAD: tl.constexpr,
) -> None:
    """Program (token, head): the output row from the splits' partial outputs, weighted by 2^(lse - max lse)."""
    row = tl.program_id(0).to(tl.int64) * num_heads + tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    smask = sp < num_splits
    d = tl.arange(0, D_PAD)
    dmask = d < head_dim
    lse = tl.load(part_lse_ptr + row * num_splits + sp, mask=smask, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, 0))  # split 0 always holds keys: the max is finite
    o = tl.load(
        part_o_ptr + (row * num_splits + sp)[:, None] * head_dim + d[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    res = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * head_dim + d, res.to(out_ptr.dtype.element_ty), mask=dmask)


@_jit
def _extend_kernel(
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    tables_ptr: tl.tensor,
    lens_ptr: tl.tensor,
    query_lens_ptr: tl.tensor,
    q_start_ptr: tl.tensor,
    kv_index_ptr: tl.tensor,
    out_ptr: tl.tensor,
    qk_scale: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    table_width: int,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    EXACT: tl.constexpr,
) -> None:
    """Program (sequence, block of BLOCK_M new tokens, query head): causal attention of those tokens over the
    sequence's keys up to the block's last position, in tiles of BLOCK_N keys."""
    seq = tl.program_id(0)
    mblk = tl.program_id(1)
    head = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    qlen = tl.load(query_lens_ptr + seq).to(tl.int32)
    first = tl.load(q_start_ptr + seq)
    kvh = tl.load(kv_index_ptr + head)
    j = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = j < qlen
    qpos = ctx - qlen + j
    d = tl.arange(0, D_PAD)
    dmask = d < head_dim
    row = ((first + j) * num_heads + head) * head_dim
    qr_mask = rmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + row[:, None] + d[None, :], mask=qr_mask, other=0.0).to(tl.float32)
    # keys seen by the block's last new token; none where the block starts past this sequence's new tokens
    hi = tl.where(mblk * BLOCK_M < qlen, tl.minimum(ctx, ctx - qlen + (mblk + 1) * BLOCK_M), 0)
    kv_row = num_kv_heads * head_dim
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        kmask = pos < hi
        offs = _kv_offsets(tables_ptr, seq, table_width, pos, kmask, block_size, kv_row, kvh, head_dim, d)
        tile_mask = kmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=tile_mask, other=0.0).to(tl.float32)
        s = _dot(q, tl.trans(k), EXACT) * qk_scale
        s = tl.where(kmask[None, :] & (pos[None, :] <= qpos[:, None]), s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs, mask=tile_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + _dot(_weights(p, EXACT), v, EXACT)
        m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=qr_mask)


@_jit
def _rotate(a: tl.tensor, b: tl.tensor, c: tl.tensor, s: tl.tensor, DTYPE: tl.constexpr) -> tl.tensor:
    """a * c + b * s with each product, and the sum, rounded to DTYPE (as torch computes it in DTYPE)."""
    return ((a * c).to(DTYPE).to(tl.float32) + (b * s).to(DTYPE).to(tl.float32)).to(DTYPE)


@_jit
def _rotate_heads(
    src: tl.tensor,
    dst: tl.tensor,
    mask: tl.tensor,
    half: int,
    c0: tl.tensor,
    c1: tl.tensor,
    s0: tl.tensor,
    s1: tl.tensor,
    DTYPE: tl.constexpr,
) -> None:
    """Rotates the heads at `src` (pointers to their first halves) into `dst`: rotate_half's layout."""
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, _rotate(a, -b, c0, s0, DTYPE), mask=mask)
    tl.store(dst + half, _rotate(b, a, c1, s1, DTYPE), mask=mask)


@_jit
def _rope_write_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    positions_ptr: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    q_out_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    q_stride: int,
    k_stride: int,
    v_stride: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    half: int,
    q_blocks: int,
    BLOCK_H: tl.constexpr,
    HALF_PAD: tl.constexpr,
) -> None:
    """Program (token, block of BLOCK_H heads): blocks below q_blocks rotate query heads into q_out [T, H, D];
    the others rotate KV heads of k into the token's cache slot and copy the same heads of v to theirs. (No name is
    assigned in both branches: Triton would merge it, and it would need one type in both.)"""
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + t)
    dd = tl.arange(0, HALF_PAD)
    dmask = dd < half
    table = pos * head_dim + dd
    # the table's entries rounded to q's dtype first, as torch's rotary casts them
    c0 = tl.load(cos_ptr + table, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    c1 = tl.load(cos_ptr + table + half, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    s0 = tl.load(sin_ptr + table, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table + half, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
    if blk < q_blocks:
        q_heads = blk * BLOCK_H + tl.arange(0, BLOCK_H)
        q_cols = q_heads[:, None] * head_dim + dd[None, :]
        _rotate_heads(
            q_ptr + t * q_stride + q_cols,
            q_out_ptr + t * num_heads * head_dim + q_cols,
            (q_heads < num_heads)[:, None] & dmask[None, :],
            half,
            c0,
            c1,
            s0,
            s1,
            dtype,
        )
    else:
        kv_heads = (blk - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        kv_mask = (kv_heads < num_kv_heads)[:, None] & dmask[None, :]
        kv_cols = kv_heads[:, None] * head_dim + dd[None, :]
        slot_row = tl.load(slots_ptr + t) * (num_kv_heads * head_dim)
        _rotate_heads(
            k_ptr + t * k_stride + kv_cols, k_cache_ptr + slot_row + kv_cols, kv_mask, half, c0, c1, s0, s1, dtype
        )
        v_src = v_ptr + t * v_stride + kv_cols
        tl.store(v_cache_ptr + slot_row + kv_cols, tl.load(v_src, mask=kv_mask), mask=kv_mask)
        tl.store(v_cache_ptr + slot_row + kv_cols + half, tl.load(v_src + half, mask=kv_mask), mask=kv_mask)


@_jit
def _write_kernel(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    k_stride: int,
    v_stride: int,
    row: int,
    BLOCK: tl.constexpr,
) -> None:
    """Program (token, chunk of BLOCK elements of its KVH * D row): copies k's and v's chunk to the token's slot."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row
    dst = tl.load(slots_ptr + t) * row + offs
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * k_stride + offs, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * v_stride + offs, mask=mask), mask=mask)


# ---- checks -------------------------------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class _Checks:
    """Checks of tensor values and the sizes read with them, brought to the host in one transfer."""

    def __init__(self, trusted: bool = False) -> None:
        self.trusted = trusted  # values are not checked (trusted mode: see paged_attention's `max_context`)
        self._flags: list[tuple[torch.Tensor, str]] = []
        self._reads: list[torch.Tensor] = []

    def fail_if(self, flag: torch.Tensor, message: str) -> None:
        """`message` is raised where `flag` (a one-element tensor) is true; the first one added wins."""
        self._flags.append((flag, message))

    def read(self, value: torch.Tensor) -> int:
        """Registers a one-element integer tensor; returns its index in what `run` returns."""
        self._reads.append(value)
        return len(self._reads) - 1

    def run(self) -> list[int]:
        """Raises ValueError for the first failed check; returns the values `read` registered."""
        items = [flag for flag, _ in self._flags] + self._reads
        if not items:
            return []
        got = torch.stack([x.reshape(()).to(torch.int64) for x in items]).tolist()
        for (_, message), failed in zip(self._flags, got[: len(self._flags)], strict=True):
            _require(not failed, message)
        return [int(x) for x in got[len(self._flags) :]]


def _trusted_values(p: _Problem, max_context: int) -> list[int]:
    """What `_Checks.run` would return in trusted mode: the longest context only (`_prepare` took only a decode
    batch without a head map)."""
    _require(max_context >= 1, f"max_context must be positive, got {max_context}")
    return [max_context]


def _same_device(*tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    _require(len(devices) <= 1, f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")


def _int64(x: torch.Tensor, numel: int, name: str, shape: str) -> None:
    _require(
        x.dtype == torch.int64 and x.is_contiguous() and x.numel() == numel,
        f"{name} must be contiguous int64 {shape}, got {x.dtype} {list(x.shape)}",
    )


def _check_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    checks: _Checks,
) -> None:
    """write_kv_cache's checks; the slots' range is added to `checks`."""
    _require(
        k_cache.dim() == 4 and k_cache.is_contiguous() and v_cache.shape == k_cache.shape and v_cache.is_contiguous(),
        "caches must be contiguous [num_blocks, bs, KVH, D]",
    )
    _require(
        k.dim() == 3 and k.shape == v.shape and k.shape[1:] == k_cache.shape[2:],
        f"k and v must be [T, KVH, D] matching the cache {list(k_cache.shape)}, got {list(k.shape)} and "
        f"{list(v.shape)}",
    )
    _require(
        k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(2) == 1 and v.stride(1) == v.shape[2],
        "k and v must have contiguous rows (any token stride)",
    )
    _require(k_cache.dtype in DTYPES, f"the cache must be one of {DTYPES}, got {k_cache.dtype}")
    _require(
        k.dtype == v.dtype == v_cache.dtype == k_cache.dtype,
        f"dtype mismatch: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype} and {v_cache.dtype}",
    )
    _int64(slot_mapping, k.shape[0], "slot_mapping", "[T]")
    _same_device(k, v, k_cache, v_cache, slot_mapping)
    slots = k_cache.shape[0] * k_cache.shape[1]
    if not checks.trusted:
        checks.fail_if(
            ((slot_mapping < 0) | (slot_mapping >= slots)).any(), f"slot out of range of the cache ({slots})"
        )


@dataclass(frozen=True)
class _Problem:
    """paged_attention's checked arguments, with the sizes read from their values once `_Checks.run` returned."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor | None
    kv_of_q: torch.Tensor | None
    scale: float
    max_len: int  # indices into the values `_Checks.run` returns
    max_query_len: int
    group: int


def _prepare(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    kv_of_q: torch.Tensor | None,
    scale: float,
    checks: _Checks,
) -> _Problem:
    """paged_attention's checks (of q, only its shape and dtype); those of values are added to `checks`."""
    _require(
        q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
        f"bad shapes: q {list(q.shape)} (want [T, H, D]), caches {list(k_cache.shape)} and {list(v_cache.shape)}",
    )
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), "the caches must be contiguous")
    _require(q.dtype in DTYPES, f"q must be one of {DTYPES}, got {q.dtype}")
    _require(
        k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
        f"dtype mismatch: q {q.dtype}, caches {k_cache.dtype} and {v_cache.dtype}",
    )
    _require(k_cache.shape[3] == q.shape[2], f"head_dim mismatch: q {q.shape[2]}, cache {k_cache.shape[3]}")
    _require(k_cache.shape[2] > 0 and k_cache.shape[1] > 0, "the cache needs at least one KV head and block slot")
    _require(
        block_tables.dtype == torch.int64 and block_tables.is_contiguous() and block_tables.dim() == 2,
        f"block_tables must be contiguous int64 [B, W], got {block_tables.dtype} {list(block_tables.shape)}",
    )
    num_seqs, width = block_tables.shape
    _int64(context_lens, num_seqs, "context_lens", "[B]")
    if query_lens is not None:
        _int64(query_lens, num_seqs, "query_lens", "[B]")
    else:
        _require(q.shape[0] == num_seqs, f"q must have one row per new token: {q.shape[0]} rows, {num_seqs} sequences")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if kv_of_q is not None:
        _int64(kv_of_q, num_heads, "kv_of_q", "[H]")
    else:
        _require(
            num_heads % num_kv_heads == 0, f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    _same_device(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q)
    bs = k_cache.shape[1]
    max_len = max_query_len = group = -1
    _require(num_seqs > 0 or q.shape[0] == 0, f"q must have one row per new token: no sequences, {q.shape[0]} rows")
    if checks.trusted:  # trusted mode: no value is checked or read (the longest context is the caller's)
        _require(
            query_lens is None and kv_of_q is None, "max_context (trusted mode) takes decode batches without kv_of_q"
        )
        return _Problem(q, k_cache, v_cache, block_tables, context_lens, None, None, scale, 0, -1, -1)
    if num_seqs > 0:
        lens = context_lens
        checks.fail_if(((lens < 1) | (lens > width * bs)).any(), "context_lens out of range of block_tables")
        used = torch.arange(width, device=lens.device)[None, :] < ((lens + bs - 1) // bs)[:, None]
        bad = (block_tables < 0) | (block_tables >= k_cache.shape[0])
        checks.fail_if((used & bad).any(), "block id out of range of the cache")
        max_len = checks.read(lens.max())
        if query_lens is not None:
            checks.fail_if(((query_lens < 1) | (query_lens > lens)).any(), "query_lens out of range of context_lens")
            checks.fail_if(query_lens.sum() != q.shape[0], "q must have one row per new token")
            max_query_len = checks.read(query_lens.max())
    if kv_of_q is not None and num_heads > 0:
        checks.fail_if(((kv_of_q < 0) | (kv_of_q >= num_kv_heads)).any(), "kv_of_q out of range")
        group = checks.read(torch.bincount(kv_of_q.clamp(0, num_kv_heads - 1), minlength=num_kv_heads).max())
    return _Problem(
        q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale, max_len, max_query_len, group
    )


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


def _device_of(x: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """x's CUDA device made the current one (Triton launches on the current device); nothing elsewhere."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def _check_tuning(block_m: int | None, block_n: int | None, split_keys: int | None) -> None:
    for name, n in (("block_m", block_m), ("block_n", block_n)):
        _require(n is None or (n >= 16 and n & (n - 1) == 0), f"{name} must be a power of two >= 16, got {n}")
    _require(split_keys is None or split_keys >= 1, f"split_keys must be positive, got {split_keys}")


def _attend(
    p: _Problem, values: list[int], block_m: int | None, block_n: int | None, split_keys: int | None
) -> torch.Tensor:
    """Attention of a checked problem; `values` as `_Checks.run` returned them."""
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
    _require(q.is_contiguous(), "q must be contiguous")
    _check_tuning(block_m, block_n, split_keys)
    checks = _Checks(trusted=max_context is not None)
    problem = _prepare(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale, checks)
    values = checks.run() if max_context is None else _trusted_values(problem, max_context)
    with _device_of(q):
        return _attend(problem, values, block_m, block_n, split_keys)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Copies k/v [T, KVH, D] (contiguous rows, any token stride) into the caches at flat `slot_mapping` slots
    (block * bs + offset). Raises ValueError for bad input, the cache untouched."""
    checks = _Checks()
    _check_kv_write(k, v, k_cache, v_cache, slot_mapping, checks)
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
    checks = _Checks(trusted=max_context is not None)
    _check_kv_write(k, v, k_cache, v_cache, slot_mapping, checks)
    problem = _prepare(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale, checks)
    num_tokens, num_heads, head_dim = q.shape
    _require(
        q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], f"bad q/k shapes: {list(q.shape)} and {list(k.shape)}"
    )
    _require(q.stride(2) == 1 and q.stride(1) == head_dim, "q and k must have contiguous heads")
    _require(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    _require(
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
    _int64(positions, num_tokens, "positions", "[T]")
    _same_device(q, positions, cos, sin, k_cache)
    if not checks.trusted:
        checks.fail_if(
            ((positions < 0) | (positions >= cos.shape[0])).any(),
            f"position out of range of the cos/sin table ({cos.shape[0]})",
        )
    values = checks.run() if max_context is None else _trusted_values(problem, max_context)
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
