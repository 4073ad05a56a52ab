"""The engine's state: one enum, held and changed only by the engine's `Lifecycle` (lifecycle.py), which the step
loop, the pause / sleep calls and the weights controller move.

    RUNNING  --pause("abort" | "keep")--------------------------> PAUSED
    RUNNING  --pause("wait")-------------------------------------> DRAINING
    DRAINING --(step / abort: nothing in flight any more)--------> PAUSED
    PAUSED | DRAINING --resume()---------------------------------> RUNNING
    RUNNING | PAUSED | ASLEEP --start_weight_update()------------> UPDATING
    UPDATING --finish / abort / a failed update / shutdown-------> (the state it was entered from)
    RUNNING | PAUSED --sleep()------------------------------------> ASLEEP
    ASLEEP   --sleep() deeper-------------------------------------> ASLEEP
    ASLEEP   --wake_up() of everything released------------------> (the state it was entered from; woken during
                                                                      an update, UPDATING returns there)

RUNNING and DRAINING step; DRAINING admits no new request. PAUSED and UPDATING run no step (requests wait).
ASLEEP refuses to step: generating raises until wake_up. A pause while UPDATING or ASLEEP applies to the state
they return to. Starting a weight change (a session, a reload, a config change) while RUNNING or DRAINING with
requests in flight is refused: pause first.
"""

from __future__ import annotations

import enum


class EngineState(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"  # pause("wait"): requests in flight finish, nothing new starts
    PAUSED = "paused"
    UPDATING = "updating"  # a weight-update session is open
    ASLEEP = "asleep"

    @property
    def steps(self) -> bool:
        """Whether `step()` runs batches in this state."""
        return self in (EngineState.RUNNING, EngineState.DRAINING)
