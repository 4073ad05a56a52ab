"""Liveness: a no-op round trip through every worker once the engine is between steps (`LLM.check_liveness`,
`/liveness`), 503 `engine_unresponsive` within its timeout when a worker process is stopped; `/health` stays the
cheap check that calls no worker."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from hotswap import LLM, SamplingParams
from hotswap.errors import EngineUnresponsive
from hotswap.testing import running_server


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_check_liveness_round_trips_between_generations(ckpts):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    seconds = llm.check_liveness(timeout_s=2.0)
    assert 0 <= seconds < 2.0
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.slow
def test_a_stopped_worker_answers_503_within_the_timeout(ckpts):
    with running_server(
        str(ckpts["A"]), "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", str(1 << 22), start_timeout_s=180
    ) as (base, proc):
        ok = httpx.get(f"{base}/liveness", timeout=30)
        assert ok.status_code == 200 and ok.json()["status"] == "ok" and ok.json()["round_trip_ms"] >= 0
        assert httpx.get(f"{base}/liveness", params={"timeout_s": 0}, timeout=30).status_code == 400
        workers = [p for p in children(proc.pid) if "hotswap" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGSTOP)
        try:
            start = time.monotonic()
            health = httpx.get(f"{base}/health", timeout=10)
            assert health.status_code == 200  # the cheap check calls no worker: it cannot tell
            stalled = httpx.get(f"{base}/liveness", params={"timeout_s": 2}, timeout=30)
            took = time.monotonic() - start
            assert stalled.status_code == 503, stalled.text
            assert stalled.json()["error"]["type"] == "engine_unresponsive"
            assert took < 2.0 + 4.0, took  # the timeout, then the stuck worker is stopped (0.5 s grace, then killed)
            # a worker that missed the deadline is out of step: the engine now says so on /health too
            assert httpx.get(f"{base}/health", timeout=10).status_code == 503
        finally:
            with contextlib.suppress(ProcessLookupError):  # the engine stopped the worker that missed its deadline
                os.kill(workers[1], signal.SIGCONT)


def test_an_engine_stuck_in_a_step_is_unresponsive(ckpts):
    """While another thread holds the engine (a step that does not end), the check gives up after its timeout."""
    import threading

    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    release = threading.Event()
    held = threading.Event()

    def hold() -> None:
        with llm._lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(5)
    try:
        start = time.monotonic()
        with pytest.raises(EngineUnresponsive, match=r"did not come between steps within 0\.5 s"):
            llm.check_liveness(timeout_s=0.5)
        assert time.monotonic() - start < 2.0
    finally:
        release.set()
        thread.join()
    assert llm.check_liveness(timeout_s=2.0) < 2.0


def test_an_engine_held_by_an_admin_call_is_busy_not_dead(ckpts):
    """A reload or an update holds the engine between steps for as long as it takes: the check says "busy" (alive,
    not asked) instead of declaring it dead; once the call ends, the round trip runs."""
    import asyncio

    from hotswap.engine.async_llm_engine import AsyncLLMEngine
    from hotswap.errors import EngineBusy

    async def main() -> float:
        engine = AsyncLLMEngine.from_kwargs(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)

        def long_admin_call() -> None:
            time.sleep(1.5)

        held = asyncio.create_task(engine._locked(long_admin_call))
        await asyncio.sleep(0.1)
        with pytest.raises(EngineBusy, match=r"long_admin_call\(\) has held the engine"):
            await engine.check_liveness(timeout_s=0.5)
        await held
        seconds = await engine.check_liveness(timeout_s=2.0)
        await engine.shutdown()
        return seconds

    assert asyncio.run(main()) < 2.0
