"""The checks of the Triton paged-attention entry points (hotswap/kernels/triton_attention.py): every argument,
its values included (one transfer to the host), before anything is written, so that bad input raises ValueError
and leaves the cache as it was."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class Checks:
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
            require(not failed, message)
        return [int(x) for x in got[len(self._flags) :]]


def trusted_values(p: Problem, max_context: int) -> list[int]:
    """What `Checks.run` would return in trusted mode: the longest context only (`prepare` took only a decode
    batch without a head map)."""
    require(max_context >= 1, f"max_context must be positive, got {max_context}")
    return [max_context]


def same_device(*tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    require(len(devices) <= 1, f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")


def check_int64(x: torch.Tensor, numel: int, name: str, shape: str) -> None:
    require(
        x.dtype == torch.int64 and x.is_contiguous() and x.numel() == numel,
        f"{name} must be contiguous int64 {shape}, got {x.dtype} {list(x.shape)}",
    )


def check_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    checks: Checks,
) -> None:
    """write_kv_cache's checks; the slots' range is added to `checks`."""
    require(
        k_cache.dim() == 4 and k_cache.is_contiguous() and v_cache.shape == k_cache.shape and v_cache.is_contiguous(),
        "caches must be contiguous [num_blocks, bs, KVH, D]",
    )
    require(
        k.dim() == 3 and k.shape == v.shape and k.shape[1:] == k_cache.shape[2:],
        f"k and v must be [T, KVH, D] matching the cache {list(k_cache.shape)}, got {list(k.shape)} and "
        f"{list(v.shape)}",
    )
    require(
        k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(2) == 1 and v.stride(1) == v.shape[2],
        "k and v must have contiguous rows (any token stride)",
    )
    require(k_cache.dtype in DTYPES, f"the cache must be one of {DTYPES}, got {k_cache.dtype}")
    require(
        k.dtype == v.dtype == v_cache.dtype == k_cache.dtype,
        f"dtype mismatch: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype} and {v_cache.dtype}",
    )
    check_int64(slot_mapping, k.shape[0], "slot_mapping", "[T]")
    same_device(k, v, k_cache, v_cache, slot_mapping)
    slots = k_cache.shape[0] * k_cache.shape[1]
    if not checks.trusted:
        checks.fail_if(
            ((slot_mapping < 0) | (slot_mapping >= slots)).any(), f"slot out of range of the cache ({slots})"
        )


@dataclass(frozen=True)
class Problem:
    """paged_attention's checked arguments, with the sizes read from their values once `Checks.run` returned."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor | None
    kv_of_q: torch.Tensor | None
    scale: float
    max_len: int  # indices into the values `Checks.run` returns
    max_query_len: int
    group: int


def prepare(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    kv_of_q: torch.Tensor | None,
    scale: float,
    checks: Checks,
) -> Problem:
    """paged_attention's checks (of q, only its shape and dtype); those of values are added to `checks`."""
    require(
        q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
        f"bad shapes: q {list(q.shape)} (want [T, H, D]), caches {list(k_cache.shape)} and {list(v_cache.shape)}",
    )
    require(k_cache.is_contiguous() and v_cache.is_contiguous(), "the caches must be contiguous")
    require(q.dtype in DTYPES, f"q must be one of {DTYPES}, got {q.dtype}")
    require(
        k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
        f"dtype mismatch: q {q.dtype}, caches {k_cache.dtype} and {v_cache.dtype}",
    )
    require(k_cache.shape[3] == q.shape[2], f"head_dim mismatch: q {q.shape[2]}, cache {k_cache.shape[3]}")
    require(k_cache.shape[2] > 0 and k_cache.shape[1] > 0, "the cache needs at least one KV head and block slot")
    require(
        block_tables.dtype == torch.int64 and block_tables.is_contiguous() and block_tables.dim() == 2,
        f"block_tables must be contiguous int64 [B, W], got {block_tables.dtype} {list(block_tables.shape)}",
    )
    num_seqs, width = block_tables.shape
    check_int64(context_lens, num_seqs, "context_lens", "[B]")
    if query_lens is not None:
        check_int64(query_lens, num_seqs, "query_lens", "[B]")
    else:
        require(q.shape[0] == num_seqs, f"q must have one row per new token: {q.shape[0]} rows, {num_seqs} sequences")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if kv_of_q is not None:
        check_int64(kv_of_q, num_heads, "kv_of_q", "[H]")
    else:
        require(
            num_heads % num_kv_heads == 0, f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    same_device(q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q)
    bs = k_cache.shape[1]
    max_len = max_query_len = group = -1
    require(num_seqs > 0 or q.shape[0] == 0, f"q must have one row per new token: no sequences, {q.shape[0]} rows")
    if checks.trusted:  # trusted mode: no value is checked or read (the longest context is the caller's)
        require(
            query_lens is None and kv_of_q is None, "max_context (trusted mode) takes decode batches without kv_of_q"
        )
        return Problem(q, k_cache, v_cache, block_tables, context_lens, None, None, scale, 0, -1, -1)
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
    return Problem(
        q, k_cache, v_cache, block_tables, context_lens, query_lens, kv_of_q, scale, max_len, max_query_len, group
    )
