"""`hotswap serve --data-parallel-size 2`: one endpoint in front of a fleet on a local Ray."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from safetensors.torch import load_file
from test_storm import start_clients, valid_spans

from conftest import PROMPTS, hf_greedy
from hotswap.entrypoints.client import AdminClient, AdminError
from server_helpers import running_server

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a server process with its own Ray and two replicas

CLIENTS, SECONDS, UPDATES = 20, 60.0, 30
ADMIN = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def fleet_server(ckpts):
    with running_server(str(ckpts["A"]), "--data-parallel-size", "2", "--num-gpus-per-worker", "0",
                        "--admin-key", "k", "--served-model-name", "A", "--kv-cache-memory-bytes", str(1 << 23)
                        ) as base:
        yield base


def replicas(base: str) -> list[dict]:
    return httpx.get(f"{base}/fleet_status", headers=ADMIN, timeout=30).json()["replicas"]


def test_one_endpoint_serves_the_fleet(fleet_server, tokenizer, ckpts):
    base = fleet_server
    routed = [r["routed"] for r in replicas(base)]
    for prompt in PROMPTS:
        body = {"model": "A", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        out = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert out["token_ids"] == hf_greedy(str(ckpts["A"]), tuple(tokenizer.encode(prompt)), 8)[0]
    spread = [r["routed"] - before for r, before in zip(replicas(base), routed, strict=True)]
    assert min(spread) > 0 and sum(spread) == len(PROMPTS)
    # one session id: one replica
    routed = [r["routed"] for r in replicas(base)]
    for _ in range(4):
        httpx.post(f"{base}/v1/completions", json={"model": "A", "prompt": "hi", "max_tokens": 2},
                   headers={"X-Session-ID": "conversation-7"}, timeout=120).raise_for_status()
    assert sorted(r["routed"] - before for r, before in zip(replicas(base), routed, strict=True)) == [0, 4]
    # streaming passes through with its version spans
    chunks = []
    body = {"model": "A", "prompt": "count", "max_tokens": 6, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["weight_versions"] == [["0", 0, 6]]
    # a client that goes away aborts its request on its replica (paused, the request could not end otherwise)
    body = {"model": "A", "prompt": "count", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        httpx.post(f"{base}/pause?mode=keep", headers=ADMIN, timeout=60).raise_for_status()
        deadline = time.monotonic() + 60
        while not all(r["status"]["paused"] for r in replicas(base)) or not any(
                r["status"]["requests"] for r in replicas(base)):
            assert time.monotonic() < deadline, replicas(base)  # its replica reports it held, paused
            time.sleep(0.2)
    try:
        deadline = time.monotonic() + 60
        while any(r["status"]["requests"] for r in replicas(base)):
            assert time.monotonic() < deadline, replicas(base)
            time.sleep(0.2)
    finally:
        httpx.post(f"{base}/resume", headers=ADMIN, timeout=60).raise_for_status()
    # the admin and metrics surfaces speak for the fleet
    assert httpx.get(f"{base}/get_world_size", headers=ADMIN).json() == {"world_size": 2}
    info = httpx.get(f"{base}/server_info", headers=ADMIN).json()
    assert info["vllm_config"]["parallel_config"]["data_parallel_size"] == 2
    metrics = httpx.get(f"{base}/metrics").text
    assert "hotswap_fleet_replicas_up 2.0" in metrics
    assert 'hotswap_fleet_replica_weight_version{replica="1"} 0.0' in metrics


def test_streaming_storm_while_fleet_updates_run(fleet_server, ckpts):
    base = fleet_server
    named = {key: list(load_file(str(ckpts[key] / "model.safetensors")).items()) for key in ("A", "B")}
    threads, results = start_clients(base, CLIENTS, SECONDS)
    admin = AdminClient(base, admin_key="k")
    start_version = admin.get_weight_version()
    versions, refused, uneven = [], 0, []
    bad = [(named["B"][0][0], named["B"][0][1][:1])]  # a wrong shape: refused by every replica, none changes
    for i in range(UPDATES):
        time.sleep(SECONDS / (UPDATES + 1) / 2)
        if i % 10 == 5:
            try:
                admin.push_weights(bad, backend="shm")
            except AdminError as err:
                refused += err.status == 400
        versions.append(admin.push_weights(named["B" if i % 2 == 0 else "A"], backend="shm"))
        state = replicas(base)
        if {r["weight_version"] for r in state} != {versions[-1]} or not all(r["routable"] for r in state):
            uneven.append(state)
    for thread in threads:
        thread.join(timeout=180)
    final = admin.get_weight_version()
    mismatched = admin.verify(named["B" if UPDATES % 2 == 1 else "A"])
    admin.close()
    start = int(start_version)  # labels: the integers, as strings, where the trainer gave none
    assert versions == [str(v) for v in range(start + 1, start + UPDATES + 1)] and final == versions[-1]
    assert refused == 3 and uneven == [] and mismatched == []
    lost = [r for r in results if "error" in r or r["finish"] != "length"]
    assert len(results) >= CLIENTS and not lost, lost[:3]
    assert all(valid_spans(r["spans"], r["max_tokens"]) for r in results)
    assert sum(len(r["spans"]) > 1 for r in results) > 0  # some requests crossed an update
    metrics = httpx.get(f"{base}/metrics").text
    assert f"hotswap_fleet_updates_committed {float(UPDATES)}" in metrics
