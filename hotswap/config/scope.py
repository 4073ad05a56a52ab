"""The scoped config context: `use_config(cfg)` makes `cfg` the live config over a `contextvars.ContextVar` inside a
block, `current_config()` reads it and raises outside any scope. Worker entry points that load, reload or update
weights run inside it; layers do not read it (they take their settings at construction)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, TypeVar

from hotswap.config.engine import EngineConfig

_CURRENT: contextvars.ContextVar[EngineConfig | None] = contextvars.ContextVar("hotswap_config", default=None)


T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[Any], value: T) -> Iterator[T]:
    """Sets `var` to `value` inside the block; the previous value is restored on exit, also on error."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def use_config(config: EngineConfig) -> contextlib.AbstractContextManager[EngineConfig]:
    """Makes `config` the live config inside the block; the previous one is restored on exit, also on error."""
    return scoped(_CURRENT, config)


def current_config() -> EngineConfig:
    """The live engine config. Raises RuntimeError outside any `use_config` scope."""
    config = _CURRENT.get()
    if config is None:
        raise RuntimeError(
            "current_config() called outside a config scope; wrap the call in `with use_config(config):` "
            "(worker entry points do this for you)"
        )
    return config


def current_config_or_none() -> EngineConfig | None:
    """The live engine config, or None outside any `use_config` scope."""
    return _CURRENT.get()
