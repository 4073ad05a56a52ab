"""Paged attention over a block-structured KV cache.

The cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim]. New keys and
values are written at `slot_mapping` (block * block_size + offset). Each sequence then attends over the blocks
listed in its block table. Sequences are padded to a common query and key length only inside attention; the
linear layers see the flat token batch.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.device import upload
from hotswap.kernels import ops
from hotswap.model.layers.rotary import RotaryEmbedding

# Up to this many new tokens per sequence (decode steps, prompts, prefill chunks), attention runs in the native
# kernel, one query token at a time over its causal context. Its cost grows with the square of the prompt; SDPA's
# blocked kernel (on a padded copy) catches up near 1024 tokens on one sequence, so longer prefills go there.
KERNEL_MAX_QUERY_LEN = 512


@dataclass
class AttentionMetadata:
    """Per-step layout of the flat token batch, shared by every layer of one forward pass.

    `query_lens[i]` new tokens of sequence i follow its `context_lens[i] - query_lens[i]` cached tokens.
    `pad_index` maps each flat token to its row in the padded [B * max_query_len] layout (None when every
    sequence has one query token). `mask` [B, 1, max_query_len, key_len] is True where a query may attend.
    `gather_cache` is False when no sequence has cached tokens, so keys come straight from this step.
    `kernel` (the paged attention of the model's backend: native on the CPU, Triton on CUDA; `ops.paged_kernels`)
    is set when there is one and no sequence has
    more than KERNEL_MAX_QUERY_LEN new tokens: attention then reads the paged cache in place, with `query_lens`
    (None when every sequence has one new token) and none of the padded layout.
    `parts`: a step that mixes short queries (decodes) with long ones (prefill chunks) attends in two groups,
    each (the flat token rows of its sequences, its metadata), so that no decode is padded to a chunk's length.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    pad_index: torch.Tensor | None
    mask: torch.Tensor | None
    max_query_len: int
    gather_cache: bool
    kernel: ops.PagedKernels | None = None
    query_lens: torch.Tensor | None = None
    parts: list[tuple[torch.Tensor, AttentionMetadata]] | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kernel: ops.PagedKernels | None = None,
        deterministic: bool = False,
    ) -> AttentionMetadata:
        """The layout of a step (`deterministic`: the model's mode, whose one attention path takes every query
        length in the kernel)."""
        max_q = max(query_lens)
        cap = KERNEL_MAX_QUERY_LEN if not deterministic else max_q  # deterministic: one path for every query
        short = cap if kernel is not None else 1  # the longest query attended without padding
        if max_q > short and min(query_lens) <= short:
            return cls._split(query_lens, context_lens, block_tables, block_size, kernel, short, deterministic)
        gather = any(c != q for q, c in zip(query_lens, context_lens, strict=True))
        width = max(len(t) for t in block_tables)
        key_len = width * block_size if gather else max_q
        slots = [
            table[pos // block_size] * block_size + pos % block_size
            for q, c, table in zip(query_lens, context_lens, block_tables, strict=True)
            for pos in range(c - q, c)
        ]
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        q_len = torch.tensor(query_lens)
        c_len = torch.tensor(context_lens)
        if kernel is not None and max_q <= cap:
            return cls(
                torch.tensor(slots, dtype=torch.long),
                tables,
                c_len,
                None,
                None,
                max_q,
                gather,
                kernel,
                None if max_q == 1 else q_len,
            )
        pad = [i * max_q + j for i, q in enumerate(query_lens) for j in range(q)]
        # Query row j of sequence i sits at absolute position c - q + j and sees keys at positions <= that.
        q_pos = (c_len - q_len)[:, None] + torch.arange(max_q)[None, :]
        k_pos = torch.arange(key_len)
        if gather:
            mask = k_pos[None, None, :] <= q_pos[:, :, None]
        else:
            mask = k_pos[None, None, :] <= (q_pos - (c_len - q_len)[:, None])[:, :, None]
        mask &= k_pos[None, None, :] < c_len[:, None, None]
        mask[:, :, 0] = True  # padding rows attend somewhere; their outputs are dropped
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=tables,
            context_lens=c_len,
            pad_index=None if max_q == 1 else torch.tensor(pad, dtype=torch.long),
            mask=mask.unsqueeze(1),
            max_query_len=max_q,
            gather_cache=gather,
        )

    def to(self, device: torch.device) -> AttentionMetadata:
        """This metadata with its tensors on `device` (built on the host, moved once per step)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else upload(t, device)

        parts = None if self.parts is None else [(upload(rows, device), part.to(device)) for rows, part in self.parts]
        return dataclasses.replace(
            self,
            slot_mapping=upload(self.slot_mapping, device),
            block_tables=upload(self.block_tables, device),
            context_lens=upload(self.context_lens, device),
            pad_index=move(self.pad_index),
            mask=move(self.mask),
            query_lens=move(self.query_lens),
            parts=parts,
        )

    @classmethod
    def _split(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kernel: ops.PagedKernels | None,
        short: int,
        deterministic: bool,
    ) -> AttentionMetadata:
        """Metadata with `parts`: the sequences of at most `short` new tokens, and the others."""
        starts = [0, *itertools.accumulate(query_lens)]
        parts = []
        for is_short in (True, False):
            seqs = [i for i, q in enumerate(query_lens) if (q <= short) == is_short]
            rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])], dtype=torch.long)
            meta = cls.build(
                [query_lens[i] for i in seqs],
                [context_lens[i] for i in seqs],
                [block_tables[i] for i in seqs],
                block_size,
                kernel,
                deterministic,
            )
            parts.append((rows, meta))
        empty = torch.empty(0, dtype=torch.long)
        return cls(empty, empty, empty, None, None, max(query_lens), True, parts=parts)


class Attention(nn.Module):
    """Scaled dot-product attention with grouped KV heads over the paged cache bound to `k_cache`/`v_cache`.
    `deterministic`: the batch-invariant attention (`LayerSettings.deterministic`)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_of_q: list[int] | None = None,
        *,
        deterministic: bool,
    ) -> None:
        super().__init__()
        self.deterministic = deterministic
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # Uneven grouping (KV heads replicated across tensor-parallel ranks) expands KV to one head per q head.
        group = num_heads // num_kv_heads if num_heads % num_kv_heads == 0 else 0
        uniform = kv_of_q is None or (group > 0 and kv_of_q == [i // group for i in range(num_heads)])
        self.expand_index = None if uniform else torch.tensor(kv_of_q, dtype=torch.long)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        positions: torch.Tensor | None = None,
        rotary: RotaryEmbedding | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the flat batch; returns [T, H * D]. With `rotary`, q and k are first
        rotated for the tokens' `positions`: on the native path in the same call that caches and attends."""
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not allocated"
        if q.dtype != self.k_cache.dtype:  # attention runs in the cache's dtype (CacheConfig.kv_cache_dtype)
            cast_to = self.k_cache.dtype
            out = self.forward(q.to(cast_to), k.to(cast_to), v.to(cast_to), meta, positions, rotary)
            return out.to(q.dtype)
        if meta.parts is not None:  # the groups' sequences are disjoint: each writes and reads only its own KV
            out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
            for rows, part in meta.parts:
                out[rows] = self.forward(
                    q[rows], k[rows], v[rows], part, None if positions is None else positions[rows], rotary
                )
            return out
        if rotary is not None:
            assert positions is not None, "rotary needs the token positions"
            if meta.kernel is not None and self.deterministic and positions.dtype == torch.long:
                return self._rope_attend_exact(q, k, v, positions, rotary, meta)
            if meta.kernel is not None and meta.kernel.rotates(positions, q):
                return meta.kernel.rope(
                    q,
                    k,
                    v,
                    positions,
                    rotary.cos,
                    rotary.sin,
                    self.k_cache,
                    self.v_cache,
                    meta.slot_mapping,
                    meta.block_tables,
                    meta.context_lens,
                    meta.query_lens,
                    self.expand_index,
                    self.scale,
                )
            q, k = rotary(positions, q, k)
        ops.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.kernel is not None:  # the paged kernel of the model's backend (ops.paged_kernels)
            return meta.kernel.paged(
                q.contiguous(),
                self.k_cache,
                self.v_cache,
                meta.block_tables,
                meta.context_lens,
                meta.query_lens,
                self.expand_index,
                self.scale,
            )
        num_seqs = meta.block_tables.shape[0]
        max_q = meta.max_query_len
        if meta.gather_cache:
            keys = self.k_cache[meta.block_tables].flatten(1, 2)
            values = self.v_cache[meta.block_tables].flatten(1, 2)
        else:
            keys, values = _pad(k, meta, num_seqs), _pad(v, meta, num_seqs)
        query = _pad(q, meta, num_seqs)
        if self.expand_index is not None:
            keys, values = keys.index_select(2, self.expand_index), values.index_select(2, self.expand_index)
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.mask,
            scale=self.scale,
            enable_gqa=self.expand_index is None and self.num_kv_heads != self.num_heads,
        )
        out = out.transpose(1, 2).reshape(num_seqs * max_q, self.num_heads * self.head_dim)
        return out if meta.pad_index is None else out[meta.pad_index]

    def _rope_attend_exact(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Deterministic mode: `rope_paged_attention`, the one attention path of every query (a decode step, a
        prompt, a chunk, a cache hit: each query alone over its keys in order). Where autograd records (the
        trainer's forward, `hotswap.train`, whose sequences have no cached prefix), differentiable through the same
        attention written in torch ops."""
        k_cache, v_cache = self.k_cache, self.v_cache
        assert k_cache is not None and v_cache is not None  # checked by forward

        def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ops.rope_paged_attention(
                q,
                k.contiguous(),
                v.contiguous(),
                positions,
                rotary.cos,
                rotary.sin,
                k_cache,
                v_cache,
                meta.slot_mapping,
                meta.block_tables,
                meta.context_lens,
                meta.query_lens,
                self.expand_index,
                self.scale,
            )

        def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # causal attention within each sequence, on a padded [B, L] layout (not the packed T x T)
            q, k = rotary(positions, q, k)
            lens = meta.context_lens.tolist()
            if sum(lens) != q.shape[0]:
                raise ValueError("the trainer's attention takes whole sequences (no cached prefix)")
            width = max(lens)
            rows = torch.tensor([b * width + j for b, n in enumerate(lens) for j in range(n)])
            index = self.expand_index
            if index is None:
                index = torch.arange(self.num_heads) // (self.num_heads // self.num_kv_heads)

            def padded(x: torch.Tensor) -> torch.Tensor:  # [T, heads, D] -> [B, heads, L, D]
                out = x.new_zeros(len(lens) * width, *x.shape[1:]).index_copy(0, rows, x)
                return out.view(len(lens), width, *x.shape[1:]).transpose(1, 2)

            pos = torch.arange(width)
            mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < torch.tensor(lens)[:, None, None])
            mask[:, :, 0] = True  # padding rows attend somewhere; their outputs are dropped
            out = F.scaled_dot_product_attention(
                padded(q),
                padded(k.index_select(1, index)),
                padded(v.index_select(1, index)),
                attn_mask=mask[:, None],
                scale=self.scale,
            )
            flat = out.transpose(1, 2).reshape(len(lens) * width, self.num_heads * self.head_dim)
            return flat.index_select(0, rows)

        return ops.exact(kernel, reference, q, k, v)


def _pad(x: torch.Tensor, meta: AttentionMetadata, num_seqs: int) -> torch.Tensor:
    """[T, heads, D] -> [B, max_query_len, heads, D], zero-filled."""
    if meta.pad_index is None:
        return x.view(num_seqs, 1, *x.shape[1:])
    out = x.new_zeros(num_seqs * meta.max_query_len, *x.shape[1:])
    out[meta.pad_index] = x
    return out.view(num_seqs, meta.max_query_len, *x.shape[1:])
