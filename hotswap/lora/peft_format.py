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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PREFIX = "base_model.model."
_FACTOR = re.compile(r"^(?P<module>.+)\.(?P<factor>lora_A|lora_B)(?:\.[^.]+)?\.weight$")
# adapter_config.json keys whose non-default values change the forward pass in ways not implemented here
_UNSUPPORTED: dict[str, Any] = {"use_dora": False, "lora_bias": False, "fan_in_fan_out": False, "modules_to_save": None,
                "rank_pattern": {}, "alpha_pattern": {}, "target_parameters": None, "layer_replication": None}


@dataclass(frozen=True)
class LoRASpec:
    """One adapter's shape: its rank, alpha, whether the scale is rank-stabilized, and the base modules it adapts
    (checkpoint module paths, e.g. "model.layers.0.self_attn.q_proj")."""

    rank: int
    alpha: float
    use_rslora: bool
    modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """What the product of the factors is multiplied by: alpha / rank (rsLoRA: alpha / sqrt(rank))."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def as_dict(self) -> dict[str, Any]:
        return {"r": self.rank, "lora_alpha": self.alpha, "use_rslora": self.use_rslora,
                "modules": list(self.modules)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoRASpec:
        return cls(int(d["r"]), float(d["lora_alpha"]), bool(d["use_rslora"]), tuple(d["modules"]))


def canonical_name(name: str) -> str:
    """`name` as a saved PEFT adapter spells it (prefix `base_model.model.`, no adapter name before `.weight`);
    names that are not LoRA factors come back unchanged, prefixed."""
    if not name.startswith(PREFIX):
        name = PREFIX + name
    match = _FACTOR.match(name)
    if match is None:
        return name
    return f"{match['module']}.{match['factor']}.weight"


def spec_of(config: dict[str, Any], names: Iterable[str], max_rank: int) -> LoRASpec:
    """The spec of an adapter with PEFT `config` (adapter_config.json's fields) and tensors `names`. Raises
    ValueError naming what is missing, unsupported or over `max_rank`."""
    if not isinstance(config, dict):
        raise ValueError(f"the adapter's config must be a dict of adapter_config.json fields, got "
                         f"{type(config).__name__}")
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
    if rank > max_rank:
        raise ValueError(f"the adapter's rank {rank} exceeds max_lora_rank={max_rank}; start the engine with a "
                         "larger max_lora_rank")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"adapter_config lora_alpha must be a number, got {alpha!r}")
    factors: dict[str, set[str]] = {}
    for name in names:
        match = _FACTOR.match(canonical_name(name))
        if match is None:
            raise ValueError(f"unexpected tensor {name!r} in a LoRA adapter (expected <module>.lora_A.weight and "
                             "<module>.lora_B.weight)")
        factors.setdefault(match["module"][len(PREFIX):], set()).add(match["factor"])
    if not factors:
        raise ValueError("the adapter has no lora_A / lora_B tensors")
    lonely = sorted(m for m, f in factors.items() if f != {"lora_A", "lora_B"})
    if lonely:
        raise ValueError(f"modules {lonely[:3]} have lora_A or lora_B but not both")
    return LoRASpec(rank, float(alpha), bool(config.get("use_rslora", False)), tuple(sorted(factors)))


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

        tensors = load_file(str(weights))
    elif (folder / "adapter_model.bin").is_file():
        tensors = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"LoRA path {path!r} has no adapter_model.safetensors (or adapter_model.bin)")
    return config, {canonical_name(k): v for k, v in tensors.items()}
