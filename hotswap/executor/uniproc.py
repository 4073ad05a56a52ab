"""A single worker in the engine's own process."""

from __future__ import annotations

from typing import Any

from hotswap.config import EngineConfig
from hotswap.executor.base import Executor, RpcMethod
from hotswap.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config, rank=0)

    def collective_rpc(
        self,
        method: RpcMethod,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        # In process, a call cannot be interrupted safely, so `timeout` is accepted but not enforced here.
        return [self.worker.execute_method(method, *args, **(kwargs or {}))]
