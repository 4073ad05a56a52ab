"""Engine configuration and the scoped config context.

`EngineConfig` groups typed dataclasses, each validated at construction. Settings derived at startup (KV block
count, default `max_model_len`) are written once onto the same instance by the engine.

`use_config(cfg)` scopes the live config over a `contextvars.ContextVar`; `current_config()` reads it and
raises outside any scope. Worker entry points run inside `use_config`, so layer code can ask for the config
without it being threaded through constructors.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from hotswap.architectures import supported_architectures
from hotswap.device import check_attention_backend, check_engine_on_device, parse_device

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


@dataclass
class ModelConfig:
    """Which checkpoint to serve and how.

    `model` is a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files). `dtype` is
    "auto" (the checkpoint's dtype) or one of float32/bfloat16/float16. `max_model_len` None means the model's
    context length; it may not exceed it. `max_logprobs` bounds the log probabilities a request may ask for per
    token (-1: up to the whole vocabulary). `enable_return_routed_experts` (vLLM's flag): every completion of a
    mixture-of-experts model carries its routed experts, as if each request set `return_routed_experts`.
    `logprobs_mode` (vLLM's): what a sampled token's logprobs report: "raw_logprobs" (default: the model's
    distribution), "processed_logprobs" (the distribution sampled from: after logit bias, penalties, banned tokens,
    temperature and top-k/top-p/min-p), or "raw_logits" / "processed_logits" (the logits themselves). Prompt
    logprobs follow the same mode: the raw distribution under the raw modes, logits / T and the filters under the
    processed ones (docs/teacher-scoring.md).
    `deterministic`: the batch-invariant forward pass (docs/determinism.md): every request's tokens and logprobs
    are the same bits whatever else is batched with it, however its prompt is chunked or cached, on one rank or
    two, and equal to `hotswap.train.token_logprobs` on the trainer's model. Float32 weights, native kernels.
    `device`: "cpu" (default), "cuda" or "cuda:N": where the model, its KV cache and the step's tensors live
    (hotswap/device.py); CUDA without a visible GPU, and what has no CUDA path yet, are refused here.
    `attention_backend` (vLLM's flag): "auto" (the native kernels on the CPU where they win, Triton's on CUDA),
    "native", "triton" (on the CPU only under TRITON_INTERPRET=1: the tests' way to run the GPU kernels), or "torch"
    (SDPA over a padded copy). `enforce_eager` (vLLM's): no CUDA graphs for decode steps
    (hotswap/worker/cuda_graphs.py).
    """

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    tokenizer: str | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    enable_return_routed_experts: bool = False
    deterministic: bool = False
    device: str = "cpu"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.device = parse_device(self.device)
        check_attention_backend(self.attention_backend, self.device, self.deterministic)
        path = Path(self.model)
        if not path.is_dir():
            raise ValueError(f"model: checkpoint folder {self.model!r} does not exist")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model: {self.model!r} has no config.json; expected a Hugging Face checkpoint folder")
        self.hf_config = json.loads(cfg_path.read_text())
        archs = self.hf_config.get("architectures") or []
        supported = supported_architectures()
        if not archs or archs[0] not in supported:
            raise ValueError(
                f"model: architecture {archs[0] if archs else None!r} is not supported; "
                f"supported architectures: {', '.join(supported)}"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype: unknown dtype {self.dtype!r}; expected 'auto' or one of {sorted(_DTYPES)}")
        context = self.max_context_len
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1 (-1: the vocabulary), got {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.max_model_len is not None:
            if self.max_model_len <= 0:
                raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
            if self.max_model_len > context:
                raise ValueError(
                    f"max_model_len={self.max_model_len} exceeds the model's context length "
                    f"(max_position_embeddings={context})"
                )
        window = self.hf_config.get("sliding_window") if self.hf_config.get("use_sliding_window", True) else None
        if window and (self.max_model_len or context) > window:
            raise ValueError(
                f"max_model_len={self.max_model_len or context} exceeds the model's sliding_window={window}; "
                f"sliding-window attention is not supported, so set max_model_len <= {window}"
            )
        if self.tokenizer is None:
            self.tokenizer = self.model

    @property
    def architecture(self) -> str:
        return cast("str", self.hf_config["architectures"][0])

    @property
    def max_context_len(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 2048))

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            name = self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32"
            return _DTYPES.get(name, torch.float32)
        return _DTYPES[self.dtype]


@dataclass
class CacheConfig:
    """Paged KV cache. The block count is derived at startup from `kv_cache_memory_bytes` when given, else from
    `memory_fraction` of the host's available memory (on a GPU: `gpu_memory_utilization` of the device's memory
    less what the weights and a profiling forward take, vLLM's rule), capped at what `max_num_seqs` full-length
    sequences need.
    On a weight change the prefix cache is either dropped ("reset") or keyed by weight version from then on
    ("salt": old entries are never hit and age out).

    `kv_cache_dtype` is the dtype K and V are stored and attended in: "auto" (default) is, on the CPU, float32
    whatever the weights' dtype (attention, like the logits, in float32: logprobs nearest a float32 trainer's), and
    on a GPU the weights' dtype (vLLM's "auto"); "bfloat16" or "float16" halve the cache's memory and the bytes
    each decode step reads. q, k and v are cast to it on the way in and the attention's output back to the
    activations' dtype."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    memory_fraction: float = 0.2
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    prefix_cache_policy: str = "reset"
    num_kv_blocks: int | None = None  # derived at startup
    kv_cache_dtype: str = "auto"
    session_cache_fraction: float = 0.5  # of the blocks: at most this many free cached blocks of open sessions
    # are evicted after every other (hotswap/engine/sessions.py)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or one of {sorted(_DTYPES)}, got "
                f"{self.kv_cache_dtype!r} (quantized KV caches are not supported)"
            )
        if self.prefix_cache_policy not in ("reset", "salt"):
            raise ValueError(f"prefix_cache_policy must be 'reset' or 'salt', got {self.prefix_cache_policy!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0.0 <= self.session_cache_fraction <= 1.0:
            raise ValueError(f"session_cache_fraction must be in [0, 1], got {self.session_cache_fraction}")

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The dtype the cache holds ("auto": float32)."""
        return torch.float32 if self.kv_cache_dtype == "auto" else _DTYPES[self.kv_cache_dtype]


@dataclass
class SchedulerConfig:
    """Continuous batching limits.

    `enable_chunked_prefill` (default on, as in vLLM): `max_num_batched_tokens` (None: 2048) bounds the tokens
    of every step; a step runs every decoding sequence's next token, then the next chunk of the prompts being
    prefilled, then new prompts, as far as the budget goes, so a long prompt shares steps with running decodes.
    `long_prefill_token_threshold` (0: none) caps one prompt's chunk per step, so that several progress;
    `max_num_partial_prefills` prompts at most are part-way through their prefill at once.
    Without chunking, a prompt runs whole in one step, so `max_num_batched_tokens` (None: max(8192,
    max_model_len)) must hold one of `max_model_len` tokens, and a step either prefills or decodes.

    `on_weight_update`: what a running request does with its KV cache when new weights are committed, unless its
    `SamplingParams.on_weight_update` says: "keep" (default: it goes on with the KV computed so far; its version
    spans show where the weights changed) or "recompute" (its KV is dropped and computed again, prompt and output
    so far, on the new weights, in chunks that share steps with decoding)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    on_weight_update: str = "keep"

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.on_weight_update not in ("keep", "recompute"):
            raise ValueError(f"on_weight_update must be 'keep' or 'recompute', got {self.on_weight_update!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be True or False, got {self.enable_chunked_prefill!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be a non-negative integer (0: no cap), got "
                f"{self.long_prefill_token_threshold!r}"
            )
        if not isinstance(self.max_num_partial_prefills, int) or self.max_num_partial_prefills < 1:
            raise ValueError(
                f"max_num_partial_prefills must be a positive integer, got {self.max_num_partial_prefills!r}"
            )

    @property
    def chunk_cap(self) -> int:
        """The most tokens of one prompt a step runs."""
        assert self.max_num_batched_tokens is not None, "filled in by EngineConfig"
        cap = self.long_prefill_token_threshold
        return self.max_num_batched_tokens if cap == 0 else min(cap, self.max_num_batched_tokens)


@dataclass
class ParallelConfig:
    """Worker layout: `tensor_parallel_size` worker processes (one in-process worker when 1). `rpc_timeout_s`
    bounds every call to worker processes. `enable_expert_parallel`: a mixture-of-experts layer places whole
    experts on ranks (each rank holds about E / tensor_parallel_size of them) instead of splitting every expert's
    intermediate dimension; attention stays tensor-parallel either way. `expert_placement` (one list of expert ids
    per rank, together every expert once; None: contiguous, the first ranks one more) may change on a live engine:
    the experts move between ranks and the outputs stay the same."""

    tensor_parallel_size: int = 1
    rpc_timeout_s: float = 300.0
    enable_expert_parallel: bool = False
    expert_placement: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if not self.rpc_timeout_s > 0:
            raise ValueError(f"rpc_timeout_s must be positive, got {self.rpc_timeout_s}")


@dataclass
class LoadConfig:
    """How weights are read. `load_format` "safetensors" reads *.safetensors; "dummy" leaves random weights.
    `huge_pages` places the weights in transparent huge pages (Linux) before loading them: fewer TLB misses while
    a decode step streams the weights, for a longer load (figures in docs/performance.md)."""

    load_format: str = "safetensors"
    huge_pages: bool = True

    def __post_init__(self) -> None:
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if not isinstance(self.huge_pages, bool):
            raise ValueError(f"huge_pages must be True or False, got {self.huge_pages!r}")


@dataclass
class QuantConfig:
    """Weight quantization. "fp8": float8_e4m3fn weights with per-output-channel scales, computed from the
    high-precision weights whenever they are loaded; the matmul dequantizes. `weight_block_size` (b0, b1): the
    mixture-of-experts layers use one scale per b0 x b1 tile instead (as DeepSeek / Qwen FP8 checkpoints do, e.g.
    (128, 128)); the expert's intermediate size (and each rank's share of it) must be a multiple of b0 and b1."""

    quantization: str | None = None
    weight_block_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.weight_block_size is not None:
            block = tuple(self.weight_block_size)
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(f"weight_block_size must be two positive integers, got {self.weight_block_size!r}")
            if self.quantization != "fp8":
                raise ValueError("weight_block_size needs quantization='fp8'")
            self.weight_block_size = (int(block[0]), int(block[1]))


@dataclass
class WeightTransferConfig:
    """Live weight updates. `atomic` keeps a copy of everything an update overwrites until it finishes, so any
    failure rolls back bit for bit. `check_finite` rejects NaN/Inf tensors. `timeout_s` bounds every wait on a
    trainer. `bucket_size_bytes` is the packing unit of the torch_dist transport.

    `update_staging`: "in_place" (default) writes the served weights, so generation pauses for the update;
    "shadow" receives, checks and post-processes every update into staging copies while requests keep generating
    on the served version, and the commit swaps them in between two steps (hotswap/weights/shadow.py). It costs
    one more copy of the weights an update changes. `staging_slice_ms`: how long a staged update receives
    between two steps of running requests (the serving engine alternates slices and steps).

    `backup_device`: where an in-place atomic update keeps its rollback copies on a GPU: "cpu" (default:
    page-locked host memory, leaving the device's memory to the KV cache) or "device" (HBM: a rollback at HBM
    rate). On the CPU both are host memory."""

    atomic: bool = True
    check_finite: bool = True
    timeout_s: float = 60.0
    bucket_size_bytes: int = 256 * 1024 * 1024
    update_staging: str = "in_place"
    staging_slice_ms: float = 4.0
    backup_device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.atomic, bool):
            raise ValueError(f"weight_transfer_config.atomic must be a bool, got {self.atomic!r}")
        if not isinstance(self.check_finite, bool):
            raise ValueError(f"weight_transfer_config.check_finite must be a bool, got {self.check_finite!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"weight_transfer_config.timeout_s must be positive, got {self.timeout_s}")
        if self.backup_device not in ("cpu", "device"):
            raise ValueError(f"backup_device must be 'cpu' or 'device', got {self.backup_device!r}")
        if self.update_staging not in ("in_place", "shadow"):
            raise ValueError(f"update_staging must be 'in_place' or 'shadow', got {self.update_staging!r}")
        if not isinstance(self.staging_slice_ms, (int, float)) or not self.staging_slice_ms > 0:
            raise ValueError(f"staging_slice_ms must be a positive number, got {self.staging_slice_ms!r}")
        if not isinstance(self.bucket_size_bytes, int) or self.bucket_size_bytes <= 0:
            raise ValueError(
                f"weight_transfer_config.bucket_size_bytes must be a positive integer, got {self.bucket_size_bytes!r}"
            )


@dataclass
class LoRAConfig:
    """LoRA adapters (hotswap/lora). `max_loras`: adapter versions one step may use together; `max_cpu_loras`:
    adapter versions held at once (default `max_loras`), registered ones and those in use included;
    `max_lora_rank`: the largest rank accepted. `lora_version_policy`: what a request running on an adapter does
    when the adapter is updated: "finish_on_old" (it finishes on the version it started on, which is held until
    then) or "switch" (it goes on with the new version from its next step)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_version_policy: str = "finish_on_old"

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}"
            )
        if self.lora_version_policy not in ("finish_on_old", "switch"):
            raise ValueError(
                f"lora_version_policy must be 'finish_on_old' or 'switch', got {self.lora_version_policy!r}"
            )


@dataclass
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names. `method` None: off. "draft_model": a smaller model (`model`, a
    checkpoint folder with the target's vocabulary) proposes `num_speculative_tokens` tokens per step, the target
    verifies them in one pass. "ngram": prompt lookup, no draft weights: the last `prompt_lookup_max` ..
    `prompt_lookup_min` tokens are searched earlier in the sequence and what followed them is proposed.
    `draft_tensor_parallel_size` 1 replicates the draft on every rank; equal to the target's it shards it (default:
    sharded where its heads divide). `draft_staleness`: what happens while the target was updated after the draft
    ("warn": log once and keep speculating; "disable": decode without speculation until the draft is updated;
    "allow": keep speculating silently). Outputs never depend on the draft, only the speed does."""

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    draft_tensor_parallel_size: int | None = None
    draft_staleness: str = "warn"

    def __post_init__(self) -> None:
        if self.method not in (None, "draft_model", "ngram"):
            raise ValueError(f"speculative_config.method must be 'draft_model' or 'ngram', got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft checkpoint folder)")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config: method 'ngram' takes no draft 'model'")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )
        if self.draft_staleness not in ("warn", "disable", "allow"):
            raise ValueError(
                f"speculative_config.draft_staleness must be 'warn', 'disable' or 'allow', got {self.draft_staleness!r}"
            )
        tp = self.draft_tensor_parallel_size
        if tp is not None and (not isinstance(tp, int) or tp < 1):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size must be a positive integer, got {tp!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def uses_draft(self) -> bool:
        return self.method == "draft_model"


@dataclass
class EngineConfig:
    """The whole engine configuration. Cross-section checks run here; derived fields are filled by the engine."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    quant_config: QuantConfig = field(default_factory=QuantConfig)
    weight_transfer_config: WeightTransferConfig = field(default_factory=WeightTransferConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    # derived: the draft model's own config (method "draft_model"), checked against the target here
    draft_model_config: ModelConfig | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        mc, sc = self.model_config, self.scheduler_config
        tp = self.parallel_config.tensor_parallel_size
        heads = mc.hf_config.get("num_attention_heads", 1)
        if tp > heads:
            raise ValueError(f"tensor_parallel_size={tp} exceeds num_attention_heads={heads}")
        if mc.max_model_len is None:
            mc.max_model_len = mc.max_context_len
        check_batch_budget(sc, mc.max_model_len)
        check_expert_placement(self.parallel_config, mc.hf_config)
        check_engine_on_device(mc.device, mc.deterministic, tp)
        if mc.device != "cpu" and self.cache_config.kv_cache_dtype == "auto":
            # on a GPU, "auto" is the weights' dtype (vLLM's): a bf16 model attends in bf16; float32 weights keep
            # a float32 cache for parity with a float32 trainer
            self.cache_config.kv_cache_dtype = str(mc.torch_dtype).removeprefix("torch.")
        if mc.deterministic:
            check_deterministic(self)
        if self.lora_config.enable_lora:
            check_lora(self)
        self.draft_model_config = draft_model_config(self) if self.speculative_config.uses_draft else None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Builds a config from flat keyword arguments (the `LLM(...)` style); `weight_transfer_config` may be a
        dict of its fields. Unknown names raise TypeError."""
        sections = SECTIONS
        parts: dict[str, dict[str, Any]] = {name: {} for name in sections}
        speculative = kwargs.pop("speculative_config", None) or {}
        if isinstance(speculative, SpeculativeConfig):
            speculative = {f.name: getattr(speculative, f.name) for f in fields(speculative)}
        if not isinstance(speculative, dict):
            raise ValueError(f"speculative_config must be a dict of its fields, got {type(speculative).__name__}")
        unknown = sorted(set(speculative) - {f.name for f in fields(SpeculativeConfig)})
        if unknown:
            raise ValueError(f"unknown speculative_config field(s) {unknown}")
        transfer = kwargs.pop("weight_transfer_config", None) or {}
        if isinstance(transfer, WeightTransferConfig):
            transfer = {f.name: getattr(transfer, f.name) for f in fields(transfer)}
        parts["weight_transfer_config"].update(transfer)
        for key, value in kwargs.items():
            for name, klass in sections.items():
                if name != "speculative_config" and key in {f.name for f in fields(klass)}:
                    parts[name][key] = value
                    break
            else:
                raise TypeError(f"unknown engine argument {key!r}")
        return cls(
            model_config=ModelConfig(model=str(model), **parts["model_config"]),
            cache_config=CacheConfig(**parts["cache_config"]),
            scheduler_config=SchedulerConfig(**parts["scheduler_config"]),
            parallel_config=ParallelConfig(**parts["parallel_config"]),
            load_config=LoadConfig(**parts["load_config"]),
            quant_config=QuantConfig(**parts["quant_config"]),
            weight_transfer_config=WeightTransferConfig(**parts["weight_transfer_config"]),
            speculative_config=SpeculativeConfig(**speculative),
            lora_config=LoRAConfig(**parts["lora_config"]),
        )

    def with_overrides(self, overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Validates `{section: {field: value}}` and returns the new section objects, without touching this config.
        Raises ValueError for an unknown section or field, or a value its section rejects."""
        if not isinstance(overrides, dict):
            raise ValueError(
                f"overrides must be a dict of {{section: {{field: value}}}}, got {type(overrides).__name__}"
            )
        new: dict[str, Any] = {}
        for section, changes in overrides.items():
            if section not in SECTIONS:
                raise ValueError(f"unknown config section {section!r}; expected one of {sorted(SECTIONS)}")
            if not isinstance(changes, dict):
                raise ValueError(f"overrides[{section!r}] must be a dict of field values")
            current = getattr(self, section)
            names = {f.name for f in fields(current) if f.init}
            unknown = sorted(set(changes) - names)
            if unknown:
                raise ValueError(f"unknown field(s) {unknown} in config section {section!r}; known: {sorted(names)}")
            values = {name: getattr(current, name) for name in names}
            values.update(changes)
            new[section] = type(current)(**values)
        return new


SECTIONS: dict[str, type] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "load_config": LoadConfig,
    "quant_config": QuantConfig,
    "weight_transfer_config": WeightTransferConfig,
    "speculative_config": SpeculativeConfig,
    "lora_config": LoRAConfig,
}

# Config fields that may change on a live engine; everything else needs a new engine.
LIVE_FIELDS = {
    "model_config": {"model"},
    "load_config": {"load_format"},
    "weight_transfer_config": {
        "atomic",
        "check_finite",
        "timeout_s",
        "bucket_size_bytes",
        "staging_slice_ms",
        "backup_device",
    },
    "parallel_config": {"expert_placement"},
    "speculative_config": {"draft_staleness"},
}
# config.json keys that fix the model's shapes or forward pass: a new checkpoint folder must agree on all.
MODEL_KEYS = (
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rms_norm_eps",
    "max_position_embeddings",
    "sliding_window",
    "use_sliding_window",
    "hidden_act",
    "eos_token_id",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)


def check_deterministic(config: EngineConfig) -> None:
    """Raises ValueError where `deterministic=True` cannot keep its promise (docs/determinism.md): only float32
    weights have the batch-invariant products, and the two-way reduction order that makes one rank equal two
    covers tensor_parallel_size 1 and 2, with experts split along their width (not placed whole)."""
    dtype = config.model_config.torch_dtype
    if dtype != torch.float32:
        raise ValueError(
            f"deterministic=True runs float32 weights (the batch-invariant products are float32 kernels); got "
            f"dtype {str(dtype).removeprefix('torch.')}: pass dtype='float32' (fp8 quantization is allowed)"
        )
    if config.cache_config.kv_torch_dtype != torch.float32:
        raise ValueError(
            "deterministic=True keeps the KV cache in float32 (the trainer's forward, "
            "hotswap.train.token_logprobs, attends in float32); leave kv_cache_dtype at auto or float32"
        )
    tp = config.parallel_config.tensor_parallel_size
    if tp > 2:
        raise ValueError(f"deterministic=True supports tensor_parallel_size 1 or 2, got {tp}")
    quant, hf = config.quant_config, config.model_config.hf_config
    if (
        quant.quantization == "fp8"
        and quant.weight_block_size is None
        and (hf.get("num_experts") or hf.get("num_local_experts"))
    ):
        raise ValueError(
            "deterministic=True with fp8 experts needs weight_block_size: an expert's per-row scale "
            "spans the whole intermediate size on one rank and half of it on each of two, so one rank "
            "would not equal two"
        )
    if config.parallel_config.enable_expert_parallel:
        raise ValueError(
            "deterministic=True does not support enable_expert_parallel (experts placed whole sum in "
            "another order on each rank count); leave it off to split the experts along their width"
        )


def check_lora(config: EngineConfig) -> None:
    """Raises ValueError for what LoRA adapters cannot be combined with (yet), naming it."""
    if config.model_config.deterministic:
        raise ValueError(
            "enable_lora cannot be combined with deterministic=True: the adapters' products are not batch-invariant"
        )
    if config.speculative_config.enabled:
        raise ValueError("enable_lora cannot be combined with speculative decoding (the draft has no adapter)")


def current_config_or_none() -> EngineConfig | None:
    """The live engine config, or None outside any `use_config` scope."""
    return _CURRENT.get()


def draft_model_config(config: EngineConfig) -> ModelConfig:
    """The draft's ModelConfig: its folder, in the target's dtype and context length, on the target's device (with
    its `enforce_eager`: no decode graphs for the draft where the target has none). Raises ValueError for a
    draft whose vocabulary differs from the target's (its proposals would be other tokens)."""
    spec, target = config.speculative_config, config.model_config
    assert spec.model is not None and target.max_model_len is not None
    draft = ModelConfig(
        model=str(spec.model),
        dtype=str(target.torch_dtype).removeprefix("torch."),
        seed=target.seed,
        tokenizer=target.tokenizer,
        device=target.device,
        enforce_eager=target.enforce_eager,
    )
    if draft.hf_config.get("vocab_size") != target.hf_config.get("vocab_size"):
        raise ValueError(
            f"speculative_config.model: the draft's vocab_size {draft.hf_config.get('vocab_size')} differs from "
            f"the target's {target.hf_config.get('vocab_size')}; a draft must share the target's vocabulary"
        )
    draft_vocab = Path(spec.model) / "tokenizer.json"
    target_vocab = Path(str(target.tokenizer)) / "tokenizer.json"
    if draft_vocab.is_file() and target_vocab.is_file():
        a, b = (json.loads(p.read_text()).get("model", {}).get("vocab") for p in (draft_vocab, target_vocab))
        if a != b:
            raise ValueError("speculative_config.model: the draft's tokenizer vocabulary differs from the target's")
    if draft.max_context_len < target.max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft's context length {draft.max_context_len} is below the target's "
            f"max_model_len={target.max_model_len}; lower max_model_len"
        )
    draft.max_model_len = target.max_model_len
    heads = int(draft.hf_config.get("num_attention_heads", 1))
    tp = config.parallel_config.tensor_parallel_size
    draft_tp = spec.draft_tensor_parallel_size
    if draft_tp is None:
        spec.draft_tensor_parallel_size = tp if tp <= heads else 1
    elif draft_tp not in (1, tp):
        raise ValueError(
            f"speculative_config.draft_tensor_parallel_size must be 1 (replicated) or {tp} (sharded like the "
            f"target), got {draft_tp}"
        )
    elif draft_tp > heads:
        raise ValueError(f"draft_tensor_parallel_size={draft_tp} exceeds the draft's num_attention_heads={heads}")
    return draft


def check_expert_placement(parallel: ParallelConfig, hf_config: dict[str, Any]) -> None:
    """Raises ValueError unless `parallel.expert_placement` (when set) gives each rank a list of expert ids and
    places every expert of the model exactly once, with expert parallelism on."""
    placement = parallel.expert_placement
    if placement is None:
        return
    experts = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)
    if not experts or not (parallel.enable_expert_parallel and parallel.tensor_parallel_size > 1):
        raise ValueError(
            "expert_placement needs a mixture-of-experts model with enable_expert_parallel and tensor_parallel_size > 1"
        )
    ranks = parallel.tensor_parallel_size
    if not (isinstance(placement, list) and len(placement) == ranks and all(isinstance(p, list) for p in placement)):
        raise ValueError(f"expert_placement must list the experts of each of the {ranks} ranks, got {placement!r}")
    flat = [e for part in placement for e in part]
    if sorted(flat) != list(range(experts)) or any(not isinstance(e, int) for e in flat):
        raise ValueError(f"expert_placement must place each of the {experts} experts once, got {placement!r}")
    if any(not part for part in placement):
        raise ValueError(f"expert_placement gives a rank no expert: {placement!r}")


def check_batch_budget(sc: SchedulerConfig, max_model_len: int) -> None:
    """Fills in `max_num_batched_tokens` and checks that every step can make progress with it: without chunked
    prefill it must hold a whole prompt; with it, one step must hold the next token of every running sequence.
    (A speculative decode step verifies k + 1 tokens per sequence whatever the budget: the budget bounds the
    steps that prefill.)"""
    if sc.max_num_batched_tokens is None:
        sc.max_num_batched_tokens = 2048 if sc.enable_chunked_prefill else max(8192, max_model_len)
    budget = sc.max_num_batched_tokens
    if not sc.enable_chunked_prefill:
        if budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} is smaller than max_model_len={max_model_len} with "
                "enable_chunked_prefill=False (a prompt runs whole in one step); raise it, lower max_model_len, "
                "or enable chunked prefill"
            )
        return
    if budget < sc.max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens={budget} cannot hold one step of max_num_seqs={sc.max_num_seqs} running "
            f"sequences; raise max_num_batched_tokens to at least {sc.max_num_seqs} or lower max_num_seqs"
        )


def live_overrides(config: EngineConfig, overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Validates a live change `{section: {field: value}}` and returns the new section objects, touching nothing.
    Raises ValueError for unknown sections or fields, invalid values, fields that cannot change live, and a
    model folder whose config.json describes another model. Deterministic in (config, overrides), so the engine
    and every worker reach the same verdict."""
    new_sections = config.with_overrides(overrides)
    if "parallel_config" in new_sections:
        check_expert_placement(new_sections["parallel_config"], config.model_config.hf_config)
    for section, changes in overrides.items():
        frozen = sorted(set(changes) - LIVE_FIELDS.get(section, set()))
        if frozen:
            raise ValueError(
                f"{section} field(s) {frozen} cannot change on a live engine; live fields: "
                f"{ {k: sorted(v) for k, v in LIVE_FIELDS.items()} }"
            )
    if "model_config" in new_sections:
        # the dtype was resolved at start; a folder saved in another dtype is cast to it as it loads
        new_sections["model_config"].dtype = str(config.model_config.torch_dtype).removeprefix("torch.")
        new = new_sections["model_config"].hf_config
        differ = [k for k in MODEL_KEYS if new.get(k) != config.model_config.hf_config.get(k)]
        if differ:
            raise ValueError(
                f"checkpoint {new_sections['model_config'].model!r} has a different model shape or configuration "
                f"({differ}); start a new engine"
            )
    return new_sections


def apply_overrides(config: EngineConfig, new_sections: dict[str, Any]) -> None:
    """Writes validated sections (from `live_overrides`) into `config` in place: objects that hold the config
    keep seeing the live one. Derived fields computed at start (e.g. the KV block count) are left as they are."""
    for section, obj in new_sections.items():
        live = getattr(config, section)
        for f in fields(obj):
            setattr(live, f.name, getattr(obj, f.name))


_CURRENT: contextvars.ContextVar[EngineConfig | None] = contextvars.ContextVar("hotswap_config", default=None)


T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[Any], value: T) -> Iterator[T]:
    """Sets `var` to `value` inside the block; the previous value is restored on exit, also on error."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def use_config(config: EngineConfig) -> contextlib.AbstractContextManager[EngineConfig]:
    """Makes `config` the live config inside the block; the previous one is restored on exit, also on error."""
    return scoped(_CURRENT, config)


def current_config() -> EngineConfig:
    """The live engine config. Raises RuntimeError outside any `use_config` scope."""
    config = _CURRENT.get()
    if config is None:
        raise RuntimeError(
            "current_config() called outside a config scope; wrap the call in `with use_config(config):` "
            "(worker entry points do this for you)"
        )
    return config


def available_memory_bytes() -> int:
    """The host's available memory (MemAvailable), or total physical memory where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
