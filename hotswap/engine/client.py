"""The typed interface every front end talks to: `EngineClient` names each verb once, with its types.

`AsyncLLMEngine` (one engine) and `AsyncFleet` (replicas on Ray) implement it; the HTTP server takes an
`EngineClient` and nothing else. `EngineView` is what a front end reads without awaiting (an engine's own state,
or a fleet's from its last health checks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection
from typing import Any, Protocol

import torch

from hotswap.config import EngineConfig
from hotswap.engine.detokenizer import Detokenizer
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams
from hotswap.weights.version import VersionArg, VersionLabels


class EngineView(Protocol):
    """Answers at once, without a lock: for health checks, metrics and version reports."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def detokenizer(self) -> Detokenizer: ...

    @property
    def weight_version(self) -> int: ...

    @property
    def weight_version_label(self) -> str: ...

    @property
    def version_labels(self) -> VersionLabels: ...

    @property
    def draft_weight_version(self) -> int: ...

    @property
    def draft_stale(self) -> bool: ...

    @property
    def requests(self) -> Collection[str]: ...

    @property
    def pause_mode(self) -> str: ...

    def health_problem(self) -> str | None: ...

    def stats(self) -> dict[str, Any]: ...

    def refusing_new_requests(self) -> bool: ...

    def is_paused(self) -> bool: ...

    def is_asleep(self) -> bool: ...


class EngineClient(Protocol):
    """Requests, the weight lifecycle, pause and resume, sleep and wake, live config, versions, info."""

    @property
    def engine(self) -> EngineView: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def world_size(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    # requests
    def generate(
        self,
        prompt: str | dict[str, Any],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        routing_key: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def open_session(self, session_id: str) -> None: ...

    async def close_session(self, session_id: str) -> dict[str, Any] | None: ...

    async def session_stats(self, session_id: str) -> dict[str, Any] | None: ...

    async def abort_requests(self, request_ids: list[str] | None = None, prefix: str | None = None) -> list[str]: ...

    # pause, sleep, maintenance
    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None: ...

    async def resume_generation(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def reset_prefix_cache(self) -> None: ...

    async def update_config(self, overrides: dict[str, dict[str, Any]]) -> None: ...

    # the weight lifecycle
    async def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Any = None,
        target: str = "model",
        weight_version: VersionArg = None,
        encoding: str | None = None,
        base_version: VersionArg = None,
        checksums: dict[str, str] | None = None,
    ) -> None: ...

    async def check_liveness(self, timeout_s: float = 5.0) -> float: ...

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    async def start_weight_update(self, target: str = "model") -> str: ...

    async def update_weights(self, update_info: Any, session_token: str | None = None) -> None: ...

    async def finish_weight_update(
        self, weight_version: VersionArg = None, session_token: str | None = None, canary: Any = None
    ) -> None: ...

    async def abort_weight_update(self, session_token: str | None = None) -> None: ...

    async def shutdown_weight_transfer_engine(self) -> None: ...

    # LoRA adapters
    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        load_inplace: bool = False,
        tensors: dict[str, torch.Tensor] | None = None,
        peft_config: dict[str, Any] | None = None,
        lora_int_id: int | None = None,
        pinned: bool = False,
    ) -> dict[str, Any]: ...

    async def unload_lora_adapter(self, lora_name: str) -> None: ...

    async def list_loras(self) -> list[dict[str, Any]]: ...

    # versions
    async def get_weight_version(self, target: str = "model") -> int: ...

    async def update_weight_version(self, new_version: int | str, abort_all_requests: bool = False) -> str: ...

    # workers, lifetime
    async def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]: ...

    async def shutdown(self) -> None: ...
