"""Weight versions: an integer that orders them, and the label a client gave.

Every committed weight change advances the engine's integer version (or takes the integer a client gave). vLLM's
and SGLang's clients name versions with free strings ("step-1", "run7/ckpt-00042", a run id and a step); such a
label is kept beside the integer and returned wherever a version is shown (HTTP routes, token spans, metrics,
fleet status). A version nobody labelled is shown as its integer, as a string.

Two versions may carry the same label: their integers still differ, so the token spans of a request that straddled
both are separate spans (and the object-shaped spans carry `version_id`, the integer).
"""

from __future__ import annotations

MAX_LABEL_CHARS = 256
KEPT_LABELS = 4096  # the most recent labelled versions remembered (older versions show their integer)

# What a client may give as a version: None (the next integer), an integer, or a label.
VersionArg = int | str | None


def parse_version(value: object, field: str = "weight_version") -> tuple[int | None, str | None]:
    """A version a client gave, as (integer or None for "the next one", label or None for "the integer").

    An int is that integer; a string of ASCII digits is that integer, labelled as written; any other non-empty
    string of at most `MAX_LABEL_CHARS` characters labels the next integer. Raises ValueError naming `field`
    for anything else (empty, blank, too long, negative, bool, another type)."""
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{field} must be a string label or an integer, got {type(value).__name__} {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field} must be >= 0 when it is an integer, got {value}")
        return value, None
    if not value.strip():
        raise ValueError(f"{field} must be a non-empty label, got {value!r}")
    if len(value) > MAX_LABEL_CHARS:
        raise ValueError(f"{field} must be at most {MAX_LABEL_CHARS} characters, got {len(value)}")
    if value.isascii() and value.isdigit():
        return int(value), value
    return None, value


class VersionLabels:
    """The labels clients gave to integer versions (the most recent `KEPT_LABELS` of them)."""

    def __init__(self) -> None:
        self._labels: dict[int, str] = {}

    def label(self, version: int) -> str:
        """`version`'s label, or the integer as a string when none was given."""
        return self._labels.get(version, str(version))

    def set(self, version: int, label: str | None) -> None:
        """Labels `version` (None, or its own integer's string: unlabelled)."""
        self._labels.pop(version, None)
        if label is not None and label != str(version):
            self._labels[version] = label
            while len(self._labels) > KEPT_LABELS:
                del self._labels[next(iter(self._labels))]

    def snapshot(self) -> dict[int, str]:
        return dict(self._labels)

    def update(self, labels: dict[int, str]) -> None:
        for version, label in labels.items():
            self.set(int(version), label)
