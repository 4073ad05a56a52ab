"""Errors the engine's front ends raise for conditions a caller can act on."""


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (asleep, paused, or no replica routable); retry after wake_up /
    resume_generation. HTTP: 503 with Retry-After."""


class EngineUnresponsive(RuntimeError):
    """A liveness check (`check_liveness`) got no answer in time: the engine did not come between steps, or a
    worker did not answer (a worker that misses the deadline is declared dead: its channel is out of step). HTTP:
    503 with `engine_unresponsive`."""


class EngineBusy(RuntimeError):
    """A liveness check found the engine held by an admin call (a reload, an update, a sleep) for the whole
    timeout: alive and working, not asked. HTTP: `/liveness` answers 200 with status "busy"."""
