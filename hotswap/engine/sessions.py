"""Sessions: the turns of one conversation (an agent's episode), named by a session id (`X-Session-ID`, SGLang's
`open_session`). A session's cached KV blocks are evicted after other traffic's, within a budget of blocks
(`session_cache_fraction` of the cache; see hotswap/engine/block_manager.py), so that turn N+1 finds turn N's
prefix; and each session counts its prompt tokens and prefix-cache hits, turn by turn.

Sessions open explicitly (`open`) or on a request that names one; at most `max_sessions` are open: the least
recently used beyond that is closed (its blocks lose their priority, its figures are dropped).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass

from hotswap.engine.block_manager import BlockManager


@dataclass
class SessionStats:
    """One session's figures: requests finished, their prompt tokens and prefix-cache hits, and the same from the
    second request on (a conversation's first turn has nothing to hit)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    later_prompt_tokens: int = 0
    later_cached_tokens: int = 0

    @property
    def hit_rate(self) -> float | None:
        """Prefix-cache hits over prompt tokens from the second request on (None before one)."""
        return self.later_cached_tokens / self.later_prompt_tokens if self.later_prompt_tokens else None

    def json(self) -> dict[str, float | int | None]:
        return {**asdict(self), "prefix_cache_hit_rate": self.hit_rate}


class Sessions:
    def __init__(self, max_sessions: int = 4096) -> None:
        self.block_manager: BlockManager | None = None
        self.max_sessions = max_sessions
        self.stats: OrderedDict[str, SessionStats] = OrderedDict()

    def attach(self, block_manager: BlockManager) -> None:
        """Uses `block_manager` from now on (a new one after the cache was released), with the open sessions."""
        self.block_manager = block_manager
        block_manager.open_sessions = set(self.stats)

    def open(self, session_id: str) -> None:
        """Opens `session_id` (no-op when open), closing the least recently used beyond `max_sessions`."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"a session id must be a non-empty string, got {session_id!r}")
        if session_id in self.stats:
            self.stats.move_to_end(session_id)
            return
        self.stats[session_id] = SessionStats()
        assert self.block_manager is not None
        self.block_manager.open_session(session_id)
        while len(self.stats) > self.max_sessions:
            self.close(next(iter(self.stats)))

    def close(self, session_id: str) -> SessionStats | None:
        """Closes `session_id`; returns its figures (None if it was not open). Its blocks stay cached, evicted
        in turn with the rest."""
        assert self.block_manager is not None
        self.block_manager.close_session(session_id)
        return self.stats.pop(session_id, None)

    def finished(self, session_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        """Counts a finished request of the session (if still open)."""
        stats = self.stats.get(session_id)
        if stats is None:
            return
        if stats.requests:
            stats.later_prompt_tokens += prompt_tokens
            stats.later_cached_tokens += cached_tokens
        stats.requests += 1
        stats.prompt_tokens += prompt_tokens
        stats.cached_tokens += cached_tokens
        self.stats.move_to_end(session_id)

    def totals(self) -> dict[str, int]:
        """Figures summed over the open sessions (for metrics)."""
        stats = list(self.stats.values())  # one copy (atomic): read off the engine thread, which changes the dict
        return {
            "session_later_prompt_tokens": sum(s.later_prompt_tokens for s in stats),
            "session_later_cached_tokens": sum(s.later_cached_tokens for s in stats),
            "open_sessions": len(stats),
            "session_cached_blocks": len(self.block_manager.session_evictable) if self.block_manager else 0,
        }
