"""A real server process on loopback for tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx

from hotswap import testing


@contextlib.contextmanager
def running_server(model_dir: str, *extra: str, log: Path | None = None) -> Iterator[str]:
    """Starts `hotswap serve` on a free loopback port; yields its base URL; stops it afterwards. With `log`, the
    server's output goes to that file (for tests that read it)."""
    with testing.running_server(model_dir, *extra, log=log, start_timeout_s=120) as (base, _):
        yield base


def post(base: str, path: str, **body):
    """POSTs `body` as JSON to `path` of the server at `base` (a generous timeout: a generation may run)."""
    return httpx.post(f"{base}{path}", json=body, timeout=120)
