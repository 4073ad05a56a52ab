"""vLLM's OpenAI and RL surface, as RL frameworks call it, against a real server process: the request fields and
response shapes of vLLM 0.32/0.33, the query-parameter admin routes, and TRL's own AsyncGRPO client through a whole
pause -> start -> update -> finish -> resume cycle (weights over hotswap's torch_dist sender)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from conftest import hf_greedy, hf_model
from hotswap import LLM, SamplingParams
from hotswap.transfer.torch_dist import TorchDistSender
from server_helpers import post, running_server
from transfer_helpers import free_port

PROMPTS = ["hello world", "the quick brown fox jumps over", "numbers 1 2 3 4"]


@pytest.fixture(scope="module")
def server(ckpts):
    with running_server(
        str(ckpts["A"]), "--admin-auth", "none", "--kv-cache-memory-bytes", str(1 << 23), "--max-logprobs", "-1"
    ) as base:
        yield base


def test_batched_prompts_token_ids_and_their_shapes(server, tokenizer, ckpts):
    """A batch of texts or of token-id lists gives prompt-major choices (n each), equal to one request per
    prompt; return_token_ids adds token_ids and prompt_token_ids; return_tokens_as_token_ids names logprob tokens
    "token_id:<id>"; return_weight_versions gives vLLM's span objects."""
    ids = [tokenizer.encode(p) for p in PROMPTS]
    body = dict(
        model="A",
        max_tokens=6,
        temperature=0,
        n=2,
        ignore_eos=True,
        return_token_ids=True,
        logprobs=2,
        return_tokens_as_token_ids=True,
        return_weight_versions=True,
    )
    by_text = post(server, "/v1/completions", prompt=PROMPTS, **body).json()
    by_ids = post(server, "/v1/completions", prompt=ids, **body).json()
    assert [c["index"] for c in by_ids["choices"]] == list(range(6))
    for i, prompt_ids in enumerate(ids):
        expected = hf_greedy(str(ckpts["A"]), tuple(prompt_ids), 6)[0]
        for j in range(2):
            for response in (by_text, by_ids):
                choice = response["choices"][2 * i + j]
                assert choice["token_ids"] == expected and choice["prompt_token_ids"] == prompt_ids
            lp = by_ids["choices"][2 * i + j]["logprobs"]
            assert lp["tokens"] == [f"token_id:{t}" for t in expected]
            assert all(f"token_id:{t}" in top for t, top in zip(expected, lp["top_logprobs"], strict=True))
            span = {"version": "0", "start": 0, "end": 6, "version_id": 0}
            assert by_ids["choices"][2 * i + j]["weight_versions"] == [span]
    assert by_ids["usage"]["prompt_tokens"] == sum(map(len, ids))
    single = post(server, "/v1/completions", prompt=ids[1], model="A", max_tokens=6, temperature=0).json()
    assert single["choices"][0]["text"] == by_ids["choices"][2]["text"]


def test_echo_and_prompt_logprobs_are_transformers_log_softmax(server, tokenizer, ckpts):
    """lm-eval's loglikelihood request (echo, logprobs=1, max_tokens=1) and max_tokens=0: the prompt's token
    logprobs equal log_softmax of transformers' logits within 1e-4; prompt_logprobs has vLLM's shape."""
    ids = tokenizer.encode(PROMPTS[1] + " and then some")
    with torch.no_grad():
        ref = hf_model(str(ckpts["A"]))(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for max_tokens in (1, 0):
        out = post(
            server,
            "/v1/completions",
            model="A",
            prompt=ids,
            echo=True,
            logprobs=1,
            max_tokens=max_tokens,
            temperature=0,
        ).json()["choices"][0]
        lp = out["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
        for pos in range(1, len(ids)):
            assert abs(lp["token_logprobs"][pos] - ref[pos - 1, ids[pos]].item()) < 1e-4
            best = max(lp["top_logprobs"][pos].items(), key=lambda kv: kv[1])[1]
            assert abs(best - ref[pos - 1].max().item()) < 1e-4
        assert out["text"].startswith(tokenizer.decode(ids))
    out = post(server, "/v1/completions", model="A", prompt=ids, max_tokens=1, prompt_logprobs=2).json()
    plp = out["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    entry = plp[3][str(ids[3])]
    assert set(entry) == {"logprob", "rank", "decoded_token"} and abs(entry["logprob"] - ref[2, ids[3]].item()) < 1e-4


def test_sampling_fields_and_refused_fields(server, tokenizer):
    ids = tokenizer.encode(PROMPTS[0])
    base = dict(model="A", prompt=ids, max_tokens=8, temperature=0, ignore_eos=True)
    plain = post(server, "/v1/completions", **base).json()["choices"][0]["text"]
    for extra in ({"repetition_penalty": 1.5}, {"logit_bias": {"7": 40}}):
        r = post(server, "/v1/completions", **base, **extra)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] != plain, extra
    penalized = post(server, "/v1/completions", **base, presence_penalty=1.0, frequency_penalty=1.5)
    assert penalized.status_code == 200  # their definitions are checked in test_sampling.py
    assert post(server, "/v1/completions", **base, logit_bias={"7": 40}).json()["choices"][0][
        "text"
    ] == tokenizer.decode([7] * 8)
    for field, value in [("use_beam_search", True), ("guided_whitespace_pattern", " ")]:
        r = post(server, "/v1/completions", **base, **{field: value})
        assert r.status_code == 400 and field in r.text, (field, r.text)
    r = post(server, "/v1/completions", **base, structured_outputs={"regex": "a+"}, guided_regex="b+")
    assert r.status_code == 400 and "one output constraint" in r.text
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = post(
        server,
        "/v1/chat/completions",
        model="A",
        messages=[{"role": "user", "content": "hi"}],
        tools=tools,
        tool_choice="auto",
    )  # this server has no --tool-call-parser
    assert r.status_code == 400 and "--tool-call-parser" in r.text
    assert post(server, "/v1/completions", **{**base, "max_tokens": 0}).status_code == 400


def test_chat_token_ids_content_parts_usage_and_cache_salt(server, tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]
    r = post(
        server,
        "/v1/chat/completions",
        model="A",
        messages=messages,
        max_tokens=5,
        temperature=0,
        return_token_ids=True,
        logprobs=True,
        top_logprobs=2,
        return_tokens_as_token_ids=True,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="none",
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"][-3:] and len(body["choices"][0]["token_ids"]) == 5
    assert body["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        json=dict(model="A", prompt=PROMPTS[0], max_tokens=4, stream=True, stream_options={"include_usage": True}),
        timeout=60,
    ) as stream:
        chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
    last = json.loads(chunks[-1][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    long = " ".join(["salted"] * 60)

    def cached(salt: str) -> int:
        r = post(server, "/v1/completions", model="A", prompt=long, max_tokens=1, cache_salt=salt)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0 and cached("alice") > 0 and cached("bob") == 0


def test_query_parameter_admin_routes_and_info(server, ckpts):
    info = httpx.get(f"{server}/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["model_config"]["dtype"] == "torch.float32" and info["weight_transfer_config"] is not None
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["max_model_len"] == info["model_config"]["max_model_len"]
    assert httpx.get(f"{server}/get_world_size", params={"include_dp": "true"}).json() == {"world_size": 1}
    assert httpx.post(f"{server}/pause", params={"mode": "keep"}).json()["status"] == "paused"
    assert httpx.get(f"{server}/is_paused").json() == {"is_paused": True}
    assert httpx.post(f"{server}/resume").json()["status"] == "resumed"
    assert httpx.post(f"{server}/pause", params={"mode": "bogus"}).status_code == 400
    assert httpx.post(f"{server}/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
    assert httpx.get(f"{server}/is_sleeping").json() == {"is_sleeping": True}
    r = httpx.post(f"{server}/wake_up", params=[("tags", "kv_cache"), ("tags", "weights")])
    assert r.json() == {"status": "awake", "tags": ["kv_cache", "weights"]}
    assert httpx.post(f"{server}/reset_prefix_cache", json={"reset_running_requests": True}).json()["success"]
    assert post(server, "/abort_requests").json() == {"status": "aborted", "aborted": 0, "request_ids": []}
    relabel = post(server, "/update_weight_version", new_version="41").json()
    assert relabel["success"] is True and relabel["new_version"] == "41"
    assert httpx.get(f"{server}/weight_info").json() == {"weight_version": "41"}
    assert post(server, "/update_weight_version", new_version="v1").json()["new_version"] == "v1"  # any label
    assert httpx.get(f"{server}/weight_info").json() == {"weight_version": "v1"}
    assert post(server, "/update_weight_version", new_version="").status_code == 400
    toks = post(server, "/tokenize", prompt="hello world").json()
    assert post(server, "/detokenize", tokens=toks["tokens"]).json()["prompt"].endswith("hello world")
    post(server, "/update_weight_version", new_version=0)


def test_trl_async_grpo_client_weight_cycle(server, ckpts, b_tensors, tokenizer):
    """TRL's own AsyncGRPO `VLLMClient` (requests only: no vLLM import) drives the whole cycle; the weights go
    over hotswap's torch_dist sender from a vLLM-shaped init_info (no backend named, rank_offset 1). The server
    then serves checkpoint B."""
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # the trainer's process state, which TRL's logging expects (CPU here)
    client = VLLMClient(server, server_timeout=30)
    client.wait_for_server_ready(poll_interval_s=0.1)
    assert client.get_dtype() == "torch.float32"
    assert client.get_world_size() == 1
    port = free_port()
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "packed": True}
    init = threading.Thread(target=client.init_weight_transfer_engine, args=(init_info,))
    init.start()
    sender = TorchDistSender("127.0.0.1", port)
    init.join(60)
    client.pause()
    client.start_weight_update()  # sends {"is_checkpoint_format": true}
    update = threading.Thread(target=client.update_weights, args=(sender.update_info(b_tensors),))
    update.start()
    sender.send(b_tensors)
    update.join(60)
    client.finish_weight_update()  # no body
    client.resume()
    ids = tokenizer.encode(PROMPTS[0])
    rollout = post(
        server,
        "/v1/completions",
        model="A",
        prompt=ids,
        max_tokens=8,
        temperature=0,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        n=1,
        return_token_ids=True,
        logprobs=0,
        seed=12345,
    ).json()
    choice = rollout["choices"][0]
    assert choice["token_ids"] == hf_greedy(str(ckpts["B"]), tuple(ids), 8)[0]
    assert len(choice["logprobs"]["token_logprobs"]) == 8
    assert httpx.get(f"{server}/weight_info").json()["weight_version"] == "1"
    sender.close()


def test_llm_accepts_cache_salt(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22)
    prompt = " ".join(["word"] * 60)
    ids = llm.get_tokenizer().encode(prompt)
    params = SamplingParams(max_tokens=1)
    llm.generate({"prompt_token_ids": ids, "cache_salt": "alice"}, params, use_tqdm=False)
    again = llm.generate({"prompt_token_ids": ids, "cache_salt": "alice"}, params, use_tqdm=False)[0]
    other = llm.generate({"prompt_token_ids": ids, "cache_salt": "bob"}, params, use_tqdm=False)[0]
    unsalted = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": 3}, params, use_tqdm=False)


def test_new_requests_get_503_during_an_abort_or_wait_pause(server):
    body = {"model": "A", "prompt": PROMPTS[0], "max_tokens": 2}
    for mode in ("abort", "wait"):
        assert httpx.post(f"{server}/pause", params={"mode": mode}).status_code == 200
        refused = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"], mode
        assert httpx.post(f"{server}/resume").status_code == 200
        assert httpx.post(f"{server}/v1/completions", json=body, timeout=30).status_code == 200


def test_update_info_per_worker_and_empty_repeats_the_last(ckpts, b_tensors):
    """vLLM 0.33's forms: update_info as a list (one per worker) and an empty declaration meaning the previous
    one; the second round (checkpoint A again, declared empty) restores A."""
    from safetensors.torch import load_file

    from conftest import serves

    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    port = free_port()
    init = threading.Thread(
        target=llm.init_weight_transfer_engine, args=({"master_address": "127.0.0.1", "master_port": port},)
    )
    init.start()
    sender = TorchDistSender("127.0.0.1", port)
    init.join(60)
    a_tensors = list(load_file(str(ckpts["A"] / "model.safetensors")).items())
    for tensors, info in (
        (b_tensors, [sender.update_info(b_tensors)]),
        (a_tensors, {"names": [], "dtype_names": [], "shapes": []}),
    ):
        order = {n: i for i, (n, _) in enumerate(b_tensors)}
        tensors = sorted(tensors, key=lambda item: order[item[0]])  # the declared order of the first round
        llm.start_weight_update()
        send = threading.Thread(target=sender.send, args=(tensors,))
        send.start()
        llm.update_weights(info)
        send.join(60)
        llm.finish_weight_update()
    assert serves(llm, ckpts["A"])
    llm.start_weight_update()
    with pytest.raises(ValueError, match="identical declaration"):
        llm.update_weights([sender.update_info(b_tensors[:1]), sender.update_info(b_tensors[1:2])])
    assert not llm.llm_engine.state.value == "updating" and serves(llm, ckpts["A"])
    sender.close()
    llm.shutdown_weight_transfer_engine()
