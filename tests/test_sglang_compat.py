"""SGLang's surface as slime and AReaL drive it, against a real server: their /generate payloads (rollout and
scoring), generation control, and the weight routes, including a gloo /init_weights_update_group +
/update_weights_from_distributed round trip from a trainer built the way theirs are."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import threading
import time

import httpx
import pytest
import torch

from conftest import hf_greedy, hf_model
from server_helpers import post, running_server
from transfer_helpers import free_port, sglang_trainer

PROMPT = "the quick brown fox jumps over"


@pytest.fixture(scope="module")
def server(ckpts):
    with running_server(str(ckpts["A"]), "--admin-auth", "none", "--kv-cache-memory-bytes", str(1 << 23)) as base:
        yield base


def greedy_ids(base: str, ids: list[int], n: int = 8) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    return post(base, "/generate", **body).json()["output_ids"]


def test_slime_rollout_and_areal_scoring_payloads(server, tokenizer, ckpts):
    ids = tokenizer.encode(PROMPT)
    rollout = post(
        server,
        "/generate",
        input_ids=ids,
        return_logprob=True,
        sampling_params={  # slime's keys
            "temperature": 0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": 8,
            "stop_token_ids": [],
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "ignore_eos": True,
            "sampling_seed": 3,
        },
    ).json()
    expected = hf_greedy(str(ckpts["A"]), tuple(ids), 8)[0]
    meta = rollout["meta_info"]
    assert rollout["output_ids"] == expected
    assert [x[1] for x in meta["output_token_logprobs"]] == expected and meta["output_token_logprobs"][0][2] is None
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 8
    assert meta["weight_version"] == "0"
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 8, "version_id": 0}]
    target = 4  # AReaL's scoring request: the last `target` prompt tokens' logprobs
    score = post(
        server,
        "/generate",
        input_ids=ids,
        return_logprob=True,
        logprob_start_len=len(ids) - target - 1,
        top_logprobs_num=0,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
    ).json()
    with torch.no_grad():
        ref = hf_model(str(ckpts["A"]))(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    got = score["meta_info"]["input_token_logprobs"][-target:]
    for (lp, token, _), pos in zip(got, range(len(ids) - target, len(ids)), strict=True):
        assert token == ids[pos] and abs(lp - ref[pos - 1, ids[pos]].item()) < 1e-4
    batch = post(server, "/generate", text=[PROMPT, "hello"], sampling_params={"max_new_tokens": 3}).json()
    assert isinstance(batch, list) and len(batch) == 2 and all(len(b["output_ids"]) <= 3 for b in batch)
    r = post(server, "/generate", text=PROMPT, sampling_params={"regex": "a+", "json_schema": "{}"})
    assert r.status_code == 400 and "regex" in r.text


def test_generate_streams_cumulative_results(server, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    }
    with httpx.stream("POST", f"{server}/generate", json=body, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert len(chunks) > 1 and chunks[-1]["output_ids"] == greedy_ids(server, ids, 5)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(len(a["output_ids"]) <= len(b["output_ids"]) for a, b in itertools.pairwise(chunks))
    refused = post(server, "/generate", input_ids=[10**9], stream=True, sampling_params={"max_new_tokens": 2})
    assert refused.status_code == 400


def test_generation_control_loads_and_info(server, tokenizer):
    ids = tokenizer.encode(PROMPT)
    result: dict = {}

    def long_request():
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0}}
        result["out"] = post(server, "/generate", **body).json()

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server}/v1/loads").json()["loads"][0]["num_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert post(server, "/flush_cache").status_code == 400  # requests are running
    assert post(server, "/pause_generation", mode="abort").json()["status"] == "ok"
    thread.join(30)
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(server, "/continue_generation").json()["status"] == "ok"
    assert httpx.get(f"{server}/v1/loads").json()["loads"][0]["num_reqs"] == 0
    assert post(server, "/flush_cache").status_code == 200
    assert post(server, "/abort_request", abort_all=True).json()["success"]
    assert httpx.get(f"{server}/health_generate").status_code == 200
    info = httpx.get(f"{server}/server_info").json()
    assert info["tp_size"] == 1 and info["vllm_config"]["model_config"]["dtype"] == "torch.float32"
    assert httpx.get(f"{server}/model_info").json()["weight_version"] == "0"
    assert post(server, "/release_memory_occupation", tags=["kv_cache"]).json()["success"]
    assert post(server, "/resume_memory_occupation", tags=["kv_cache"]).json()["success"]
    assert len(greedy_ids(server, ids)) == 8


def test_distributed_update_round_trip_and_a_refused_one(server, tokenizer, ckpts):
    """A gloo group from an AReaL/slime-style trainer (master_port as a string, an extra pp_rank): per-name
    broadcasts, then one flattened bucket, each an atomic versioned update; the server then serves B. A
    declaration of the wrong shape is a 400 and changes nothing."""
    ids = tokenizer.encode(PROMPT)
    port, ctx = free_port(), mp.get_context("spawn")
    commands, done = ctx.Queue(), ctx.Queue()
    checkpoint = str(ckpts["B"] / "model.safetensors")
    trainer = ctx.Process(target=sglang_trainer, args=(port, 2, "update_weight_group", checkpoint, commands, done))
    trainer.start()
    try:
        r = post(
            server,
            "/init_weights_update_group",
            master_address="127.0.0.1",
            master_port=str(port),
            rank_offset=1,
            world_size=2,
            group_name="update_weight_group",
            backend="gloo",
            pp_rank=0,
        )
        assert r.json()["success"], r.text
        from safetensors.torch import load_file

        tensors = load_file(str(ckpts["B"] / "model.safetensors"))
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors.values()]
        declared = {
            "names": list(tensors),
            "dtypes": dtypes,
            "shapes": [list(t.shape) for t in tensors.values()],
            "group_name": "update_weight_group",
        }
        assert post(server, "/pause_generation", mode="abort").json()["status"] == "ok"
        for command, fmt, version in (("names", None, "7"), ("bucket", "flattened_bucket", "8")):
            commands.put(command)
            r = post(
                server,
                "/update_weights_from_distributed",
                **declared,
                load_format=fmt,
                weight_version=version,
                flush_cache=False,
            )
            assert r.status_code == 200 and r.json()["success"], r.text
            assert done.get(timeout=60) == command
            assert httpx.get(f"{server}/get_weight_version").json()["weight_version"] == version
        # an explicit session: two calls receive one stream, committed together at /end_weight_update
        assert post(server, "/begin_weight_update", selector="all").json()["success"]
        commands.put("names")
        half = len(declared["names"]) // 2
        for part in (slice(0, half), slice(half, None)):
            fields = {k: declared[k][part] for k in ("names", "dtypes", "shapes")}
            r = post(server, "/update_weights_from_distributed", **fields, group_name="update_weight_group")
            assert r.json()["success"], r.text
        assert done.get(timeout=60) == "names"
        assert httpx.get(f"{server}/get_weight_version").json()["weight_version"] == "8", "committed only at end"
        assert post(server, "/end_weight_update").json()["success"]
        assert httpx.get(f"{server}/get_weight_version").json()["weight_version"] == "9"
        assert post(server, "/continue_generation").json()["status"] == "ok"
        assert greedy_ids(server, ids) == hf_greedy(str(ckpts["B"]), tuple(ids), 8)[0]
        before = httpx.get(f"{server}/weight_checksums").json()["checksums"]
        bad = {**declared, "shapes": [[1], *declared["shapes"][1:]]}
        r = post(server, "/update_weights_from_distributed", **bad)
        assert r.status_code == 400 and r.json()["success"] is False and "shape" in r.json()["message"]
        assert httpx.get(f"{server}/weight_checksums").json()["checksums"] == before
        assert httpx.get(f"{server}/get_weight_version").json()["weight_version"] == "9"
        assert post(server, "/destroy_weights_update_group", group_name="update_weight_group").json()["success"]
        commands.put("stop")
    finally:
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()
    r = post(
        server, "/update_weights_from_disk", model_path=str(ckpts["A"]), weight_version="10", abort_all_requests=True
    )
    assert r.json() == {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
    assert greedy_ids(server, ids) == hf_greedy(str(ckpts["A"]), tuple(ids), 8)[0]
    assert httpx.get(f"{server}/get_weight_version").json()["weight_version"] == "10"
    r = post(server, "/update_weights_from_disk", model_path="/nonexistent")
    assert r.status_code == 400 and r.json()["success"] is False
    assert post(server, "/update_weight_version", new_version="0").json()["new_version"] == "0"


def test_refused_versions_never_leave_a_session_open(server, tokenizer):
    """A weight_version that is no label (empty) is refused before anything moves (SGLang's routes); vLLM's finish
    refuses it and keeps its session open for a retry: the server keeps generating and takes the next update."""
    ids = tokenizer.encode(PROMPT)
    before = greedy_ids(server, ids)
    bad = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "weight_version": ""}
    r = post(server, "/update_weights_from_distributed", **bad)
    assert r.status_code == 400 and "weight_version" in r.json()["message"]
    assert post(server, "/update_weights_from_disk", model_path="/x", weight_version="").status_code == 400
    assert post(server, "/init_weight_transfer_engine", init_info={"backend": "disk"}).status_code == 200
    assert post(server, "/start_weight_update").status_code == 200
    assert post(server, "/finish_weight_update", weight_version="").status_code == 400
    assert post(server, "/start_weight_update").status_code == 409, "the refused finish kept its session"
    assert post(server, "/abort_weight_update").status_code == 200
    assert post(server, "/start_weight_update").status_code == 200
    assert post(server, "/abort_weight_update").status_code == 200
    assert post(server, "/end_weight_update").json()["success"] is False  # no /begin_weight_update session
    assert greedy_ids(server, ids) == before


def test_released_weights_come_back_through_bucketed_updates(ckpts):
    """After the weights' memory was released (AReaL's /release_memory_occupation {}), a re-send in several
    committed updates (one per bucket) restores them; until the last bucket the engine refuses to generate."""
    from safetensors.torch import load_file

    from conftest import serves
    from hotswap import LLM, SamplingParams

    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    llm.sleep(2)
    llm.wake_up()
    tensors = list(load_file(str(ckpts["A"] / "model.safetensors")).items())
    half = len(tensors) // 2
    llm.reload_weights(weights_iterator=tensors[:half])
    assert llm.llm_engine.health_problem() is not None
    with pytest.raises(RuntimeError, match="inconsistent"):
        llm.generate("hi", SamplingParams(max_tokens=1), use_tqdm=False)
    llm.reload_weights(weights_iterator=tensors[half:])
    assert llm.llm_engine.health_problem() is None and serves(llm, ckpts["A"])


def test_group_abort_by_prefix_on_sglang_and_vllm_routes(server):
    """SGLang's `{"rid": "group::", "prefix": true}` and vLLM's `/abort_requests` (ids, and hotswap's `prefix`)
    end a whole group at once, each request answering with its partial output and finish_reason abort; requests
    outside the group go on."""
    body = {
        "input_ids": [5, 6, 7, 8],
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True, "temperature": 1.0},
    }
    results: dict[str, dict] = {}

    def run(rid: str) -> None:
        results[rid] = post(server, "/generate", rid=rid, **body).json()

    def running() -> int:
        return httpx.get(f"{server}/v1/loads").json()["loads"][0]["num_reqs"]

    def start(rids: list[str]) -> list[threading.Thread]:
        threads = [threading.Thread(target=run, args=(rid,)) for rid in rids]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while running() < len(rids) and time.monotonic() < deadline:
            time.sleep(0.02)
        return threads

    threads = start(["g1::0", "g1::1", "g1::2", "other"])
    assert post(server, "/abort_request", rid="g1::", prefix=True).json()["aborted"] == 3
    for thread in threads[:3]:
        thread.join(30)
    for rid in ("g1::0", "g1::1", "g1::2"):
        meta = results[rid]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == len(results[rid]["output_ids"])
    assert "other" not in results and running() == 1  # outside the group: still generating
    vllm = post(server, "/abort_requests", request_ids=["other"]).json()
    assert vllm["aborted"] == 1 and vllm["request_ids"] == ["other"]
    threads[3].join(30)
    assert results["other"]["meta_info"]["finish_reason"]["type"] == "abort"
    threads = start(["g2::a", "g2::b"])
    assert sorted(post(server, "/abort_requests", prefix="g2::").json()["request_ids"]) == ["g2::a", "g2::b"]
    for thread in threads:
        thread.join(30)
    assert running() == 0
