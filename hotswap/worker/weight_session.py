"""The weight-transfer session of one worker: an explicit state machine.

    NO_ENGINE --init_weight_transfer_engine--> READY --start_weight_update--> ACTIVE
    ACTIVE --update_weights (x N)--> ACTIVE
    ACTIVE --finish_weight_update--> READY          (post-processing completes, copies dropped)
    ACTIVE --abort_weight_update / any failure--> READY   (atomic: rolled back; else: weights invalid)
    READY --shutdown_weight_transfer_engine--> NO_ENGINE

A call out of order raises RuntimeError naming the call that was expected.
"""

from __future__ import annotations

import enum
from typing import Any

from torch import nn

from hotswap.config import WeightTransferConfig
from hotswap.model.reload import WeightUpdate
from hotswap.transfer.base import TransferEngine, create_engine


class SessionState(enum.Enum):
    NO_ENGINE = "no_engine"
    READY = "ready"
    ACTIVE = "active"


class WeightUpdateFailed(RuntimeError):
    """A weight update failed; the message says whether the weights were rolled back."""


class WeightSession:
    def __init__(self) -> None:
        self.state = SessionState.NO_ENGINE
        self.engine: TransferEngine | None = None
        self.update: WeightUpdate | None = None

    def expect(self, *states: SessionState, call: str) -> None:
        if self.state in states:
            return
        hints = {
            SessionState.NO_ENGINE: "call init_weight_transfer_engine(init_info) first",
            SessionState.READY: "call start_weight_update() first",
            SessionState.ACTIVE: "a weight update is in progress; call update_weights(), finish_weight_update() "
            "or abort_weight_update()",
        }
        raise RuntimeError(f"{call}() is not allowed now (session state: {self.state.value}); {hints[self.state]}")

    def init_engine(self, init_info: dict[str, Any], config: WeightTransferConfig) -> None:
        self.expect(SessionState.NO_ENGINE, SessionState.READY, call="init_weight_transfer_engine")
        engine = create_engine(init_info, config)
        self.shutdown_engine()
        self.engine = engine
        self.state = SessionState.READY

    def start(self, model: nn.Module, config: WeightTransferConfig) -> None:
        self.expect(SessionState.READY, call="start_weight_update")
        self.update = WeightUpdate(model, atomic=config.atomic, check_finite=config.check_finite)
        self.state = SessionState.ACTIVE

    def end(self) -> WeightUpdate:
        assert self.update is not None
        update, self.update = self.update, None
        self.state = SessionState.READY
        return update

    def shutdown_engine(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None
        self.state = SessionState.NO_ENGINE
