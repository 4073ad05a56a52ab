"""The Triton kernels of paged attention (hotswap/kernels/triton_attention.py checks their arguments and
launches them).

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

from typing import Any

import triton
import triton.language as tl

_NEG = tl.constexpr(-1.0e30)  # the score of a masked key: finite, so that a row with every key masked stays finite


def _jit(fn: Any) -> Any:
    """triton.jit, typed for the checker (triton ships no annotations)."""
    return triton.jit(fn)


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
def decode_kernel(
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
def merge_kernel(
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
def extend_kernel(
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
def rope_write_kernel(
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
def write_kernel(
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
