"""The scoped config context of a worker's entry points: every one that loads, reloads or updates weights (and
every other public Worker method) runs inside `use_config(worker.config)` and `use_parallel(worker.parallel)`,
restored on return and on error."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from hotswap.config import EngineConfig, use_config
from hotswap.distributed import ParallelContext, use_parallel

F = TypeVar("F", bound=Callable[..., Any])


class Scoped(Protocol):
    config: EngineConfig
    parallel: ParallelContext


def in_config_scope(method: F) -> F:
    """Runs a Worker method inside its config context."""

    @functools.wraps(method)
    def wrapper(self: Scoped, *args: Any, **kwargs: Any) -> Any:
        with use_config(self.config), use_parallel(self.parallel):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
