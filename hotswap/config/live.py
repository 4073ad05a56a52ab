"""Changing a live engine's config: which fields may change (`LIVE_FIELDS`), which config.json keys a new checkpoint
folder must share (`MODEL_KEYS`), and validating then applying a change in place."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from hotswap.config.engine import EngineConfig, check_expert_placement

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
