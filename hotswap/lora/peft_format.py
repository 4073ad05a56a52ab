"""PEFT's LoRA format: the adapter's config (`adapter_config.json`) and its tensor names.

A saved adapter names its factors `base_model.model.<module>.lora_A.weight` ([rank, in]) and `...lora_B.weight`
([out, rank]); a live `PeftModel`'s state dict puts the adapter's own name before `.weight`
(`lora_A.default.weight`). `canonical_name` maps every form to the saved one, which is what the engine calls an
adapter's tensors everywhere (updates, checksums, deltas).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PREFIX = "base_model.model."
_FACTOR = re.compile(r"^(?P<module>.+)\.(?P<factor>lora_A|lora_B)(?:\.[^.]+)?\.weight$")
# adapter_config.json keys whose non-default values change the forward pass in ways not implemented here
_UNSUPPORTED: dict[str, Any] = {
    "use_dora": False,
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layer_replication": None,
}


@dataclass(frozen=True)
class LoRASpec:
    """One adapter's shape: PEFT's default rank `rank` and `alpha`, whether scales are rank-stabilized, each adapted
    module with the rows of its lora_A (its rank; for mixture-of-experts parameters, rank x experts), lora_A's
    columns and lora_B's rows (the target's in and out features), and PEFT's
    `alpha_pattern` (regex -> alpha). A module is a checkpoint module path ("model.layers.0.self_attn.q_proj"), or
    for a targeted expert parameter PEFT's wrapper path ("model.layers.0.mlp.experts", with ".base_layer" once
    per further parameter of the same module)."""

    rank: int
    alpha: float
    use_rslora: bool
    ranks: tuple[tuple[str, int, int, int], ...]
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(m for m, *_ in self.ranks)

    def scaling(self, key: str, rank: int) -> float:
        """What the product of a target's factors is multiplied by: alpha / rank (rsLoRA: alpha / sqrt(rank)), its
        alpha from `alpha_pattern` where a pattern matches `key` (a module path, or "<module>.<parameter>") as PEFT
        matches it."""
        alpha = self.alpha
        for pattern, value in self.alpha_pattern:
            if re.match(rf"(.*\.)?({pattern})$", key):
                alpha = value
                break
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)

    def as_dict(self) -> dict[str, Any]:
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "use_rslora": self.use_rslora,
            "ranks": [list(item) for item in self.ranks],
            "alpha_pattern": [list(i) for i in self.alpha_pattern],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoRASpec:
        return cls(
            int(d["r"]),
            float(d["lora_alpha"]),
            bool(d["use_rslora"]),
            tuple((str(m), int(r), int(i), int(o)) for m, r, i, o in d["ranks"]),
            tuple((str(p), float(a)) for p, a in d.get("alpha_pattern", [])),
        )


def canonical_name(name: str) -> str:
    """`name` as a saved PEFT adapter spells it (prefix `base_model.model.`, no adapter name before `.weight`);
    names that are not LoRA factors come back unchanged, prefixed."""
    if not name.startswith(PREFIX):
        name = PREFIX + name
    match = _FACTOR.match(name)
    if match is None:
        return name
    return f"{match['module']}.{match['factor']}.weight"


def spec_of(config: dict[str, Any], tensors: dict[str, torch.Tensor], max_rank: int) -> LoRASpec:
    """The spec of an adapter with PEFT `config` (adapter_config.json's fields) and `tensors` (by name). Raises
    ValueError naming what is missing, unsupported or over `max_rank` (a module's rank; an expert parameter's rank
    per expert is checked where the experts are known)."""
    if not isinstance(config, dict):
        raise ValueError(
            f"the adapter's config must be a dict of adapter_config.json fields, got {type(config).__name__}"
        )
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value not in (default, None, {}, [], False):
            raise ValueError(f"adapter_config {key}={value!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter_config bias={config['bias']!r} is not supported (only 'none')")
    rank = config.get("r", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"adapter_config r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"adapter_config lora_alpha must be a number, got {alpha!r}")
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict) or not all(isinstance(v, (int, float)) for v in patterns.values()):
        raise ValueError(f"adapter_config alpha_pattern must map patterns to numbers, got {patterns!r}")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _FACTOR.match(canonical_name(name))
        if match is None:
            raise ValueError(
                f"unexpected tensor {name!r} in a LoRA adapter (expected <module>.lora_A.weight and "
                "<module>.lora_B.weight)"
            )
        factors.setdefault(match["module"][len(PREFIX) :], {})[match["factor"]] = tensor
    if not factors:
        raise ValueError("the adapter has no lora_A / lora_B tensors")
    lonely = sorted(m for m, f in factors.items() if set(f) != {"lora_A", "lora_B"})
    if lonely:
        raise ValueError(f"modules {lonely[:3]} have lora_A or lora_B but not both")
    ranks = []
    for module, pair in sorted(factors.items()):
        rows = pair["lora_A"].shape[0] if pair["lora_A"].dim() == 2 else -1
        if pair["lora_A"].dim() != 2 or pair["lora_B"].dim() != 2 or pair["lora_B"].shape[1] != rows:
            raise ValueError(
                f"{module}: lora_A {tuple(pair['lora_A'].shape)} and lora_B "
                f"{tuple(pair['lora_B'].shape)} are not [rank, in] and [out, rank]"
            )
        expert = module.endswith(".experts") or ".experts.base_layer" in module
        if not expert and rows > max_rank:
            raise ValueError(
                f"the adapter's rank {rows} ({module}) exceeds max_lora_rank={max_rank}; start the "
                "engine with a larger max_lora_rank"
            )
        ranks.append((module, rows, pair["lora_A"].shape[1], pair["lora_B"].shape[0]))
    return LoRASpec(
        rank,
        float(alpha),
        bool(config.get("use_rslora", False)),
        tuple(ranks),
        tuple((str(p), float(v)) for p, v in patterns.items()),
    )


def read_folder(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, tensors by canonical name) of a PEFT adapter folder as `save_pretrained` writes it. Raises
    ValueError naming the missing or unreadable file."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"LoRA path {path!r} is not a folder")
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA path {path!r} has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from None
    weights = folder / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(weights))
        except Exception as err:  # safetensors' own error type for a corrupt or truncated file
            raise ValueError(f"{weights} is not a readable safetensors file: {err}") from None
    elif (folder / "adapter_model.bin").is_file():
        tensors = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"LoRA path {path!r} has no adapter_model.safetensors (or adapter_model.bin)")
    return config, {canonical_name(k): v for k, v in tensors.items()}
