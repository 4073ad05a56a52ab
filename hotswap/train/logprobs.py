"""The trainer's forward that equals the engine's deterministic mode bit for bit.

`token_logprobs(model, input_ids, attention_mask, temperature)` takes the trainer's own transformers causal LM
(any architecture hotswap serves, its parameters as the trainer holds them) and returns the log-probability of
each next token, computed by hotswap's own layers in deterministic mode (`hotswap.kernels.ops`): the same kernels,
in the same order, as an engine started with `deterministic=True` on the same weights. The engine's prompt
logprobs and sampled-token logprobs for those tokens are the same bits, so a GRPO/PPO importance ratio is exactly
1 before the first update. It is differentiable: every kernel is wrapped so that autograd takes the gradient of
the same function written in torch ops (`ops.exact`), and the trainer's parameters receive their gradients.

How: a hotswap model of the same config (its "mirror", built once per trainer model and kept beside it) runs
with its parameters replaced, for the call, by tensors assembled from the trainer's (`torch.func.functional_call`):
the trainer's own tensors where the layouts agree, concatenations where hotswap fuses (q/k/v, gate/up, experts).
Nothing is copied into the mirror, so the result always reflects the trainer's current weights.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from hotswap.config import EngineConfig, ModelConfig
from hotswap.kernels import ops
from hotswap.model.layers.attention import Attention, AttentionMetadata
from hotswap.model.registry import build_model
from hotswap.model.settings import LayerSettings
from hotswap.model.step import StepContext
from hotswap.weights.index import WeightIndex

BLOCK_SIZE = 16  # of the scratch cache the trainer's attention reads (the result does not depend on it)


@dataclass
class _Mirror:
    model: nn.Module
    # hotswap parameter name -> [(flat offset, shape of its region, trainer parameter name)], in offset order
    sources: dict[str, list[tuple[int, tuple[int, ...], str]]]


class _Scorer(nn.Module):
    """The mirror's forward and logits in one module call (what `functional_call` runs)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        lm = cast(Any, self.lm)
        return cast(torch.Tensor, lm.compute_logits(lm(ids, positions, StepContext(meta))))


def _build_mirror(model: nn.Module) -> _Mirror:
    """The hotswap model of `model.config` (uninitialised parameters, never written) and where each of its
    parameters' elements come from among the trainer's. Raises ValueError for an architecture hotswap does not
    serve, or a trainer parameter it cannot place."""
    inner: Any = model
    while not hasattr(inner, "config") and isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module  # DDP and similar wrappers
    if not hasattr(inner, "config"):
        raise ValueError(f"token_logprobs takes a transformers model (with a `config`), got {type(model).__name__}")
    hf_config: dict[str, Any] = inner.config.to_dict()
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(hf_config))
        config = EngineConfig(model_config=ModelConfig(model=folder, dtype="float32", deterministic=True))
    mirror = build_model(config.model_config, LayerSettings.of(config))  # deterministic: every layer
    for module in mirror.modules():
        post = getattr(module, "process_weights_after_loading", None)
        if callable(post):
            post()  # dispatch state (the experts' map); no weights are read
    index = WeightIndex.of(mirror)
    params = dict(mirror.named_parameters())
    sources: dict[str, list[tuple[int, tuple[int, ...], str]]] = {name: [] for name in params}
    for raw, tensor in model.named_parameters():
        name = _plain_name(raw)
        target = index.targets.get(name)
        if target is None:
            if index.ignored(name):
                continue
            raise ValueError(
                f"token_logprobs: the trainer's parameter {name!r} has no place in hotswap's {type(mirror).__name__}"
            )
        view = target.local_view()
        if tuple(view.shape) != tuple(tensor.shape) or not view.is_contiguous():
            raise ValueError(
                f"token_logprobs: {name!r} has shape {list(tensor.shape)}; hotswap expects {list(view.shape)}"
            )
        offset = int(view.storage_offset() - target.param.data.storage_offset())
        sources[target.param_name].append((offset, tuple(view.shape), raw))
    for name, parts in sources.items():
        parts.sort()
        covered = 0
        for offset, shape, _ in parts:
            if offset != covered:  # a gap, or two trainer tensors for one place
                covered = -1
                break
            covered += int(torch.Size(shape).numel())
        if covered != params[name].numel():
            raise ValueError(f"token_logprobs: the trainer's parameters do not cover hotswap's {name!r} exactly once")
    return _Mirror(mirror, sources)


def _plain_name(name: str) -> str:
    """A parameter's checkpoint name, without the prefixes wrappers add (DDP's `module.`, torch.compile's
    `_orig_mod.`)."""
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def mirror_of(model: nn.Module) -> _Mirror:
    """`model`'s mirror, built on first use and kept on the model (its layout never changes)."""
    mirror: _Mirror | None = model.__dict__.get("_hotswap_mirror")
    if mirror is None:
        mirror = _build_mirror(model)
        model.__dict__["_hotswap_mirror"] = mirror
    return mirror


def _parameters(mirror: _Mirror, model: nn.Module) -> dict[str, torch.Tensor]:
    """The mirror's parameters as functions of the trainer's current tensors (float32, differentiable)."""
    trainer = dict(model.named_parameters())
    away = sorted({str(t.device) for t in trainer.values() if t.device.type != "cpu"})
    if away:
        raise ValueError(
            f"token_logprobs runs on the CPU (the engine's kernels); the model's parameters are on "
            f"{away}: move it with model.cpu()"
        )
    params = dict(mirror.model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name, parts in mirror.sources.items():
        tensors = [trainer[source].float() for _, _, source in parts]
        if len(tensors) == 1:
            out["lm." + name] = tensors[0].reshape(params[name].shape)
        else:
            out["lm." + name] = torch.cat([t.reshape(-1) for t in tensors]).view(params[name].shape)
    return out


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log p(input_ids[b, i + 1] | input_ids[b, : i + 1]) as [batch, seq - 1] float32, equal bit for bit to the
    logprobs a `deterministic=True` engine on the same weights returns for those tokens: its prompt logprobs and
    sampled-token logprobs (the raw distribution's) at `temperature` 1; at another temperature, the logits are
    divided first, and the sampled tokens' logprobs of an engine with `logprobs_mode="processed_logprobs"` (and
    no penalties or top-k/top-p/min-p filters) are equal. Differentiable with respect to `model`'s parameters.

    `attention_mask` [batch, seq] (1: a token, 0: padding, on either side; each row's tokens contiguous) marks
    each row's tokens; a row's result depends on its own tokens only (padding and the other rows change none of
    its bits). Entries whose token or predecessor is padding are 0. Raises ValueError for bad shapes or an
    architecture hotswap does not serve; RuntimeError where the native kernels are not available."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}, input_ids {list(input_ids.shape)}")
    mask = attention_mask.bool().cpu()
    ids_all = input_ids.cpu()
    batch, seq = ids_all.shape
    rows = [mask[b].nonzero().squeeze(1) for b in range(batch)]
    for b, where in enumerate(rows):
        if len(where) and int(where[-1] - where[0]) + 1 != len(where):
            raise ValueError(f"row {b} of attention_mask is not one contiguous run of tokens")
    out = torch.zeros(batch, max(seq - 1, 0), dtype=torch.float32)
    scored = [b for b in range(batch) if len(rows[b]) >= 2]
    if not scored:
        return out
    sequences = [ids_all[b, rows[b]].long() for b in scored]
    for b, seq_ids, logprobs in zip(scored, sequences, sequence_logprobs(model, sequences, temperature), strict=True):
        n, first = len(seq_ids), int(rows[b][0])
        chosen = logprobs.gather(1, seq_ids[1:, None]).squeeze(1)
        out = out.index_put((torch.full((n - 1,), b), torch.arange(first, first + n - 1)), chosen)
    return out


def sequence_logprobs(model: nn.Module, sequences: list[torch.Tensor], temperature: float = 1.0) -> list[torch.Tensor]:
    """For each token sequence (1-D int64, at least 2 tokens), the log-softmax over the vocabulary after each of
    its tokens but the last ([len - 1, V] float32): the engine's deterministic-mode distributions, differentiable
    (see `token_logprobs`). The sequences run as one packed batch; none changes another's bits."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if any(s.dim() != 1 or len(s) < 2 for s in sequences):
        raise ValueError("every sequence must be a 1-D tensor of at least 2 token ids")
    if not sequences:
        return []
    mirror = mirror_of(model)
    ops.require_native()  # deterministic mode's kernels
    lens = [len(s) for s in sequences]
    flat_ids = torch.cat(list(sequences)).long()
    positions = torch.cat([torch.arange(n) for n in lens])
    tables, next_block = [], 0
    for n in lens:
        blocks = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    meta = AttentionMetadata.build(lens, lens, tables, BLOCK_SIZE, ops.NATIVE_ATTENTION, deterministic=True)
    attention = [m for m in mirror.model.modules() if isinstance(m, Attention)]
    for attn in attention:
        shape = (next_block, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    try:
        logits = torch.func.functional_call(
            _Scorer(mirror.model), _parameters(mirror, model), (flat_ids, positions, meta), strict=False
        )
    finally:
        for attn in attention:
            attn.k_cache = attn.v_cache = None
    if temperature != 1.0:  # as the sampler divides (an engine with logprobs_mode="processed_logprobs")
        logits = logits / torch.tensor([temperature], dtype=logits.dtype)[:, None]
    logprobs = logits.log_softmax(dim=-1)
    out, start = [], 0
    for n in lens:
        out.append(logprobs[start : start + n - 1])
        start += n
    return out
