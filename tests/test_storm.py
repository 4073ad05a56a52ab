"""A bounded storm: streaming clients for a fixed time while a trainer pushes updates into the server; no request
is lost and every update commits with one version."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
from safetensors.torch import load_file

from hotswap.entrypoints.client import AdminClient
from server_helpers import running_server

CLIENTS, SECONDS, UPDATES = 8, 15.0, 10


def stream_once(base: str, rng: random.Random) -> dict:
    """One streamed completion; returns its tokens, finish reason and version spans (or the error)."""
    body = {"model": "A", "prompt": f"count {rng.randint(0, 999)}", "max_tokens": rng.randint(8, 40),
            "temperature": 1.0, "stream": True, "ignore_eos": True}
    text, finish, spans = "", None, None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}"}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            spans = choice.get("weight_versions", spans)
    return {"finish": finish, "spans": spans, "max_tokens": body["max_tokens"]}


def start_clients(base: str, count: int, seconds: float) -> tuple[list[threading.Thread], list[dict]]:
    """`count` threads streaming completions from `base` one after another for `seconds`; every outcome (or the
    error of a lost request) lands in the returned list."""
    results: list[dict] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            try:
                outcome = stream_once(base, rng)
            except Exception as err:  # a lost request
                outcome = {"error": repr(err)}
            with lock:
                results.append(outcome)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, results


def valid_spans(spans: list[list], tokens: int) -> bool:
    """Spans cover [0, tokens) in order, without gaps, with versions (strings holding integers) that only go up."""
    position, version = 0, -1
    for label, start, end in spans:
        v = int(label)
        if start != position or end <= start or v <= version:
            return False
        position, version = end, v
    return position == tokens


@pytest.mark.slow
def test_streaming_storm_while_updates_run(ckpts):
    named = {key: list(load_file(str(ckpts[key] / "model.safetensors")).items()) for key in ("A", "B")}
    with running_server(str(ckpts["A"]), "--kv-cache-memory-bytes", str(1 << 23), "--admin-key", "k",
                        "--served-model-name", "A") as base:
        threads, results = start_clients(base, CLIENTS, SECONDS)
        admin = AdminClient(base, admin_key="k")
        versions = []
        for i in range(UPDATES):
            time.sleep(SECONDS / (UPDATES + 1))
            versions.append(admin.push_weights(named["B" if i % 2 == 0 else "A"], backend="shm"))
        for thread in threads:
            thread.join(timeout=120)
        final = admin.get_weight_version()
        mismatched = admin.verify(named["B" if UPDATES % 2 == 1 else "A"])
        admin.close()
    assert versions == [str(v) for v in range(1, UPDATES + 1)] and final == str(UPDATES) and mismatched == []
    lost = [r for r in results if "error" in r or r["finish"] != "length"]
    assert len(results) >= CLIENTS and not lost, lost[:3]
    assert all(valid_spans(r["spans"], r["max_tokens"]) for r in results)
    assert sum(len(r["spans"]) > 1 for r in results) > 0  # some requests crossed an update
