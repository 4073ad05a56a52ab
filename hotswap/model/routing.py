"""Routing replay inside the model: recording each sparse layer's top-k experts, and forcing given ones.

A mixture-of-experts model numbers its sparse blocks in module order when it is built (`SparseMoeBlock.
routing_layer`). For one forward pass over a flat batch of T tokens the model runner puts a `Routes` in the pass's
`StepContext` (hotswap/model/step.py), with `record` and/or `forced` ([T, sparse layers, top_k] global expert ids,
-1 in a row's first column: that token routes itself); after the pass `take()` gives [T, sparse layers, top_k]
int64, the experts each token used, in the router's order (forced rows: as given). A pass without a `Routes` (the
draft's, a step that neither records nor forces) routes on its own and records nothing.

Under tensor or expert parallelism every rank routes every token itself (the router is replicated), so every
rank records the same ids; expert ids are global, whatever rank holds the expert.
"""

from __future__ import annotations

import torch


class Routes:
    """One forward pass's routing input and output, read by the model's sparse blocks (see the module doc)."""

    def __init__(self, num_layers: int, record: bool, forced: torch.Tensor | None = None) -> None:
        self.num_layers = num_layers
        self.record = record
        self.forced = forced
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
        """The ids recorded in this pass, [T, layers, top_k] (int64)."""
        recorded, self._recorded = self._recorded, []
        if len(recorded) != self.num_layers:
            raise RuntimeError(
                f"recorded {len(recorded)} sparse layers of {self.num_layers}: a pass did not run "
                "every sparse layer once"
            )
        return torch.stack(recorded, dim=1)


def routes_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids below `num_experts`."""
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32768 else torch.int32
