"""Rollout routing replay (R3) in a trainer's transformers forward.

`replay_routes(model, routed_experts)` makes a transformers mixture-of-experts model (Qwen3-MoE, Qwen2-MoE,
Mixtral: their `*TopKRouter` modules) use the experts a rollout recorded (`CompletionOutput.routed_experts`)
instead of its router's choice, for the duration of a `with` block. The forced experts are weighted by the
router's own probabilities of them, renormalized where the model renormalizes its top-k (Mixtral, and
`norm_topk_prob`), as the engine does with `forced_routed_experts`: gradients flow to the router through those
weights, the choice itself is fixed.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_Routed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a router's (logits, weights, expert ids)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order (transformers 5 `*TopKRouter` modules)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _as_tensor(routed_experts: object, batch: int, length: int, layers: int, top_k: int) -> torch.Tensor:
    """[batch * length, layers, top_k] int64, -1 rows where the router chooses (beyond the routes given)."""
    items = list(routed_experts) if isinstance(routed_experts, (list, tuple)) else None
    if items is None:
        array = torch.as_tensor(np.asarray(routed_experts) if not torch.is_tensor(routed_experts) else routed_experts)
        items = [array] if array.dim() == 3 else list(array)
    if len(items) != batch:
        raise ValueError(f"routed_experts holds routes of {len(items)} sequences for a batch of {batch}")
    out = torch.full((batch, length, layers, top_k), -1, dtype=torch.long)
    for b, item in enumerate(items):
        rows = torch.as_tensor(np.asarray(item) if not torch.is_tensor(item) else item).long()
        if rows.dim() != 3 or tuple(rows.shape[1:]) != (layers, top_k) or rows.shape[0] > length:
            raise ValueError(
                f"routes of sequence {b} have shape {list(rows.shape)}; expected [at most {length}, "
                f"{layers}, {top_k}] (tokens, sparse layers, experts per token)"
            )
        out[b, : rows.shape[0]] = rows
    return out.reshape(batch * length, layers, top_k)


@contextlib.contextmanager
def replay_routes(model: nn.Module, routed_experts: object, input_shape: tuple[int, int]) -> Iterator[None]:
    """Within the block, forward passes of `model` over inputs of `input_shape` (batch, length) route token t of
    sequence b through `routed_experts[b][t]` ([sparse layers, top_k] global expert ids; rows beyond those given,
    or rows of -1, route themselves). `routed_experts`: one array per sequence ([tokens, layers, top_k], tokens <=
    length, aligned with the start of the input), or one [batch, tokens, layers, top_k] array; as returned by
    the engine (prompt + output tokens - 1 rows) for input_ids of the prompt and output tokens. Raises ValueError
    for a model without routers or routes of another shape."""
    found = routers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router (*TopKRouter) to replay")
    top_k = int(cast(Any, found[0]).top_k)
    batch, length = input_shape
    forced = _as_tensor(routed_experts, batch, length, len(found), top_k)
    saved = [router.__dict__.get("forward") for router in found]  # an instance's own forward, if it had one
    for layer, router in enumerate(found):
        router.forward = types.MethodType(_replaying(router.forward, forced[:, layer]), router)
    try:
        yield
    finally:
        for router, previous in zip(found, saved, strict=True):
            if previous is None:
                del router.__dict__["forward"]  # back to the class's method
            else:
                router.forward = previous


def _replaying(
    original: Callable[[torch.Tensor], _Routed], forced: torch.Tensor
) -> Callable[[nn.Module, torch.Tensor], _Routed]:
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> _Routed:
        logits, scores, indices = original(hidden_states)
        if logits.shape[0] != forced.shape[0]:
            raise ValueError(
                f"the router saw {logits.shape[0]} tokens; the routes cover {forced.shape[0]} "
                "(batch x length of replay_routes' input_shape)"
            )
        rows = forced[:, 0] >= 0
        if not bool(rows.any()):
            return logits, scores, indices
        ids = torch.where(rows[:, None], forced.to(indices.device), indices)
        probs = F.softmax(logits.float(), dim=-1)
        values = probs.gather(1, ids)
        if getattr(self, "norm_topk_prob", True):  # Mixtral's router always renormalizes
            values = values / values.sum(dim=-1, keepdim=True)
        values = torch.where(rows[:, None].to(values.device), values.to(scores.dtype), scores)
        return logits, values, ids

    return forward
