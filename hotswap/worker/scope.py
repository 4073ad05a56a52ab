"""The scoped config context of a worker's entry points: every one that loads, reloads or updates weights (and
every other public Worker method) runs inside `use_config(worker.config)` and `use_parallel(worker.parallel)`,
restored on return and on error."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from hotswap.config import EngineConfig, use_config
from hotswap.distributed import ParallelContext, use_parallel


class Scoped(Protocol):
    config: EngineConfig
    parallel: ParallelContext


S = TypeVar("S", bound=Scoped)
P = ParamSpec("P")
R = TypeVar("R")


def in_config_scope(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Runs a Worker method inside its config context."""

    @functools.wraps(method)
    def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with use_config(self.config), use_parallel(self.parallel):
            return method(self, *args, **kwargs)

    return wrapper
