"""A real server process on loopback for tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from transfer_helpers import free_port


@contextlib.contextmanager
def running_server(model_dir: str, *extra: str, log: Path | None = None) -> Iterator[str]:
    """Starts `hotswap serve` on a free loopback port; yields its base URL; stops it afterwards. With `log`, the
    server's output goes to that file (for tests that read it)."""
    port = free_port()
    out = open(log, "w") if log is not None else subprocess.PIPE  # closed once the process ended
    proc = subprocess.Popen(
        [sys.executable, "-m", "hotswap", "serve", model_dir, "--port", str(port), *extra],
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{proc.stdout.read() if proc.stdout else log}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            out.close()


def post(base: str, path: str, **body):
    """POSTs `body` as JSON to `path` of the server at `base` (a generous timeout: a generation may run)."""
    return httpx.post(f"{base}{path}", json=body, timeout=120)
