"""The architectures hotswap serves: config.json `architectures[0]` -> (module, class), looked up by name and
imported on first use (as transports are), so the config can name them without importing the model code."""

from __future__ import annotations

MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("hotswap.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("hotswap.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("hotswap.model.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("hotswap.model.llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("hotswap.model.moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("hotswap.model.moe", "Qwen2MoeForCausalLM"),
    "MixtralForCausalLM": ("hotswap.model.moe", "MixtralForCausalLM"),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(MODELS)
