"""A sequence's routed experts: one row per token position the model ran forward on.

Row p holds, for every sparse layer, the top-k experts token p used when its KV was computed: by the forward pass
that then sampled token p + 1 (for a prompt's last token and every generated one), so a row's weight version is
that of the token after it. The first pass over a position is kept: a recomputation (after preemption, or a
prefix-cache block) never rewrites a row, so every row stays that of the pass whose output the sequence went on
from. Rows arrive in order; a sequence's rows cover positions 0 .. `length` - 1.
"""

from __future__ import annotations

import numpy as np


class RouteLog:
    """Rows [length, sparse layers, top_k] of one sequence (see the module doc)."""

    def __init__(self) -> None:
        self._rows: np.ndarray | None = None  # capacity grows by doubling; rows beyond `length` are unset
        self.length = 0

    def write(self, start: int, rows: np.ndarray) -> None:
        """Rows for positions start .. start + len(rows) - 1; those already held are kept (first pass wins)."""
        assert start <= self.length, f"routes for position {start} arrive before position {self.length}'s"
        new = rows[self.length - start :]
        if not len(new):
            return
        end = self.length + len(new)
        if self._rows is None or end > len(self._rows):
            grown = np.empty(
                (max(end, 2 * (0 if self._rows is None else len(self._rows)), 16), *rows.shape[1:]), dtype=rows.dtype
            )
            if self._rows is not None:
                grown[: self.length] = self._rows[: self.length]
            self._rows = grown
        self._rows[self.length : end] = new
        self.length = end

    def rows(self, start: int, end: int) -> np.ndarray:
        """A copy of rows start .. end - 1 (all held)."""
        assert self._rows is not None and end <= self.length, "routes asked beyond those recorded"
        return self._rows[start:end].copy()

    def array(self, length: int) -> np.ndarray | None:
        """The first min(length, self.length) rows as one array (a copy); None before any row."""
        if self._rows is None:
            return None
        return self._rows[: min(length, self.length)].copy()

    def copy(self) -> RouteLog:
        other = RouteLog()
        if self._rows is not None:
            other._rows, other.length = self._rows[: self.length].copy(), self.length
        return other
