"""The executor is the engine's only door to its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from hotswap.config import EngineConfig
from hotswap.worker.commands import Command

# A Worker method name, or a callable taking the worker as its first argument.
RpcMethod = str | Callable[..., Any]


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(
        self,
        method: RpcMethod,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Runs `method` on every worker and returns one result per worker, rank order.

        `method` is a Worker method name or a callable taking the worker as its first argument. Raises
        TimeoutError if a worker does not answer within `timeout` seconds (where the executor can tell)."""

    def send(self, command: Command, timeout: float | None = None) -> list[Any]:
        """Runs one weight-change command (hotswap/worker/commands.py) on every worker: one result per worker,
        rank order. Every command goes through the worker's one dispatcher, `Worker.apply`."""
        return self.collective_rpc("apply", (command,), {}, timeout)

    def interrupt_waits(self) -> None:
        """Makes the workers' transport waits (for a trainer that has not sent yet) give up now, without waiting
        for the call in progress: the way an abort reaches an update that blocks its worker. Answers at once."""
        from hotswap.transfer.base import interrupt_waits

        interrupt_waits()  # in-process workers share this process's flag

    def health_problem(self) -> str | None:
        """Why the workers cannot serve (e.g. one died), or None; answers at once, without calling them."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook; nothing to release by default
        """Releases the workers."""
