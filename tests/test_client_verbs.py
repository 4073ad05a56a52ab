"""The front ends against their verb table (`hotswap.engine.client.VERBS`) and their protocols: each verb is made
the way the table says (a generated wrapper of its source, or written by hand), and every blocking verb of the
protocols is in the table."""

from __future__ import annotations

import inspect

import pytest

from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.engine.client import VERBS, EngineClient, LLMClient
from hotswap.engine.llm_engine import LLMEngine
from hotswap.engine.weights_controller import WeightsController
from hotswap.entrypoints.llm import LLM
from hotswap.fleet.async_fleet import AsyncFleet
from hotswap.fleet.fleet import Fleet

pytestmark = pytest.mark.unit

SOURCES = {"weights": WeightsController, "engine": LLMEngine}


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


@pytest.mark.parametrize(
    ("front", "column", "fleet_source"),
    [(LLM, "llm", False), (AsyncLLMEngine, "async_engine", False), (AsyncFleet, "async_fleet", True)],
)
def test_each_verb_is_made_as_the_table_says(front, column, fleet_source):
    for name, row in VERBS.items():
        how = getattr(row, column)
        member = inspect.getattr_static(front, name, None)
        if how == "-":
            assert member is None or not hasattr(member, "__verb__"), f"{front.__name__}.{name}"
            continue
        assert member is not None, f"{front.__name__} lacks {name}"
        if how == "own":
            assert "__verb__" not in vars(member), f"{front.__name__}.{name} is a generated wrapper"
            continue
        assert vars(member).get("__verb__") == how, f"{front.__name__}.{name} is not made {how!r}"
        source = getattr(Fleet, name) if fleet_source else getattr(SOURCES[row.source], name)
        assert member.__wrapped__ is source, f"{front.__name__}.{name} wraps another method"
        # the signature is the source's, written once there (less the object the wrapper supplies)
        assert list(inspect.signature(member).parameters)[1:] == list(inspect.signature(source).parameters)[1:]


def test_every_blocking_verb_of_the_protocols_is_in_the_table():
    verbs = set(VERBS)
    async_verbs = {n for n in _members(EngineClient) if inspect.iscoroutinefunction(getattr(EngineClient, n))}
    own = {"abort", "open_session", "close_session", "session_stats", "abort_requests", "is_paused"}
    own |= {"get_weight_version"}  # answered at once, from the front end's own state
    assert async_verbs - own <= verbs, sorted(async_verbs - own - verbs)
    sync_verbs = _members(LLMClient) - {"config", "get_tokenizer", "status", "generate", "chat", "is_paused"}
    sync_verbs -= {"get_weight_version", "get_weight_version_label", "weight_checksums"}
    assert sync_verbs <= verbs, sorted(sync_verbs - verbs)
