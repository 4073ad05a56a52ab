"""A few Prometheus metrics, rendered in the text exposition format (no client library needed)."""

from __future__ import annotations

import threading
from collections import defaultdict


class Metrics:
    """Counters and summaries (sum and count) with optional labels; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        self._help: dict[str, tuple[str, str]] = {}

    def describe(self, name: str, kind: str, text: str) -> None:
        self._help[name] = (kind, text)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        with self._lock:
            self._counters[(name, tuple(sorted(labels.items())))] += value

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._counters[(name, tuple(sorted(labels.items())))] = value

    def set_only(self, name: str, value: float, **labels: str) -> None:
        """Sets `name` with these labels and drops its series with other labels (an info metric: one series)."""
        with self._lock:
            for key in [k for k in self._counters if k[0] == name]:
                del self._counters[key]
            self._counters[(name, tuple(sorted(labels.items())))] = value

    def observe(self, name: str, seconds: float) -> None:
        """Adds one observation to a summary (`name`_sum and `name`_count)."""
        with self._lock:
            self._counters[(f"{name}_sum", ())] += seconds
            self._counters[(f"{name}_count", ())] += 1

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            items = sorted(self._counters.items())
        described: set[str] = set()
        for (name, labels), value in items:
            base = name.removesuffix("_sum").removesuffix("_count")
            if base in self._help and base not in described:
                kind, text = self._help[base]
                lines += [f"# HELP {base} {text}", f"# TYPE {base} {kind}"]
                described.add(base)
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{name}{{{label_text}}} {value}" if label_text else f"{name} {value}")
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    """A label value as the Prometheus text format writes it (backslash, double quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
