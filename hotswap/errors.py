"""Errors the engine's front ends raise for conditions a caller can act on."""


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (asleep, paused, or no replica routable); retry after wake_up /
    resume_generation. HTTP: 503 with Retry-After."""
