"""`EngineConfig`: every section together, and the checks that span sections (deterministic mode, LoRA, the
draft model, expert placement, the batch budget)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from hotswap.config.model import ModelConfig
from hotswap.config.sections import (
    CacheConfig,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WeightTransferConfig,
)
from hotswap.device import check_engine_on_device


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
