"""Turns a ModelInput into tensors, runs the model over the paged cache and samples.

Each pass gets one `StepContext` (hotswap/model/step.py), built here: the attention metadata, the adapters of its
rows, and the routes it records or forces. The model's settings were fixed when it was built."""

from __future__ import annotations

import itertools
import math
import mmap
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from hotswap.config import EngineConfig
from hotswap.device import upload
from hotswap.distributed import current_parallel
from hotswap.kernels import ops
from hotswap.kernels import policy as kernel_policy
from hotswap.lora.manager import LoRAManager
from hotswap.model.layers.attention import Attention, AttentionMetadata
from hotswap.model.layers.sampler import prompt_logprobs_of, sample
from hotswap.model.lora_batch import LoRABatch
from hotswap.model.moe import route_shape
from hotswap.model.routing import Routes, routes_dtype
from hotswap.model.step import StepContext
from hotswap.wire import ModelInput, PromptLogprobs, PromptLogprobsAsk, Samples
from hotswap.worker.cuda_graphs import Capture, DecodeGraphs, cuda_capture, graphable
from hotswap.worker.decoder_stack import NativeDecoderStack


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module) -> None:
        self.config = config
        self.model = model
        self.block_size = config.cache_config.block_size
        self.device = torch.device(config.model_config.device)  # the model's, its cache's and the step's tensors'
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0  # of the allocated cache; kept while it is freed (sleep) so wake-up restores it
        self.deterministic = config.model_config.deterministic
        if self.deterministic:
            ops.require_native()  # its one path for every batch
        # the paged kernels of this device and backend (native on the CPU, Triton on CUDA), or None: the torch path
        self.attention_kernel = ops.paged_kernels(
            config.model_config.attention_backend, self.device, self.deterministic
        )
        self.stack = NativeDecoderStack(model, deterministic=self.deterministic)
        self.route_shape = route_shape(model)  # (sparse layers, top_k, experts); None for a dense model
        self.loras: LoRAManager | None = None  # with enable_lora (set by the worker)
        # decode steps replayed from CUDA graphs (hotswap/worker/cuda_graphs.py), made with the KV cache
        self.graphs: DecodeGraphs | None = None

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def bytes_per_block(self) -> int:
        layers = self.attention_layers()
        itemsize = torch.empty((), dtype=self.config.cache_config.kv_torch_dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * itemsize for a in layers)

    def allocate_kv_cache(self, num_blocks: int, capture: Capture | None = None) -> None:
        """Allocates zeroed K and V tensors [num_blocks, block_size, kv_heads, head_dim] per layer and binds them.
        With decode graphs (on CUDA unless `enforce_eager`, a dense model on the Triton kernels; or `capture`
        given: the tests' stand-in), one more block, the graphs' scratch block, follows the usable ones."""
        dtype = self.config.cache_config.kv_torch_dtype
        self.num_blocks = num_blocks
        self.kv_caches = []
        self.graphs = None
        use_graphs = (
            self.attention_kernel is not None
            and self.attention_kernel.name == "triton"
            and graphable(self.model)
            and (capture is not None or (self.device.type == "cuda" and not self.config.model_config.enforce_eager))
        )
        for attn in self.attention_layers():
            shape = (num_blocks + int(use_graphs), self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = zeroed(shape, dtype, self.device)
            attn.v_cache = zeroed(shape, dtype, self.device)
            self.kv_caches.append((attn.k_cache, attn.v_cache))
        if use_graphs:
            assert self.attention_kernel is not None  # checked above
            mc = self.config.model_config
            self.graphs = DecodeGraphs(
                lambda ids, pos, meta: cast(torch.Tensor, self.model(ids, pos, StepContext(meta))),
                self.attention_kernel,
                int(mc.hf_config["hidden_size"]),
                next(self.model.parameters()).dtype,
                self.device,
                self.config.scheduler_config.max_num_seqs,
                math.ceil((mc.max_model_len or 1) / self.block_size),
                self.block_size,
                num_blocks,
                capture or cuda_capture,
            )

    def calibrate_stack(self) -> None:
        """Times the native decoder stack against the modules on this model and cache (once per model shapes and
        build: the result is cached), where the stack could run at all."""
        if (
            self.device.type != "cpu"
            or self.attention_kernel is None
            or self.stack.model is None
            or not self.stack.modules_fit
        ):
            return
        dtype = next(self.model.parameters()).dtype
        if current_parallel().size > 1 or not self.stack.dtypes_fit(
            dtype, self.config.cache_config.kv_torch_dtype, lora=False
        ):
            return
        kernel_policy.calibrate_stack(
            lambda rows, variants: self.stack.time_step(
                rows, self.block_size, self.attention_kernel, self.num_blocks, variants
            ),
        )

    def free_kv_cache(self) -> None:
        self.graphs = None
        for attn in self.attention_layers():
            attn.k_cache = attn.v_cache = None
        self.kv_caches = []

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: list[int],
        positions: list[int],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        lora: LoRABatch | None = None,
        routes: Routes | None = None,
    ) -> torch.Tensor:
        """Runs the model over a flat batch, writing its KV, with the adapters `lora` and the routes `routes` (see
        `route_step`); returns the final hidden states [tokens, H]. A pure decode step replays a decode graph,
        unless adapters or recorded / forced routes are active (the graphs hold neither)."""
        if (
            self.graphs is not None
            and lora is None
            and routes is None
            and self.graphs.applies(query_lens, block_tables)
        ):
            return self.graphs.run(input_ids, positions, context_lens, block_tables)
        meta = AttentionMetadata.build(
            query_lens, context_lens, block_tables, self.block_size, self.attention_kernel, self.deterministic
        )
        ids = torch.tensor(input_ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        if self.device.type != "cpu":  # built on the host, moved once per step
            meta, ids, pos = meta.to(self.device), upload(ids, self.device), upload(pos, self.device)
        ctx = StepContext(meta, lora, routes)
        if self.device.type == "cpu" and self.stack.applies(len(input_ids), pos, ctx):
            return self.stack.run(self.stack.embed(ids), pos, ctx)
        return cast(torch.Tensor, self.model(ids, pos, ctx))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The logits [len(rows), V] of those rows of `hidden`, on every rank (every rank takes part in
        gathering the vocab)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return cast(torch.Tensor, cast(Any, self.model).compute_logits(hidden[index]))

    def forward(
        self,
        input_ids: list[int],
        positions: list[int],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        rows: list[int] | None,
        routes: Routes | None = None,
    ) -> torch.Tensor | None:
        """`hidden_states`, then the logits of the flat token `rows` (None for `rows` None: KV only)."""
        hidden = self.hidden_states(input_ids, positions, query_lens, context_lens, block_tables, routes=routes)
        return None if rows is None else self.logits(hidden, rows)

    def route_step(self, seqs: list[int], forced: torch.Tensor | None = None) -> Routes | None:
        """The routes of one pass that records the routed experts of sequences `seqs` and/or forces `forced`
        ([T, sparse layers, top_k]); None where it does neither, and for a dense model."""
        if self.route_shape is None or (not seqs and forced is None):
            return None
        return Routes(self.route_shape[0], bool(seqs), forced)

    def recorded(self, routes: Routes | None, seqs: list[int], query_lens: list[int]) -> dict[int, np.ndarray]:
        """After the pass `routes` served (over sequences with `query_lens`): sequence i's recorded rows for each
        i in `seqs` ([query_lens[i], sparse layers, top_k], the smallest integer dtype), on rank 0 (the engine
        reads rank 0's); empty elsewhere, and where nothing was recorded."""
        out: dict[int, np.ndarray] = {}
        if routes is None or not seqs or current_parallel().rank != 0:
            return out
        assert self.route_shape is not None  # a pass with routes has sparse layers
        ids = routes.take().to(routes_dtype(self.route_shape[2])).cpu().numpy()
        starts = [0, *itertools.accumulate(query_lens)]
        for i in seqs:
            out[i] = ids[starts[i] : starts[i + 1]].copy()
        return out

    def execute(self, model_input: ModelInput) -> Samples:
        self.copy_blocks(model_input.block_copies)
        mi = model_input
        ends = list(itertools.accumulate(mi.query_lens))
        adapters = self.loras.batch(mi.lora_rows, len(mi.input_ids)) if self.loras is not None else None
        step_routes = self.route_step(mi.route_seqs, mi.forced_routes)
        hidden = self.hidden_states(
            mi.input_ids, mi.positions, mi.query_lens, mi.context_lens, mi.block_tables, adapters, step_routes
        )
        routes = self.recorded(step_routes, mi.route_seqs, mi.query_lens)
        logits = self.logits(hidden, [ends[r] - 1 for r in mi.sample_rows])
        prompt = {
            ask.seq: self.prompt_logprobs(hidden, ends[ask.seq] - mi.query_lens[ask.seq], ask)
            for ask in mi.prompt_logprobs
        }
        if current_parallel().rank != 0:
            return Samples([])  # the engine reads rank 0's samples
        # sampled on the logits' device: only the ids and the asked logprobs come back to the host
        mode = self.config.model_config.logprobs_mode
        return Samples(sample(logits, mi.sample_specs, mode, self.deterministic), prompt, routes)

    @torch.inference_mode()
    def prompt_logprobs(self, hidden: torch.Tensor, start: int, ask: PromptLogprobsAsk) -> PromptLogprobs:
        """The prompt logprobs `ask` wants of the query tokens from flat row `start` on (`sampler.prompt_logprobs_of`:
        raw, or the processed distribution a processed logprobs_mode names), a chunk of rows at a time so that
        [rows, V] stays bounded."""
        out = PromptLogprobs([], [], [], [])
        for first in range(0, len(ask.targets), PROMPT_LOGPROB_CHUNK):
            last = min(first + PROMPT_LOGPROB_CHUNK, len(ask.targets))
            logits = self.logits(hidden, list(range(start + first, start + last))).float()
            out.extend(prompt_logprobs_of(logits, ask.targets[first:last], ask))
        return out


PROMPT_LOGPROB_CHUNK = 256  # prompt rows whose logits are computed at once (memory: rows x vocab floats)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """A zero tensor. On the CPU backed by an anonymous mapping: pages are zero-filled by the OS on first touch, so
    a large cache costs nothing until used, and its memory returns to the system when the tensor is freed. The
    zeros matter: the torch path reads padded slots, and 0 * NaN would be NaN."""
    if device is not None and device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)
