"""Which replica serves a request.

Requests with a routing key (a `cache_salt`, a session id) go to the replica the key hashes to among the
routable ones (rendezvous hashing: when a replica leaves, only its keys move), so their prefix cache stays on one
replica. Others go to the replica with the fewest outstanding tokens: the prompt and the tokens still to generate
of every request it holds. A request's n samples are one request, so a GRPO group stays on one replica.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable


def request_cost(prompt_tokens: int, max_tokens: int, n: int) -> int:
    """The tokens a request is expected to cost its replica: the prompt once, each sample's tokens."""
    return prompt_tokens + max(0, max_tokens) * max(1, n)


class Router:
    """Thread-safe load book and replica choice. `routable` (replica indices) is passed on every pick, so the
    fleet alone decides which replicas may take traffic."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outstanding: dict[int, int] = {}  # replica -> outstanding tokens
        self._requests: dict[str, tuple[int, int]] = {}  # request id -> (replica, its outstanding tokens)
        self.routed: dict[int, int] = {}  # replica -> requests routed to it, ever

    def pick(self, routable: Iterable[int], key: str | None = None) -> int:
        """The replica for a request. Raises RuntimeError when no replica is routable."""
        choices = sorted(set(routable))
        if not choices:
            raise RuntimeError(
                "no replica can take requests now (all are down, restarting or being brought to the "
                "fleet's weight version); retry shortly"
            )
        if key is not None:
            return max(choices, key=lambda r: hashlib.blake2b(f"{r}:{key}".encode(), digest_size=8).digest())
        with self._lock:
            return min(choices, key=lambda r: (self._outstanding.get(r, 0), self.routed.get(r, 0), r))

    def started(self, request_id: str, replica: int, cost: int) -> None:
        with self._lock:
            self._requests[request_id] = (replica, cost)
            self._outstanding[replica] = self._outstanding.get(replica, 0) + cost
            self.routed[replica] = self.routed.get(replica, 0) + 1

    def progressed(self, request_id: str, tokens: int) -> None:
        """`tokens` of the request's outstanding ones were produced (or are no longer expected)."""
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is None:
                return
            replica, left = entry
            done = min(left, max(0, tokens))
            self._requests[request_id] = (replica, left - done)
            self._outstanding[replica] -= done

    def finished(self, request_id: str) -> None:
        with self._lock:
            entry = self._requests.pop(request_id, None)
            if entry is not None:
                self._outstanding[entry[0]] -= entry[1]

    def replica_of(self, request_id: str) -> int | None:
        with self._lock:
            entry = self._requests.get(request_id)
            return None if entry is None else entry[0]

    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    def requests_on(self, replica: int) -> int:
        """Requests booked on `replica` and not finished."""
        with self._lock:
            return sum(1 for r, _ in self._requests.values() if r == replica)

    def outstanding(self, replica: int) -> int:
        with self._lock:
            return self._outstanding.get(replica, 0)
