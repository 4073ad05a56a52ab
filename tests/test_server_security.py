"""Admin routes are never open by accident; client mistakes get 4xx; /health and /metrics tell the truth."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_helpers import running_server


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def test_admin_routes_are_off_without_a_key_and_metrics_labels_are_bounded(ckpts):
    with running_server(str(ckpts["A"]), "--kv-cache-memory-bytes", str(1 << 22)) as base:
        for method, route in (
            ("POST", "/pause"),
            ("POST", "/sleep"),
            ("POST", "/finish_weight_update"),
            ("GET", "/get_weight_version"),
        ):
            response = httpx.request(method, f"{base}{route}")
            assert response.status_code == 403 and "--admin-key" in response.json()["error"]["message"], route
        # a web page's cross-site request is refused whatever the key
        assert httpx.post(f"{base}/pause", headers={"Origin": "http://evil.example"}).status_code == 403
        odd_key = {"Authorization": "Bearer \u00e9t\u00e9".encode()}  # no --api-key: the user routes are open
        assert httpx.get(f"{base}/v1/models", headers=odd_key).status_code == 200
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}
        for i in range(5):
            httpx.get(f'{base}/no/such/route/{i}?x="}}')
        metrics = httpx.get(f"{base}/metrics").text
        assert 'route="unmatched"' in metrics and "/no/such" not in metrics
        assert 'route="/pause"' in metrics and 'route="/health"' in metrics


def test_admin_auth_none_opens_admin_to_loopback_names_only(ckpts):
    with running_server(str(ckpts["A"]), "--kv-cache-memory-bytes", str(1 << 22), "--admin-auth", "none") as base:
        assert httpx.get(f"{base}/get_weight_version").status_code == 200
        rebinding = httpx.get(f"{base}/get_weight_version", headers={"Host": "attacker.example:8000"})
        assert rebinding.status_code == 403 and "Host" in rebinding.json()["error"]["message"]
        assert httpx.post(f"{base}/pause", headers={"Origin": "http://attacker.example"}).status_code == 403
        assert httpx.get(f"{base}/is_paused").json() == {"is_paused": False}


def test_keys_that_would_turn_auth_off_are_refused_at_start(ckpts):
    for args in (["--admin-key", ""], ["--api-key", " "], ["--admin-auth", "none", "--host", "0.0.0.0"]):
        out = subprocess.run(
            [sys.executable, "-m", "hotswap", "serve", str(ckpts["A"]), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and ("empty" in out.stderr or "refused" in out.stderr), (args, out.stderr)


def test_a_port_in_use_is_refused_before_the_model_loads_and_port_0_picks_one(ckpts):
    """The server binds its port before it builds the engine, so worker processes started while the model loads
    cannot take it (a fleet's Ray once did); a port in use fails at once, naming the address."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "hotswap",
                "serve",
                str(ckpts["A"]),
                "--port",
                str(port),
                "--tensor-parallel-size",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr[-2000:]
        assert "serving" not in out.stdout  # refused before the engine (and its two workers) started
    assert time.monotonic() - start < 30
    with running_server(str(ckpts["A"]), "--kv-cache-memory-bytes", str(1 << 22)) as base:  # --port 0
        assert not base.endswith(":0") and httpx.get(f"{base}/health").status_code == 200


def test_bearer_keys_with_any_characters_get_401_not_500(ckpts):
    with running_server(
        str(ckpts["A"]), "--kv-cache-memory-bytes", str(1 << 22), "--api-key", "sk-user", "--admin-key", "sk-admin"
    ) as base:
        for key in ("\u00e9t\u00e9", "sk-user\u2028", "x" * 5000):
            headers = {"Authorization": f"Bearer {key}".encode()}
            assert httpx.get(f"{base}/v1/models", headers=headers).status_code == 401
            assert httpx.post(f"{base}/pause", headers=headers).status_code == 401


@pytest.mark.slow
def test_health_is_503_after_a_tensor_parallel_worker_dies(ckpts):
    with running_server(
        str(ckpts["A"]), "--kv-cache-memory-bytes", str(1 << 22), "--tensor-parallel-size", "2", "--admin-key", "k"
    ) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        servers = [p for p in children(os.getpid()) if b"serve" in open(f"/proc/{p}/cmdline", "rb").read()]
        workers = [w for p in servers for w in children(p)]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{base}/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        response = httpx.get(f"{base}/health")
        assert response.status_code == 503 and "worker 1" in response.json()["reason"]


ADMIN = {"Authorization": "Bearer k"}


def completion(base: str, timeout: float = 60, **fields):
    body = {"model": "A", "prompt": "hello", "max_tokens": 4, **fields}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


def test_limits_and_waits_are_bounded(ckpts):
    """An 8 MB prompt is refused before it is read (and /health stays responsive meanwhile); too many stop
    strings are refused naming the limit; a request while the engine sleeps gets 503 with Retry-After at once;
    a non-streaming request whose client went away is aborted."""
    with running_server(
        str(ckpts["A"]), "--kv-cache-memory-bytes", str(1 << 22), "--admin-key", "k", "--served-model-name", "A"
    ) as base:
        start = time.monotonic()
        big = completion(base, prompt="word " * ((8 << 20) // 5))
        assert big.status_code == 413 and "--max-request-bytes" in big.json()["error"]["message"]
        assert time.monotonic() - start < 10
        health_start = time.monotonic()
        assert httpx.get(f"{base}/health").status_code == 200 and time.monotonic() - health_start < 2.0
        many = completion(base, stop=[f"s{i}" for i in range(65)])
        assert many.status_code == 400 and "--max-stop-strings" in many.json()["error"]["message"]
        assert completion(base, stop=["x" * 2000]).status_code == 400
        assert completion(base).status_code == 200

        assert httpx.post(f"{base}/sleep", json={"level": 1}, headers=ADMIN).status_code == 200
        start = time.monotonic()
        asleep = completion(base, timeout=30)
        assert asleep.status_code == 503 and asleep.headers.get("retry-after") and time.monotonic() - start < 5
        assert httpx.post(f"{base}/wake_up", headers=ADMIN).status_code == 200

        assert httpx.post(f"{base}/pause", json={"mode": "keep"}, headers=ADMIN).status_code == 200
        with pytest.raises(httpx.TimeoutException):
            completion(base, timeout=1.0, max_tokens=50)  # waits while paused; the client gives up
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "hotswap_requests_running 1" in httpx.get(f"{base}/metrics").text:
            time.sleep(0.2)
        assert "hotswap_requests_running 0" in httpx.get(f"{base}/metrics").text
        assert httpx.post(f"{base}/resume", headers=ADMIN).status_code == 200
        assert completion(base).status_code == 200


def test_sigterm_stops_the_server_with_a_request_waiting(ckpts):
    with running_server(
        str(ckpts["A"]), "--kv-cache-memory-bytes", str(1 << 22), "--admin-key", "k", "--served-model-name", "A"
    ) as base:
        servers = [p for p in children(os.getpid()) if b"serve" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(servers) == 1
        assert httpx.post(f"{base}/pause", json={"mode": "keep"}, headers=ADMIN).status_code == 200
        import threading

        outcome: list[object] = []

        def wait_for_an_answer() -> None:
            try:
                body = {"model": "A", "prompt": "hi", "max_tokens": 4}
                outcome.append(httpx.post(f"{base}/v1/completions", timeout=30, json=body).status_code)
            except httpx.HTTPError as err:  # the server closed the connection as it stopped
                outcome.append(type(err).__name__)

        waiting = threading.Thread(target=wait_for_an_answer, daemon=True)
        waiting.start()
        time.sleep(1.0)
        start = time.monotonic()
        os.kill(servers[0], signal.SIGTERM)
        while time.monotonic() - start < 15:
            try:
                os.kill(servers[0], 0)
                with open(f"/proc/{servers[0]}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except ProcessLookupError:
                break
            time.sleep(0.1)
        assert time.monotonic() - start < 10
        waiting.join(timeout=10)
        assert outcome, "the waiting client got neither an answer nor a closed connection"


def test_malformed_text_and_rpc_arguments_get_400_not_500(ckpts):
    with running_server(
        str(ckpts["A"]), "--kv-cache-memory-bytes", str(1 << 22), "--admin-key", "k", "--served-model-name", "A"
    ) as base:
        raw = b'{"model": "A", "prompt": "hi \\ud800 there", "max_tokens": 2}'
        lone = httpx.post(f"{base}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert lone.status_code == 400 and "Unicode" in lone.json()["error"]["message"]
        chat = b'{"model": "A", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
        response = httpx.post(f"{base}/v1/chat/completions", content=chat, headers={"content-type": "application/json"})
        assert response.status_code == 400
        rpc = httpx.post(
            f"{base}/collective_rpc", headers=ADMIN, json={"method": "weight_checksums", "args": [1, 2, 3]}
        )
        assert rpc.status_code == 400
        assert completion(base).status_code == 200


def test_a_second_trainer_cannot_touch_the_first_ones_session(ckpts):
    with running_server(
        str(ckpts["A"]), "--kv-cache-memory-bytes", str(1 << 22), "--admin-key", "k", "--served-model-name", "A"
    ) as base:
        assert (
            httpx.post(
                f"{base}/init_weight_transfer_engine", headers=ADMIN, json={"init_info": {"backend": "disk"}}
            ).status_code
            == 200
        )
        token = httpx.post(f"{base}/start_weight_update", headers=ADMIN).json()["session_token"]
        other = httpx.post(f"{base}/abort_weight_update", headers=ADMIN, json={"session_token": "not-" + token})
        assert other.status_code == 409 and "another caller" in other.json()["error"]["message"]
        second = httpx.post(f"{base}/start_weight_update", headers=ADMIN)
        assert second.status_code == 409  # one session at a time
        done = httpx.post(f"{base}/finish_weight_update", headers=ADMIN, json={"session_token": token})
        assert done.status_code == 200 and done.json()["weight_version"] == "1"


def test_configured_limits_are_named_and_a_long_pause_gets_503(ckpts):
    with running_server(
        str(ckpts["A"]),
        "--kv-cache-memory-bytes",
        str(1 << 22),
        "--admin-key",
        "k",
        "--served-model-name",
        "A",
        "--max-pause-wait-s",
        "1",
        "--max-n",
        "2",
        "--max-tokens",
        "8",
        "--max-logprobs",
        "3",
    ) as base:
        for fields, flag in (
            ({"n": 3}, "--max-n"),
            ({"max_tokens": 9}, "--max-tokens"),
            ({"logprobs": 4}, "--max-logprobs"),
        ):
            refused = completion(base, **fields)
            assert refused.status_code == 400 and flag in refused.json()["error"]["message"], fields
        chat = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "model": "A",
                "max_tokens": 2,
                "logprobs": True,
                "top_logprobs": 4,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert chat.status_code == 400 and "--max-logprobs" in chat.json()["error"]["message"]
        allowed = completion(base, n=2, max_tokens=8, logprobs=3).json()
        assert len(allowed["choices"]) == 2 and len(allowed["choices"][0]["logprobs"]["top_logprobs"][0]) >= 3
        assert httpx.post(f"{base}/pause", json={"mode": "keep"}, headers=ADMIN).status_code == 200
        start = time.monotonic()
        waited = completion(base, timeout=30)
        assert waited.status_code == 503 and waited.headers.get("retry-after") and time.monotonic() - start < 5
        assert "--max-pause-wait-s" in waited.json()["error"]["message"]
        assert httpx.post(f"{base}/resume", headers=ADMIN).status_code == 200
        assert completion(base).status_code == 200
        assert "hotswap_requests_running 0" in httpx.get(f"{base}/metrics").text


def test_a_chunked_body_over_the_limit_gets_413(ckpts):
    with running_server(
        str(ckpts["A"]),
        "--kv-cache-memory-bytes",
        str(1 << 22),
        "--served-model-name",
        "A",
        "--max-request-bytes",
        "1000",
    ) as base:

        def chunks():
            yield b'{"model": "A", "prompt": "'
            for _ in range(50):
                yield b"x" * 100
            yield b'"}'

        response = httpx.post(f"{base}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert completion(base).status_code == 200
