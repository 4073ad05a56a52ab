"""The typed interfaces every front end talks to, each verb named once with its types.

`EngineClient` (async): `AsyncLLMEngine` (one engine) and `AsyncFleet` (replicas on Ray) implement it; the HTTP
server takes an `EngineClient` and nothing else. `LLMClient` (sync): `LLM` (one engine) and `Fleet` implement it,
for offline use and trainers in the same process. Both answer `status()` at once, without a lock: one frozen
`EngineStatus` (an engine's own state, or a fleet's from its last health checks), open weight change included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, Protocol, TypeVar

import torch

from hotswap.config import EngineConfig
from hotswap.engine.canary import Canary
from hotswap.engine.detokenizer import Detokenizer
from hotswap.inputs import PromptType, Tokenizer
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput, TokenScores
from hotswap.sampling_params import SamplingParams
from hotswap.weights.version import VersionArg

if TYPE_CHECKING:
    from hotswap.engine.llm_engine import LLMEngine

P = ParamSpec("P")
R = TypeVar("R")

Pairs = Iterable[tuple[str, torch.Tensor]]
"""A model's weights as (name, tensor) pairs, e.g. a trainer's `model.named_parameters()`."""
UpdateInfo = dict[str, object] | list[dict[str, object]]
"""An `update_weights` declaration (names, dtypes, shapes, ...; its transport's fields), or one per worker."""
SessionFigures = dict[str, float | int | None]
"""A session's figures (`SessionStats.json()`: requests, prompt tokens, prefix-cache hits, the hit rate)."""
CanaryArg = Canary | Mapping[str, object] | None
"""Probes scored before a commit (hotswap/engine/canary.py): a `Canary`, or its fields as a dict."""


class ChangeRecord(Protocol):
    """The open weight change as front ends read it (the engine's `OpenChange`, a fleet's `FleetChange`)."""

    @property
    def token(self) -> str | None: ...  # a transfer session's token; None: a reload

    @property
    def started(self) -> float: ...  # when it opened (time.monotonic())

    @property
    def version(self) -> VersionArg: ...  # the version it commits as (None: the next)


@dataclass(frozen=True)
class EngineStatus:
    """An engine's (or a fleet's) state at one moment, read without a lock: for health checks, metrics, version
    reports and the routes that depend on the state. A fleet's figures are its own (versions, pause, the change)
    and its replicas' as of their last health check."""

    weight_version: int  # the served version (the integer that orders them)
    weight_version_label: str  # ... as clients see it
    draft_weight_version: int  # the target version the speculative draft was last updated for
    draft_weight_version_label: str
    draft_stale: bool
    paused: bool
    pause_mode: str  # the latest pause's mode
    refusing_new_requests: bool  # a pause in 'abort' or 'wait' mode is under way or in effect
    asleep: bool
    health_problem: str | None  # why it cannot serve now (a dead worker, invalid weights), or None
    requests: int  # requests in flight
    running: int = 0  # sequences running in the scheduler (a fleet: its replicas' together)
    waiting: int = 0  # ... and waiting there
    stats: Mapping[str, float] = field(default_factory=dict)
    change: ChangeRecord | None = None  # the open weight change


class ReplicaControl(Protocol):
    """A fleet's replicas joining and leaving (`/fleet/add_replicas`, `/fleet/remove_replicas`) and their
    report (`/fleet_status`)."""

    async def add_replicas(self, n: int = 1) -> list[int]: ...

    async def remove_replicas(
        self, n: int | None = None, indices: Sequence[int] | None = None, drain_timeout_s: float = 120.0
    ) -> list[int]: ...

    def replica_status(self) -> list[dict[str, Any]]: ...


class EngineClient(Protocol):
    """Requests, the weight lifecycle, pause and resume, sleep and wake, live config, versions, info. `local` and
    `replicas` are what only one engine, or only a fleet, serves (None where the other is behind the client)."""

    @property
    def local(self) -> LocalEngine | None: ...

    @property
    def replicas(self) -> ReplicaControl | None: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def detokenizer(self) -> Detokenizer: ...

    @property
    def world_size(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    def status(self) -> EngineStatus: ...

    # requests
    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        routing_key: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def open_session(self, session_id: str) -> None: ...

    async def close_session(self, session_id: str) -> SessionFigures | None: ...

    async def session_stats(self, session_id: str) -> SessionFigures | None: ...

    async def abort_requests(self, request_ids: list[str] | None = None, prefix: str | None = None) -> list[str]: ...

    # pause, sleep, maintenance
    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None: ...

    async def resume_generation(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def reset_prefix_cache(self) -> None: ...

    async def update_config(self, overrides: dict[str, dict[str, object]]) -> None: ...

    # the weight lifecycle
    async def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Pairs | None = None,
        target: str = "model",
        weight_version: VersionArg = None,
        encoding: str | None = None,
        base_version: VersionArg = None,
        checksums: dict[str, str] | None = None,
    ) -> None: ...

    async def check_liveness(self, timeout_s: float = 5.0) -> float: ...

    async def init_weight_transfer_engine(self, init_info: dict[str, object]) -> None: ...

    async def start_weight_update(self, target: str = "model") -> str: ...

    async def update_weights(self, update_info: UpdateInfo, session_token: str | None = None) -> None: ...

    async def finish_weight_update(
        self, weight_version: VersionArg = None, session_token: str | None = None, canary: CanaryArg = None
    ) -> None: ...

    async def abort_weight_update(self, session_token: str | None = None) -> None: ...

    async def set_change_version(self, weight_version: VersionArg, session_token: str | None = None) -> None: ...

    async def shutdown_weight_transfer_engine(self) -> None: ...

    # LoRA adapters
    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        load_inplace: bool = False,
        tensors: dict[str, torch.Tensor] | None = None,
        peft_config: dict[str, object] | None = None,
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
        self,
        method: str | Callable[..., object],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> list[Any]: ...

    async def shutdown(self) -> None: ...


class LocalEngine(EngineClient, Protocol):
    """An `EngineClient` of one engine in this process, and what only it serves: teacher scoring, calls on its
    `LLMEngine` between two steps (a consistent snapshot, `/export_state`), and taking another engine's weights
    (`--join`)."""

    async def score_tokens(
        self,
        sequences: list[list[int]],
        temperature: float = 1.0,
        top_logprobs: int = 0,
        top_k: int = -1,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ) -> list[TokenScores]: ...

    async def between_steps(
        self, fn: Callable[Concatenate[LLMEngine, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R: ...

    async def adopt_weights(
        self, states: list[dict[str, torch.Tensor]], weight_version: int, draft_weight_version: int | None = None
    ) -> None: ...


class LLMClient(Protocol):
    """`LLM` and `Fleet`: generate and chat, the weight lifecycle, pause and resume, sleep and wake, LoRA
    adapters, versions, blocking until each call is done. `hotswap.LLM.create` builds the one a configuration asks
    for (`data_parallel_size` > 1: a `Fleet`)."""

    @property
    def config(self) -> EngineConfig: ...

    def get_tokenizer(self) -> Tokenizer: ...

    def status(self) -> EngineStatus: ...

    # requests
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = ...,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]: ...

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = ...,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]: ...

    # pause, sleep, maintenance
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None: ...

    def resume_generation(self) -> None: ...

    def is_paused(self) -> bool: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def update_config(self, overrides: dict[str, dict[str, object]]) -> None: ...

    def check_liveness(self, timeout_s: float = 5.0) -> float: ...

    # the weight lifecycle
    def reload_weights(
        self,
        weights_path: str | None = None,
        weights_iterator: Pairs | None = None,
        target: str = "model",
        weight_version: VersionArg = None,
        encoding: str | None = None,
        base_version: VersionArg = None,
        checksums: dict[str, str] | None = None,
    ) -> None: ...

    def init_weight_transfer_engine(self, init_info: dict[str, object]) -> None: ...

    def start_weight_update(self, target: str = "model") -> str: ...

    def update_weights(self, update_info: UpdateInfo, session_token: str | None = None) -> None: ...

    def finish_weight_update(
        self, weight_version: VersionArg = None, session_token: str | None = None, canary: CanaryArg = None
    ) -> None: ...

    def abort_weight_update(self, session_token: str | None = None) -> None: ...

    def shutdown_weight_transfer_engine(self) -> None: ...

    # LoRA adapters
    def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str | None = None,
        load_inplace: bool = False,
        tensors: dict[str, torch.Tensor] | None = None,
        peft_config: dict[str, object] | None = None,
        lora_int_id: int | None = None,
        pinned: bool = False,
    ) -> dict[str, Any]: ...

    def unload_lora_adapter(self, lora_name: str) -> None: ...

    def list_loras(self) -> list[dict[str, Any]]: ...

    # versions
    def get_weight_version(self, target: str = "model") -> int: ...

    def get_weight_version_label(self) -> str: ...

    def update_weight_version(self, new_version: int | str, abort_all_requests: bool = False) -> str: ...

    def weight_checksums(self, target: str = "model") -> dict[str, str]: ...

    # workers, lifetime
    def collective_rpc(
        self,
        method: str | Callable[..., object],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
        timeout: float | None = None,
    ) -> list[Any]: ...

    def shutdown(self) -> None: ...


# ---- the verb table ---------------------------------------------------------------------------------------------

Wrap = Literal["locked", "between_steps", "in_thread", "own", "-"]
"""How a front end makes a verb: "locked" (`LLM`: the engine's or its weights controller's method under the LLM's
lock), "between_steps" (`AsyncLLMEngine`: that method in the engine's thread under the engine lock, between two
steps), "in_thread" (`AsyncFleet`: the `Fleet`'s method in a worker thread), "own" (written by hand: it does more
than forward), "-" (not served)."""


@dataclass(frozen=True)
class VerbRow:
    """One verb: where one engine runs it (`source`: "weights" for `WeightsController`, "engine" for `LLMEngine`;
    "" where no front end forwards it) and how `LLM`, `AsyncLLMEngine` and `AsyncFleet` make it."""

    source: Literal["weights", "engine", ""]
    llm: Wrap
    async_engine: Wrap
    async_fleet: Wrap


VERBS: dict[str, VerbRow] = {
    # the transfer session and the transport
    "start_weight_update": VerbRow("weights", "locked", "between_steps", "in_thread"),
    "update_weights": VerbRow("weights", "locked", "own", "in_thread"),  # staged: received in slices
    "finish_weight_update": VerbRow("weights", "locked", "between_steps", "in_thread"),
    "abort_weight_update": VerbRow("weights", "locked", "own", "in_thread"),  # interrupts a blocked wait first
    "shutdown_weight_transfer_engine": VerbRow("weights", "locked", "between_steps", "in_thread"),
    "set_change_version": VerbRow("", "-", "own", "in_thread"),
    "init_weight_transfer_engine": VerbRow("", "own", "own", "in_thread"),  # polls, releasing the lock
    "reload_weights": VerbRow("weights", "own", "own", "in_thread"),  # one engine: staged in slices
    # one engine's two-phase changes, which a fleet drives replica by replica
    "prepare_weight_update": VerbRow("weights", "-", "between_steps", "-"),
    "prepare_reload": VerbRow("weights", "-", "between_steps", "-"),
    "commit_weight_update": VerbRow("weights", "-", "between_steps", "-"),
    "export_weights": VerbRow("weights", "-", "between_steps", "-"),
    "adopt_weights": VerbRow("weights", "-", "between_steps", "-"),
    # pause, sleep, maintenance
    "pause_generation": VerbRow("", "own", "own", "in_thread"),  # delivers the aborted outputs
    "resume_generation": VerbRow("", "own", "own", "in_thread"),
    "sleep": VerbRow("engine", "locked", "between_steps", "in_thread"),
    "wake_up": VerbRow("", "own", "own", "in_thread"),  # wakes the step loop
    "reset_prefix_cache": VerbRow("", "own", "own", "in_thread"),
    "update_config": VerbRow("engine", "locked", "between_steps", "in_thread"),
    "check_liveness": VerbRow("", "own", "own", "in_thread"),
    "update_weight_version": VerbRow("", "own", "own", "in_thread"),  # may abort every request
    # LoRA adapters, workers, lifetime
    "load_lora_adapter": VerbRow("", "own", "own", "in_thread"),
    "unload_lora_adapter": VerbRow("", "own", "own", "in_thread"),
    "list_loras": VerbRow("", "own", "own", "in_thread"),
    "collective_rpc": VerbRow("", "own", "own", "in_thread"),
    "shutdown": VerbRow("", "own", "own", "in_thread"),
}
"""Every blocking verb of the front ends and how each front end makes it; the wrappers carry their kind
(`__verb__`) and source (`__wrapped__`), and tests/test_client_verbs.py checks the classes against this table."""
