"""The engine config's other sections, each a dataclass validated at construction: the KV cache, the scheduler,
the worker layout, loading, quantization, live weight transfer, LoRA and speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotswap.config.model import DTYPES


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
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or one of {sorted(DTYPES)}, got "
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
        return torch.float32 if self.kv_cache_dtype == "auto" else DTYPES[self.kv_cache_dtype]


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
    staging_slice_ms: float = 3.0
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
