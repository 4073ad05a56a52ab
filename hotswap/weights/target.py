"""What a weight change or a version query applies to: the served model, the speculative draft, or both."""

from __future__ import annotations

from typing import Literal

WeightTarget = Literal["model", "draft", "all"]
TARGETS: tuple[WeightTarget, ...] = ("model", "draft", "all")


def check_target(value: object, allowed: tuple[WeightTarget, ...] = TARGETS, what: str = "target") -> WeightTarget:
    """`value` as a WeightTarget. Raises ValueError naming `what` and the allowed values otherwise."""
    for target in allowed:
        if value == target:
            return target
    raise ValueError(f"{what} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
