"""Clients that go away: the work they asked for is aborted at once, whatever the kind of request, its KV blocks
are freed, and nothing reaches the server log."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from server_helpers import running_server


@pytest.fixture(scope="module")
def served(ckpts, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(
        str(ckpts["A"]), "--admin-auth", "none", "--kv-cache-memory-bytes", str(1 << 24), log=log
    ) as base:
        yield base, log


def metric(base: str, name: str, **labels: str) -> float:
    """The value of one series in /metrics (0 when absent)."""
    text = httpx.get(f"{base}/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if want else name
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_idle(base: str, within: float) -> float:
    """Seconds until the engine holds no request; fails after `within`."""
    started = time.monotonic()
    while metric(base, "hotswap_requests_running") > 0:
        assert time.monotonic() - started < within, "the abandoned request is still running"
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_non_streaming_request_whose_client_left_is_aborted(served):
    """n=8 and 1000 tokens each, the client gone after 0.3 s: the request ends (499) instead of generating
    8000 tokens for nobody."""
    base, _ = served
    body = {"model": "A", "prompt": "hello", "max_tokens": 1000, "n": 8, "temperature": 1.0, "ignore_eos": True}
    before = metric(base, "hotswap_requests", route="/v1/completions", status="499")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(30.0, read=0.3))
    assert wait_idle(base, within=1.0) < 1.0
    assert metric(base, "hotswap_requests", route="/v1/completions", status="499") == before + 1
    # the engine serves the next request, its blocks all free again
    done = httpx.post(f"{base}/v1/completions", json={**body, "n": 1, "max_tokens": 4}, timeout=60).json()
    assert done["choices"][0]["finish_reason"] == "length"


def test_a_streaming_request_whose_client_left_is_aborted(served):
    base, _ = served
    body = {
        "model": "A",
        "prompt": "hello",
        "max_tokens": 1000,
        "n": 2,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    assert wait_idle(base, within=1.0) < 1.0


def test_an_sglang_batch_whose_client_left_is_aborted(served):
    base, _ = served
    params = {"max_new_tokens": 1000, "temperature": 1.0, "ignore_eos": True}
    before = metric(base, "hotswap_requests", route="/generate", status="499")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base}/generate",
            json={"text": ["hello", "world", "a b c"], "sampling_params": params},
            timeout=httpx.Timeout(30.0, read=0.3),
        )
    assert wait_idle(base, within=1.0) < 1.0
    assert metric(base, "hotswap_requests", route="/generate", status="499") == before + 1


def _raw_request(base: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    host = base.removeprefix("http://")
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=60)


def _read_until_closed(sock: socket.socket, chunk: int = 65536, pause: float = 0.0) -> bytes:
    data = b""
    while True:
        got = sock.recv(chunk)
        if not got:
            return data
        data += got
        time.sleep(pause)


def test_pipelined_requests_on_one_connection_are_answered_in_order(served):
    """Two requests written at once on one keep-alive connection, then a third that closes it: three answers."""
    base, _ = served
    body = {"model": "A", "prompt": "hello", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    with _connect(base) as sock:
        sock.sendall(
            _raw_request(base, body) * 2
            + _raw_request(base, body).replace(b"Content-Type", b"Connection: close\r\nContent-Type", 1)
        )
        data = _read_until_closed(sock)
    assert data.count(b"HTTP/1.1 200 OK") == 3 and data.count(b'"finish_reason":"length"') == 3, data[:2000]


def test_a_slow_reader_gets_its_whole_stream(served):
    """A streaming client that reads 512 bytes every 20 ms through a small socket buffer (the server's writes
    block on it): the stream arrives whole and the server stays idle afterwards."""
    base, _ = served
    body = {
        "model": "A",
        "prompt": "hello",
        "max_tokens": 120,
        "n": 2,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
    }
    with _connect(base) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(_raw_request(base, body).replace(b"Content-Type", b"Connection: close\r\nContent-Type", 1))
        data = _read_until_closed(sock, chunk=512, pause=0.02)
    assert data.startswith(b"HTTP/1.1 200 OK") and data.count(b'"finish_reason": "length"') == 2
    assert b"data: [DONE]" in data
    assert wait_idle(base, within=1.0) < 1.0


def test_a_half_closed_client_is_answered_or_its_request_aborted(served):
    """A client that sends a request and shuts its sending side (a half-close) before reading: the server either
    answers it whole or treats it as gone and aborts its work; either way the engine is idle soon after."""
    base, _ = served
    body = {"model": "A", "prompt": "hello", "max_tokens": 1000, "n": 4, "temperature": 1.0, "ignore_eos": True}
    with _connect(base) as sock:
        sock.sendall(_raw_request(base, body))
        sock.shutdown(socket.SHUT_WR)
        data = _read_until_closed(sock)
    assert data == b"" or data.startswith(b"HTTP/1.1 200 OK") or data.startswith(b"HTTP/1.1 499"), data[:500]
    assert wait_idle(base, within=2.0) < 2.0


def test_no_exception_reached_the_server_log(served):
    """After the disconnects above (and the generators they closed mid-step)."""
    _, log = served
    time.sleep(0.2)
    text = log.read_text()
    assert "Traceback" not in text and "Error" not in text, text[-3000:]


@pytest.mark.unit
def test_an_error_that_comes_as_the_client_leaves_is_not_logged_as_never_retrieved():
    """Found by the soak: a request submitted as the engine fell asleep failed (EngineUnavailable) in the same
    moment its client left; the handler answered 499 and the failed wait's exception was never retrieved, so
    asyncio logged a traceback."""
    import asyncio
    import gc
    from types import SimpleNamespace

    from hotswap.entrypoints.server import generation
    from hotswap.entrypoints.server.state import ApiError, RequestLimits
    from hotswap.errors import EngineUnavailable

    async def failing():
        raise EngineUnavailable("the engine is asleep; retry after wake_up")
        yield  # an async generator

    class Gone:
        async def gone(self) -> bool:
            await asyncio.sleep(0.01)  # the failure has arrived by now
            return True

    state = SimpleNamespace(
        limits=RequestLimits(), engine=SimpleNamespace(engine=SimpleNamespace(is_paused=lambda: False))
    )
    reported: list[dict] = []

    async def status() -> int:
        try:
            await generation.next_output(state, failing(), Gone())
        except ApiError as err:
            return err.status
        return 200

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context))
        assert await status() == 499
        gc.collect()  # the failed wait is gone: had its exception not been retrieved, the loop reports it now
        await asyncio.sleep(0)

    asyncio.run(main())
    assert reported == []
