"""Routing replay inside the model: recording each sparse layer's top-k experts, and forcing given ones.

A model's sparse blocks share one `Routing`, which the model runner binds to its target model
(`moe.bind_routing`; a draft model's blocks stay unbound: they neither record nor take forced routes). For one
forward pass over a flat batch of T tokens the runner sets `record` and/or `forced` ([T, sparse layers, top_k]
global expert ids, -1 in a row's first column: that token routes itself), runs the model, then reads `take()`:
[T, sparse layers, top_k] int64, the experts each token used, in the router's order (forced rows: as given).

Under tensor or expert parallelism every rank routes every token itself (the router is replicated), so every
rank records the same ids; expert ids are global, whatever rank holds the expert.
"""

from __future__ import annotations

import torch


class Routing:
    """One forward pass's routing input and output, shared by a model's sparse blocks (see the module doc)."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int) -> None:
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.record = False
        self.forced: torch.Tensor | None = None
        self._recorded: list[torch.Tensor] = []

    def use(
        self, layer: int, weights: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (weights, ids) sparse layer `layer` goes on with: the router's own, or for forced rows the forced
        experts weighted by the router's probabilities (softmax of `logits` [T, E], float32) of them, renormalized
        when the model renormalizes its top-k; recorded when asked. Called once per layer per pass, in layer
        order."""
        if self.forced is not None:
            forced = self.forced[:, layer]
            rows = forced[:, 0] >= 0
            if bool(rows.any()):
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
                forced_weights = probs.gather(1, forced.clamp(min=0))
                if renormalize:
                    forced_weights = forced_weights / forced_weights.sum(dim=-1, keepdim=True)
                ids = torch.where(rows[:, None], forced, ids)
                weights = torch.where(rows[:, None], forced_weights, weights)
        if self.record:
            self._recorded.append(ids)
        return weights, ids

    def take(self) -> torch.Tensor:
        """The ids recorded in this pass, [T, layers, top_k] (int64); resets for the next pass."""
        recorded, self._recorded = self._recorded, []
        if len(recorded) != self.num_layers:
            raise RuntimeError(
                f"recorded {len(recorded)} sparse layers of {self.num_layers}: a pass did not run "
                "every sparse layer once"
            )
        return torch.stack(recorded, dim=1)

    def clear(self) -> None:
        self.record, self.forced, self._recorded = False, None, []


def routes_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids below `num_experts`."""
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32768 else torch.int32
