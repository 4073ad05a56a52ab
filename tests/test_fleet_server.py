"""`hotswap serve --data-parallel-size 2`: one endpoint in front of a fleet on a local Ray (its soak, updates under
load included, is in test_soak.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import PROMPTS, hf_greedy
from server_helpers import running_server

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a server process with its own Ray and two replicas

ADMIN = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def fleet_server(ckpts):
    with running_server(
        str(ckpts["A"]),
        "--data-parallel-size",
        "2",
        "--num-gpus-per-worker",
        "0",
        "--admin-key",
        "k",
        "--served-model-name",
        "A",
        "--kv-cache-memory-bytes",
        str(1 << 23),
    ) as base:
        yield base


def replicas(base: str) -> list[dict]:
    return httpx.get(f"{base}/fleet_status", headers=ADMIN, timeout=30).json()["replicas"]


def test_one_endpoint_serves_the_fleet(fleet_server, tokenizer, ckpts):
    base = fleet_server
    routed = [r["routed"] for r in replicas(base)]
    for prompt in PROMPTS:
        body = {
            "model": "A",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        out = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert out["token_ids"] == hf_greedy(str(ckpts["A"]), tuple(tokenizer.encode(prompt)), 8)[0]
    spread = [r["routed"] - before for r, before in zip(replicas(base), routed, strict=True)]
    assert min(spread) > 0 and sum(spread) == len(PROMPTS)
    # one session id: one replica, whose prefix cache serves its later turns (figures from that replica)
    routed = [r["routed"] for r in replicas(base)]
    prompt = list(range(3, 60))
    for _ in range(4):
        out = httpx.post(
            f"{base}/v1/completions",
            json={"model": "A", "prompt": prompt, "max_tokens": 2, "return_token_ids": True},
            headers={"X-Session-ID": "conversation-7"},
            timeout=120,
        ).json()["choices"][0]
        prompt = prompt + out["token_ids"] + [5, 6, 7]
    assert sorted(r["routed"] - before for r, before in zip(replicas(base), routed, strict=True)) == [0, 4]
    stats = httpx.get(f"{base}/v1/sessions/conversation-7", timeout=60).json()
    assert stats["requests"] == 4 and stats["prefix_cache_hit_rate"] > 0.7
    assert httpx.post(f"{base}/close_session", json={"session_id": "conversation-7"}, timeout=60).json()["success"]
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
            r["status"]["requests"] for r in replicas(base)
        ):
            assert time.monotonic() < deadline, replicas(base)  # its replica reports it held, paused
            time.sleep(0.2)
    try:
        deadline = time.monotonic() + 60
        while any(r["status"]["requests"] for r in replicas(base)):
            assert time.monotonic() < deadline, replicas(base)
            time.sleep(0.2)
    finally:
        httpx.post(f"{base}/resume", headers=ADMIN, timeout=60).raise_for_status()
    # SGLang's /generate through the router: a batch answers per prompt; one whose client left is aborted on the
    # replicas that ran it
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    out = httpx.post(f"{base}/generate", json={"text": ["hello", "world"], "sampling_params": params}, timeout=120)
    assert [r["meta_info"]["finish_reason"]["type"] for r in out.json()] == ["length", "length"]
    params = {"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base}/generate",
            json={"text": ["hello", "world", "a b c"], "sampling_params": params},
            timeout=httpx.Timeout(30.0, read=1.0),
        )
    deadline = time.monotonic() + 5
    while any(r["status"]["requests"] for r in replicas(base)):
        assert time.monotonic() < deadline, replicas(base)
        time.sleep(0.1)
    assert httpx.get(f"{base}/health_generate", timeout=60).status_code == 200
    # the admin and metrics surfaces speak for the fleet
    assert httpx.get(f"{base}/get_world_size", headers=ADMIN).json() == {"world_size": 2}
    info = httpx.get(f"{base}/server_info", headers=ADMIN).json()
    assert info["vllm_config"]["parallel_config"]["data_parallel_size"] == 2
    metrics = httpx.get(f"{base}/metrics").text
    assert "hotswap_fleet_replicas_up 2.0" in metrics
    assert 'hotswap_fleet_replica_weight_version{replica="1"} 0.0' in metrics
