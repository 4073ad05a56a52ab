"""The OpenAI-compatible server and the admin API, against a real server process on loopback."""

from __future__ import annotations

import json
import multiprocessing as mp

import httpx
import openai
import pytest
from safetensors.torch import load_file

from conftest import hf_greedy
from server_helpers import running_server
from transfer_helpers import free_port, shm_segments

API_KEY, ADMIN_KEY = "sk-user", "sk-admin"
PROMPTS = ["hello world", "the quick brown fox jumps over", "numbers 1 2 3 4"]


@pytest.fixture(scope="module")
def server(ckpts):
    with running_server(
        str(ckpts["A"]), "--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--kv-cache-memory-bytes", str(1 << 23)
    ) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)


def completion_text(client, prompt: str, n_tokens: int = 12) -> str:
    out = client.completions.create(
        model="A", prompt=prompt, max_tokens=n_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def reference_text(path, tokenizer, prompt: str, n_tokens: int = 12) -> str:
    ids = tokenizer.encode(prompt)
    return tokenizer.decode(hf_greedy(str(path), tuple(ids), n_tokens)[0], skip_special_tokens=True)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["A"]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_completions_match_transformers(client, ckpts, tokenizer):
    for prompt in PROMPTS:
        assert completion_text(client, prompt) == reference_text(ckpts["A"], tokenizer, prompt)


def test_completion_fields_n_logprobs_stream(client):
    out = client.completions.create(
        model="A", prompt=PROMPTS[0], max_tokens=8, n=3, temperature=1.0, seed=5, logprobs=2
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens) >= 1
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert choice.model_extra["weight_versions"][0][0] == "0"
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    again = client.completions.create(model="A", prompt=PROMPTS[0], max_tokens=8, n=3, temperature=1.0, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded
    full = completion_text(client, PROMPTS[1], 10)
    chunks = list(
        client.completions.create(
            model="A", prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    stopped = client.completions.create(model="A", prompt=PROMPTS[1], max_tokens=10, temperature=0, stop=[full[3:5]])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == full[: full.index(full[3:5])]


def test_chat_and_chat_stream(client):
    messages = [{"role": "user", "content": "hello there"}]
    out = client.chat.completions.create(
        model="A", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert len(choice.logprobs.content) == out.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    stream = client.chat.completions.create(model="A", messages=messages, max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_client_errors_are_4xx_in_openai_shape(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="A", prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="A", prompt=list(range(5, 5000)))
    headers = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    for body in ("{bad json", json.dumps({"model": "A"}), json.dumps({"model": "A", "prompt": "x", "n": "many"})):
        response = httpx.post(f"{server}/v1/completions", content=body, headers=headers)
        assert response.status_code == 400 and set(response.json()["error"]) >= {"message", "type", "code"}
    assert httpx.post(f"{server}/v1/completions", json={"model": "A", "prompt": "x"}).status_code == 401


def running_requests(server: str) -> float:
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith("hotswap_requests_running "):
            return float(line.split()[1])
    raise AssertionError("no hotswap_requests_running metric")


def test_client_disconnect_mid_stream_aborts_the_request(server):
    import time

    body = {"model": "A", "prompt": PROMPTS[0], "max_tokens": 500, "stream": True, "ignore_eos": True}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.stream(
        "POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as response:
        lines = response.iter_lines()  # kept: dropping the iterator would close the stream
        assert next(lines).startswith("data: ")
        # frozen: the request cannot finish on its own while paused
        assert httpx.post(f"{server}/pause", json={"mode": "keep"}, headers=admin).status_code == 200
        assert running_requests(server) == 1
    try:
        deadline = time.monotonic() + 10  # the client is gone: the server must drop its request
        while running_requests(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running_requests(server) == 0
    finally:
        httpx.post(f"{server}/resume", headers=admin)


@pytest.mark.parametrize("key", [None, "wrong", API_KEY])
def test_admin_routes_need_the_admin_key(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path in [
        ("GET", "/get_weight_version"),
        ("POST", "/pause"),
        ("POST", "/reload_weights"),
        ("GET", "/weight_checksums"),
        ("POST", "/collective_rpc"),
    ]:
        response = httpx.request(method, f"{server}{path}", headers=headers, json={})
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["type"] == "authentication_error"


def test_collective_rpc_is_allow_listed(server):
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(f"{server}/get_world_size", headers=headers).json() == {"world_size": 1}
    ok = httpx.post(f"{server}/collective_rpc", headers=headers, json={"method": "determine_num_kv_blocks"})
    assert ok.status_code == 200 and isinstance(ok.json()["results"][0], int)
    denied = httpx.post(f"{server}/collective_rpc", headers=headers, json={"method": "load_model"})
    assert denied.status_code == 403


def trainer_process(base: str, checkpoint: str, backend: str, port: int, go, result) -> None:
    """A trainer: on `go`, pushes a checkpoint's tensors through the admin client and verifies the checksums."""
    from hotswap.entrypoints.client import AdminClient

    named = list(load_file(checkpoint).items())
    client = AdminClient(base, admin_key=ADMIN_KEY)
    result.put("ready")
    go.get()
    try:
        version = client.push_weights(named, backend=backend, master_port=port)
        segment = client._shm.segment.name if client._shm is not None else None
        result.put({"version": version, "mismatched": client.verify(named), "segment": segment})
    except BaseException as err:  # reported to the test
        result.put({"error": repr(err)})
    finally:
        client.close()


@pytest.mark.slow
def test_trainer_pushes_over_shm_and_torch_dist_while_a_client_streams(server, client, ckpts, tokenizer):
    ctx = mp.get_context("spawn")
    used: set[str] = set()
    for backend, target in [("shm", "B"), ("torch_dist", "A"), ("shm", "B")]:
        go, result = ctx.Queue(), ctx.Queue()
        trainer = ctx.Process(
            target=trainer_process,
            args=(server, str(ckpts[target] / "model.safetensors"), backend, free_port(), go, result),
        )
        trainer.start()
        assert result.get(timeout=120) == "ready"
        chunks = client.completions.create(
            model="A", prompt=PROMPTS[2], max_tokens=900, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        first = next(iter(chunks))
        # Freeze the stream where it is so the push lands mid-stream however slow the trainer starts; the
        # trainer's own pause (keep) then finds the engine paused, and its resume continues the stream.
        paused = httpx.post(f"{server}/pause", json={"mode": "keep"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert paused.status_code == 200
        go.put("push")
        rest = list(chunks)
        report = result.get(timeout=120)
        trainer.join(timeout=60)
        assert "error" not in report, report
        assert report["mismatched"] == []
        used.update([report["segment"]] if report["segment"] else [])
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        spans = rest[-1].choices[0].model_extra["weight_versions"]
        assert rest[-1].choices[0].finish_reason == "length" and text
        assert len(spans) == 2 and spans[1][0] == str(report["version"])  # the stream crossed the update
        for prompt in PROMPTS:
            assert completion_text(client, prompt) == reference_text(ckpts[target], tokenizer, prompt)
    version = httpx.get(f"{server}/get_weight_version", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert version["weight_version"] == str(report["version"]) == "3"
    assert len(used) == 2 and not used & shm_segments()  # the shm trainers unlinked their buffers


@pytest.mark.slow
def test_refuses_admin_on_a_public_host_without_key(ckpts):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "hotswap", "serve", str(ckpts["A"]), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "--admin-key" in out.stderr


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(ckpts):
    """Property-based requests generated from the server's OpenAPI schema, admin routes included (with the
    admin key): none may produce a 5xx. SGLang's group init is left out: a generated address that accepts
    connections makes each example wait out the join timeout (its bad input is tested in test_sglang_compat)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    with running_server(
        str(ckpts["A"]), "--admin-key", ADMIN_KEY, "--max-model-len", "64", "--kv-cache-memory-bytes", str(1 << 22)
    ) as base:
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        failures: list[str] = []
        waits = {"/init_weights_update_group"}
        operations = [op for op in (result.ok() for result in schema.get_all_operations()) if op.path not in waits]
        assert len(operations) >= 20
        for operation in operations:

            @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(case=operation.as_strategy())
            def call(case):
                response = case.call(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.path} {case.body!r} -> {response.status_code}")

            call()
        assert not failures, failures


@pytest.mark.slow
def test_admin_client_pushes_to_a_tensor_parallel_server(ckpts, tokenizer):
    from hotswap.entrypoints.client import AdminClient

    with running_server(
        str(ckpts["A"]),
        "--admin-key",
        ADMIN_KEY,
        "--tensor-parallel-size",
        "2",
        "--kv-cache-memory-bytes",
        str(1 << 22),
    ) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        admin = AdminClient(base, admin_key=ADMIN_KEY)
        try:
            assert completion_text(client, PROMPTS[0]) == reference_text(ckpts["A"], tokenizer, PROMPTS[0])
            b = list(load_file(str(ckpts["B"] / "model.safetensors")).items())
            assert admin.push_weights(b, backend="torch_dist", master_port=free_port()) == "1"
            for prompt in PROMPTS:
                assert completion_text(client, prompt) == reference_text(ckpts["B"], tokenizer, prompt)
            a = list(load_file(str(ckpts["A"] / "model.safetensors")).items())
            assert admin.push_weights(a, backend="torch_dist") == "2"  # the channel is reused
            assert completion_text(client, PROMPTS[1]) == reference_text(ckpts["A"], tokenizer, PROMPTS[1])
        finally:
            admin.close()
