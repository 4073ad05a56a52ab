"""Decode steps replayed from CUDA graphs, one per batch-size class.

A decode step launches a few kernels per layer; at small batches their launch cost, not the GPU, sets the step
time. `DecodeGraphs` captures the model's forward over a pure-decode batch once per size class (1, 2, 4, 8, 16, 24,
32, ... up to `max_num_seqs`) into static device buffers: token ids, positions, KV slots, block tables [rows,
max blocks], context lengths, and the final hidden states. A step copies its inputs into the buffers of the
smallest class that holds it and replays that graph. Rows past the batch are padding: token 0 at position 0, one
key of context, their KV written to a scratch slot (the cache's last block, which the block manager never hands
out), their outputs dropped.

What the graph holds must not move: the weights (updates copy into the same storage), the KV cache (reallocated
by wake-up: `invalidate()` drops every graph, captured again on the next decode step), and the buffers. The Triton
paged kernels run in their trusted mode there (no value checked on the device, nothing read back to the host; the
grid sized for the longest context a block table holds). What is not captured: prefills and mixed steps, steps
with LoRA adapters or with routes recorded or forced, mixture-of-experts models (their expert dispatch reads the
routed counts on the host), and everything after the hidden states (logits, sampling).

`capture` is how a graph is made: `torch.cuda.graph` on a GPU; tests pass an eager stand-in that runs the same
function again on replay, so the buffers, classes and padding are checked on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from hotswap.kernels.ops import PagedKernels
from hotswap.model.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # torch's graph memory pool handle

Replay = Callable[[], None]
Capture = Callable[[Callable[[], None]], Replay]


def size_classes(max_rows: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 8 up to 256, then every 64, up to `max_rows` (included)."""
    sizes = [n for n in (1, 2, 4) if n < max_rows]
    sizes += list(range(8, min(max_rows, 256) + 1, 8)) + list(range(320, max_rows + 1, 64))
    if not sizes or sizes[-1] < max_rows:
        sizes.append(max_rows)
    return sizes


def cuda_capture(fn: Callable[[], None], pool: _POOL_HANDLE | None = None) -> Replay:
    """`fn` captured into a CUDA graph (after one warm-up run on a side stream, as torch asks); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: Triton compiles, allocators settle
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


class DecodeGraphs:
    """The captured decode steps of one model and KV cache (see the module doc). `forward(ids, positions, meta)`
    is the model's forward of a pass with that metadata alone (no adapters, no routes); `kernels` the Triton paged
    kernels (taken in their trusted mode); the cache has `num_blocks` usable blocks of `block_size` and one more,
    the scratch block, after them."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        kernels: PagedKernels,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        max_blocks: int,
        block_size: int,
        num_blocks: int,
        capture: Capture = cuda_capture,
    ) -> None:
        self.forward, self.block_size, self.max_blocks = forward, block_size, max_blocks
        self.scratch_slot = num_blocks * block_size  # the first slot of the scratch block
        self.classes = size_classes(max_rows)
        self.capture = capture
        max_context = max_blocks * block_size
        self.kernels = PagedKernels(
            kernels.name,
            functools.partial(kernels.paged, max_context=max_context),
            functools.partial(kernels.rope, max_context=max_context),
        )
        n = self.classes[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.full((n, max_blocks), num_blocks, dtype=torch.long, device=device)  # padding: scratch
        self.context = torch.ones(n, dtype=torch.long, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, Replay] = {}
        self.replays = 0  # steps served from a graph (for tests and figures)

    def applies(self, query_lens: list[int], block_tables: list[list[int]]) -> bool:
        """Whether a step is a pure decode batch that a captured class holds."""
        return (
            bool(query_lens)
            and len(query_lens) <= self.classes[-1]
            and max(query_lens) == 1
            and max(len(t) for t in block_tables) <= self.max_blocks
        )

    def invalidate(self) -> None:
        """Drops every graph (the KV cache or the model's modules changed); each is captured again when needed."""
        self.graphs = {}

    def run(
        self, input_ids: list[int], positions: list[int], context_lens: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """The final hidden states [rows, H] of a decode step (`applies` must hold), from its class's graph."""
        rows = len(input_ids)
        size = next(n for n in self.classes if n >= rows)
        bs = self.block_size
        slots = [t[(c - 1) // bs] * bs + (c - 1) % bs for c, t in zip(context_lens, block_tables, strict=True)]
        padded = [t + [t[-1]] * (self.max_blocks - len(t)) for t in block_tables]
        host = torch.tensor([input_ids, positions, slots, context_lens], dtype=torch.long)
        self.ids[:rows].copy_(host[0], non_blocking=True)
        self.positions[:rows].copy_(host[1], non_blocking=True)
        self.slots[:rows].copy_(host[2], non_blocking=True)
        self.context[:rows].copy_(host[3], non_blocking=True)
        self.tables[:rows].copy_(torch.tensor(padded, dtype=torch.long), non_blocking=True)
        self._pad(rows, size)
        if size not in self.graphs:
            self.graphs[size] = self.capture(functools.partial(self._step, size))
        self.graphs[size]()
        self.replays += 1
        return self.hidden[:rows]

    def _pad(self, rows: int, size: int) -> None:
        """Rows rows..size of the buffers as padding (see the module doc)."""
        if rows < size:
            self.ids[rows:size].zero_()
            self.positions[rows:size].zero_()
            self.slots[rows:size].fill_(self.scratch_slot)
            self.context[rows:size].fill_(1)
            self.tables[rows:size].fill_(self.scratch_slot // self.block_size)

    def _step(self, size: int) -> None:
        """The captured work: the forward over the first `size` rows of the buffers, into `hidden`."""
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            block_tables=self.tables[:size],
            context_lens=self.context[:size],
            pad_index=None,
            mask=None,
            max_query_len=1,
            gather_cache=True,
            kernel=self.kernels,
        )
        self.hidden[:size].copy_(self.forward(self.ids[:size], self.positions[:size], meta))


def graphable(model: nn.Module) -> bool:
    """Whether the model's decode step can be captured: no mixture-of-experts layer (their dispatch reads the
    routed counts on the host)."""
    from hotswap.model.moe import SparseMoeBlock

    return not any(isinstance(m, SparseMoeBlock) for m in model.modules())
