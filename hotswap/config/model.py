"""The model section of the engine config: which checkpoint to serve, in which dtype, on which device, and how its
outputs are reported (`ModelConfig`), with the dtype names the config accepts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from hotswap.architectures import supported_architectures
from hotswap.device import check_attention_backend, parse_device

DTYPES: dict[str, torch.dtype] = {
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
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype: unknown dtype {self.dtype!r}; expected 'auto' or one of {sorted(DTYPES)}")
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
            return DTYPES.get(name, torch.float32)
        return DTYPES[self.dtype]
