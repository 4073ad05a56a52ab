"""The engine's lifecycle: its state (see `state.py` for the machine), pause and resume, sleep and wake, and whether
new requests are refused. `LLMEngine` holds one `Lifecycle` and answers these calls through it; the step loop asks
it whether to step, and the weights controller moves it into UPDATING and back."""

from __future__ import annotations

from typing import Protocol

from hotswap.config import EngineConfig
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.state import EngineState
from hotswap.executor.base import Executor
from hotswap.outputs import RequestOutput


class WeightsValidity(Protocol):
    """Whether every worker's weights are valid (the engine's weights controller has it)."""

    valid: bool


class LifecycleHost(Protocol):
    """What the lifecycle moves of its engine (`LLMEngine` has it): the workers, the scheduler whose admissions it
    opens and closes, the weights whose validity sleep affects, and the engine's requests and KV cache."""

    config: EngineConfig
    executor: Executor
    scheduler: Scheduler

    @property
    def weights(self) -> WeightsValidity: ...

    def abort_requests(
        self, request_ids: list[str] | None = None, prefix: str | None = None
    ) -> list[RequestOutput]: ...

    def reset_prefix_cache(self, force: bool = False) -> None: ...

    def renew_kv_cache(self) -> None: ...


class Lifecycle:
    """The state machine of one engine, and the pause / sleep calls that move it (see `state.py`)."""

    def __init__(self, host: LifecycleHost) -> None:
        self.host = host
        self.state = EngineState.RUNNING
        self.return_to: list[EngineState] = []  # where UPDATING / ASLEEP go back to, innermost last
        self.released: set[str] = set()  # while ASLEEP: what sleep() released, "kv_cache" and/or "weights"
        self.pause_mode = "keep"  # of the latest pause (the server refuses new requests during abort / wait ones)

    # ---- the state machine ----------------------------------------------------------------------------------

    def enter_state(self, state: EngineState) -> None:
        """Enters UPDATING or ASLEEP, remembering the state to return to."""
        self.return_to.append(self.state)
        self.state = state

    def leave_state(self, state: EngineState) -> None:
        """Leaves UPDATING or ASLEEP (no-op when not in it) for the state it was entered from."""
        if self.state is state:
            self.state = self.return_to.pop()
            self.settle_drain()

    def serving_state(self) -> EngineState:
        """RUNNING, DRAINING or PAUSED: the current state, or the one UPDATING / ASLEEP return to."""
        return self.return_to[0] if self.return_to else self.state

    def _set_serving_state(self, state: EngineState) -> None:
        if self.return_to:
            self.return_to[0] = state
        else:
            self.state = state

    def settle_drain(self) -> None:
        """DRAINING becomes PAUSED once nothing is in flight (called wherever requests end)."""
        if self.serving_state() is EngineState.DRAINING and self.host.scheduler.num_in_flight() == 0:
            self._set_serving_state(EngineState.PAUSED)

    def is_asleep(self) -> bool:
        """Whether sleep() released something not woken yet (also while an update runs on top of it)."""
        return self.state is EngineState.ASLEEP or EngineState.ASLEEP in self.return_to

    def refusing_new_requests(self) -> bool:
        """Whether generation is paused (or draining) in 'abort' or 'wait' mode, in which vLLM's server answers
        new requests 503 rather than queueing them ('keep' queues them)."""
        state = self.serving_state()
        return state in (EngineState.PAUSED, EngineState.DRAINING) and self.pause_mode in ("abort", "wait")

    def is_paused(self) -> bool:
        """Whether generation is paused (also while an update runs or the engine sleeps on top of a pause)."""
        return self.serving_state() is EngineState.PAUSED

    # ---- pause and resume -----------------------------------------------------------------------------------

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> list[RequestOutput]:
        """Pauses generation. 'abort': every request ends now with finish_reason 'abort' (their final outputs are
        returned). 'keep': requests freeze where they are; with `clear_cache` their KV is dropped and recomputed
        on resume. 'wait': DRAINING: no new request starts, and the engine becomes PAUSED once the requests in
        flight finished (the caller keeps stepping). Requests added while paused wait for resume."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        self.pause_mode = mode
        outputs: list[RequestOutput] = []
        if mode == "abort":
            outputs = self.host.abort_requests()
        elif mode == "keep" and clear_cache:
            self.host.scheduler.preempt_all()
        self.host.scheduler.admit_new = False
        if self.serving_state() is not EngineState.PAUSED:
            self._set_serving_state(EngineState.DRAINING if mode == "wait" else EngineState.PAUSED)
        self.settle_drain()
        if clear_cache:
            self.host.reset_prefix_cache(force=True)
        return outputs

    def resume(self) -> None:
        self._set_serving_state(EngineState.RUNNING)
        self.host.scheduler.admit_new = True

    # ---- sleep and wake -------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Releases memory. Level 1: the KV cache (weights stay in host memory; a GPU's move there, and
        wake_up(["weights"]) brings them back). Level 2: the KV cache and the weights' memory (restore them with
        wake_up(["weights"]) then a reload or a full update). Refused while a
        sequence holds KV cache; requests that hold none (queued, or frozen by a 'keep' pause that cleared the
        cache) stay and run after wake_up and resume."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.state not in (EngineState.RUNNING, EngineState.PAUSED, EngineState.ASLEEP):
            raise RuntimeError(f"cannot sleep while {self.state.value}")
        running = self.host.scheduler.running
        if running:  # requests held without KV (queued, or frozen by 'keep') wait for wake_up
            raise RuntimeError(
                f"cannot sleep while {len(running)} sequence(s) hold KV cache; finish or abort them, "
                "or pause first (mode 'abort', 'wait', or 'keep' with clear_cache)"
            )
        self.host.executor.collective_rpc("sleep", (level,))
        if level == 2:
            self.host.weights.valid = False  # their memory was returned; a reload or full update restores them
        on_gpu = self.host.config.model_config.device != "cpu"  # level 1 moves a GPU's weights to the host (vLLM's)
        self.released |= {"kv_cache", "weights"} if level == 2 or on_gpu else {"kv_cache"}
        if self.state is not EngineState.ASLEEP:  # sleeping deeper while asleep stays in ASLEEP
            self.enter_state(EngineState.ASLEEP)
        self.host.reset_prefix_cache(force=True)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocates what sleep released: "weights" and/or "kv_cache" (default: both); the engine leaves ASLEEP
        once nothing released remains."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; expected 'weights' and/or 'kv_cache'")
        self.host.executor.collective_rpc("wake_up", (tags,))
        if "kv_cache" in tags and "kv_cache" in self.released:
            self.host.renew_kv_cache()
        self.released -= set(tags)
        if not self.released:
            if self.state is EngineState.ASLEEP:
                self.leave_state(EngineState.ASLEEP)
            elif EngineState.ASLEEP in self.return_to:  # woken during an update: it returns to the state before
                self.return_to.remove(EngineState.ASLEEP)
