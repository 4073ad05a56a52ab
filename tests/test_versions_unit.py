"""Version labels and weight targets, alone (no engine)."""

from __future__ import annotations

import pytest

from hotswap.weights.target import check_target
from hotswap.weights.version import KEPT_LABELS, MAX_LABEL_CHARS, VersionLabels, parse_version

pytestmark = pytest.mark.unit


def test_a_version_is_an_integer_a_digit_string_or_a_label():
    assert parse_version(None) == (None, None)
    assert parse_version(7) == (7, None)
    assert parse_version("0012") == (12, "0012")
    assert parse_version("step-1") == (None, "step-1")
    assert parse_version("run7/ckpt-00042") == (None, "run7/ckpt-00042")
    assert parse_version("x" * MAX_LABEL_CHARS) == (None, "x" * MAX_LABEL_CHARS)
    assert parse_version("٣") == (None, "٣")  # a non-ASCII digit is a label, not an integer


@pytest.mark.parametrize("bad", ["", "  ", "x" * (MAX_LABEL_CHARS + 1), True, 1.5, ["v"], -1, {"v": 1}])
def test_bad_versions_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="new_version"):
        parse_version(bad, "new_version")


def test_labels_fall_back_to_the_integer_and_keep_the_most_recent():
    labels = VersionLabels()
    assert labels.label(3) == "3"
    labels.set(3, "step-1")
    labels.set(4, "step-1")  # one label on two versions: the integers tell them apart
    assert (labels.label(3), labels.label(4)) == ("step-1", "step-1")
    labels.set(4, "4")  # a version's own integer: unlabelled
    assert labels.snapshot() == {3: "step-1"}
    for v in range(10, 10 + KEPT_LABELS + 1):
        labels.set(v, f"l{v}")
    assert labels.label(3) == "3" and labels.label(10 + KEPT_LABELS) == f"l{10 + KEPT_LABELS}"
    assert len(labels.snapshot()) == KEPT_LABELS


def test_targets_are_checked_by_one_function():
    assert check_target("all") == "all"
    assert check_target("draft", ("model", "draft")) == "draft"
    with pytest.raises(ValueError, match=r"reload_weights target must be one of 'model', 'draft', got 'all'"):
        check_target("all", ("model", "draft"), "reload_weights target")
