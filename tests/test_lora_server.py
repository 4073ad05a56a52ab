"""LoRA adapters over HTTP, against one real server process started with --enable-lora, an admin key and an
adapter from --lora-modules: vLLM's routes (/v1/load_lora_adapter, /v1/unload_lora_adapter, `model=<adapter>` on
the OpenAI routes, adapters in /v1/models, lora_config in /server_info), SGLang's (/load_lora_adapter,
/load_lora_adapter_from_tensors, /unload_lora_adapter, per-request `lora_path` on /generate), refusals that leave
the loaded adapters as they were, the admin key, and TRL's AsyncGRPO client publishing versioned adapters.
Every adapter's greedy tokens are compared with an in-process `LLM` running the same PEFT folder."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle
import re
import shutil
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from hotswap import LLM, LoRARequest, SamplingParams
from hotswap.testing import make_tiny_lora
from server_helpers import post, running_server

pytestmark = pytest.mark.timeout(180)

KEY = "sk-lora-admin"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
PROMPT = "the quick brown fox jumps over"
# over two KV blocks (block size 16): a repeat of it hits the prefix cache
LONG_PROMPT = " ".join(f"step {i} of a long shared rollout prefix" for i in range(6))
Greedy = Callable[[list[int], "Path | None"], list[int]]


@pytest.fixture(scope="module")
def adapters(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT folders for checkpoint A: "a", "b", "c" (rank 8, three draws of one shape), "big" (rank 32, over the
    server's --max-lora-rank 16), "badmod" ("a" with q_proj renamed to a module the model lacks), "plain" (a
    folder without adapter_config.json), "corrupt" (its weights file is not safetensors)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("lora_server")
    out = {
        name: make_tiny_lora(ckpts["A"], root / name, rank=8, seed=seed)
        for name, seed in (("a", 1), ("b", 2), ("c", 3))
    }
    out["big"] = make_tiny_lora(ckpts["A"], root / "big", rank=32, seed=4)
    shutil.copytree(out["a"], root / "badmod")
    tensors = load_file(str(out["a"] / "adapter_model.safetensors"))
    save_file(
        {k.replace("q_proj", "nope_proj"): v for k, v in tensors.items()},
        str(root / "badmod" / "adapter_model.safetensors"),
    )
    out["badmod"] = root / "badmod"
    (root / "plain").mkdir()
    out["plain"] = root / "plain"
    (root / "corrupt").mkdir()
    shutil.copy(out["a"] / "adapter_config.json", root / "corrupt")
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    out["corrupt"] = root / "corrupt"
    return out


@pytest.fixture(scope="module")
def greedy(ckpts, adapters) -> Iterator[Greedy]:
    """greedy(prompt_ids, folder): an in-process LLM's greedy tokens (8, EOS ignored) with the adapter of that PEFT
    folder (None: the base model), each folder loaded fresh under its own name."""
    llm = LLM(
        str(ckpts["A"]), enable_lora=True, max_loras=2, max_cpu_loras=8, max_lora_rank=16, kv_cache_memory_bytes=1 << 22
    )
    requests: dict[Path, LoRARequest] = {}
    cache: dict[tuple[tuple[int, ...], Path | None], list[int]] = {}

    def run(ids: list[int], folder: Path | None) -> list[int]:
        if (tuple(ids), folder) not in cache:
            lora = None
            if folder is not None:
                lora = requests.setdefault(folder, LoRARequest(f"ref-{len(requests)}", len(requests) + 1, str(folder)))
            out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False, lora_request=lora)[0]
            cache[(tuple(ids), folder)] = out.outputs[0].token_ids
        return cache[(tuple(ids), folder)]

    yield run
    llm.shutdown()


@pytest.fixture(scope="module")
def server(ckpts, adapters) -> Iterator[str]:
    with running_server(
        str(ckpts["A"]),
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "4",
        "--max-lora-rank",
        "16",
        "--admin-key",
        KEY,
        "--lora-modules",
        f"boot={adapters['a']}",
        "--kv-cache-memory-bytes",
        str(1 << 23),
    ) as base:
        yield base


@pytest.fixture(autouse=True)
def _only_boot_after(request) -> Iterator[None]:
    """After each test of the server: generation resumed, and every adapter but "boot" unloaded."""
    yield
    if "server" not in request.fixturenames:
        return
    base = request.getfixturevalue("server")
    httpx.post(f"{base}/resume", headers=AUTH)
    for name in cards(base):
        if name not in ("A", "boot"):
            assert admin(base, "/v1/unload_lora_adapter", lora_name=name).status_code == 200, name


def admin(base: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=120)


def cards(base: str) -> dict[str, dict]:
    """/v1/models' cards by id, without their `created` time."""
    data = httpx.get(f"{base}/v1/models").json()["data"]
    return {c["id"]: {k: v for k, v in c.items() if k != "created"} for c in data}


def complete(base: str, model: str, ids: list[int], **extra) -> httpx.Response:
    return post(
        base,
        "/v1/completions",
        model=model,
        prompt=ids,
        max_tokens=TOKENS,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
        **extra,
    )


def tokens_of(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def sglang_greedy(base: str, ids: list[int] | list[list[int]], lora_path) -> httpx.Response:
    return post(
        base,
        "/generate",
        input_ids=ids,
        lora_path=lora_path,
        sampling_params={"temperature": 0, "max_new_tokens": TOKENS, "ignore_eos": True},
    )


def safetensors_b64(folder: Path) -> str:
    from safetensors.torch import load_file, save

    return base64.b64encode(save(load_file(str(folder / "adapter_model.safetensors")))).decode()


def test_start_up_adapter_models_listing_and_server_info(server, adapters, greedy, tokenizer, ckpts):
    """--lora-modules loads "boot" before the server answers: /v1/models lists it as vLLM does, /server_info has
    the lora_config TRL reads, and model="boot" runs it (the in-process LLM's tokens, not the base's)."""
    listed = cards(server)
    assert listed["boot"] == {
        "id": "boot",
        "object": "model",
        "owned_by": "hotswap",
        "root": str(adapters["a"]),
        "parent": "A",
        "max_model_len": listed["A"]["max_model_len"],
        "lora_int_id": 1,
        "version": 1,
    }
    assert listed["A"]["parent"] is None and listed["A"]["root"] == str(ckpts["A"])
    info = httpx.get(f"{server}/server_info", headers=AUTH).json()["vllm_config"]
    assert info["lora_config"] == {
        "max_lora_rank": 16,
        "max_loras": 2,
        "max_cpu_loras": 4,
        "fully_sharded_loras": False,
        "lora_dtype": "auto",
        "lora_version_policy": "finish_on_old",
    }
    ids = tokenizer.encode(PROMPT)
    with_boot = complete(server, "boot", ids)
    assert tokens_of(with_boot) == greedy(ids, adapters["a"]) != greedy(ids, None)
    assert with_boot.json()["model"] == "boot" and with_boot.json()["choices"][0]["lora_versions"] == [[1, 0, 8]]
    base = complete(server, "A", ids)
    assert tokens_of(base) == greedy(ids, None) and "lora_versions" not in base.json()["choices"][0]


def test_vllm_load_then_completions_and_chat_run_the_adapter(server, adapters, greedy, tokenizer):
    """/v1/load_lora_adapter answers vLLM's plain-text line; completions (whole and streamed) with model=<name>
    give the in-process LLM's tokens for that folder; chat runs it too, with vLLM's span objects on request."""
    response = admin(server, "/v1/load_lora_adapter", lora_name="sql", lora_path=str(adapters["b"]))
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'sql' added successfully."
    assert response.headers["content-type"].startswith("text/plain")
    listed = cards(server)["sql"]
    assert (listed["root"], listed["parent"], listed["version"]) == (str(adapters["b"]), "A", 1)
    ids = tokenizer.encode(PROMPT)
    expected = greedy(ids, adapters["b"])
    assert expected != greedy(ids, None) and expected != greedy(ids, adapters["a"])
    assert tokens_of(complete(server, "sql", ids)) == expected
    spans = complete(server, "sql", ids, return_weight_versions=True).json()["choices"][0]
    assert spans["lora_versions"] == [{"version": 1, "start": 0, "end": 8}]
    assert spans["weight_versions"] == [{"version": "0", "start": 0, "end": 8, "version_id": 0}]
    streamed: list[int] = []
    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        timeout=60,
        json=dict(
            model="sql",
            prompt=ids,
            max_tokens=TOKENS,
            temperature=0,
            ignore_eos=True,
            return_token_ids=True,
            stream=True,
        ),
    ) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk["model"] == "sql"
                streamed += chunk["choices"][0]["token_ids"]
    assert streamed == expected
    messages = [{"role": "user", "content": PROMPT}]
    rendered = post(server, "/v1/chat/completions/render", model="sql", messages=messages).json()["prompt_token_ids"]
    chat = post(
        server,
        "/v1/chat/completions",
        model="sql",
        messages=messages,
        max_tokens=TOKENS,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
    ).json()
    assert chat["model"] == "sql" and chat["choices"][0]["token_ids"] == greedy(rendered, adapters["b"])
    assert chat["choices"][0]["lora_versions"] == [[1, 0, 8]]


def test_inplace_reload_changes_the_very_next_request(server, adapters, greedy, tokenizer):
    """vllm#42125: load_inplace with another folder under the same name; the same prompt, sent right after, runs
    the new weights (a fresh LLM's tokens for the new folder) and reuses none of the old version's cached KV,
    while a repeat under one version does hit the prefix cache."""
    ids = tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 40
    assert admin(server, "/v1/load_lora_adapter", lora_name="policy", lora_path=str(adapters["a"])).status_code == 200
    first = complete(server, "policy", ids)
    assert tokens_of(first) == greedy(ids, adapters["a"])
    repeat = complete(server, "policy", ids).json()
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # the cache is on for this adapter
    reload = admin(server, "/v1/load_lora_adapter", lora_name="policy", lora_path=str(adapters["c"]), load_inplace=True)
    assert reload.status_code == 200 and reload.text == "Success: LoRA adapter 'policy' added successfully."
    after = complete(server, "policy", ids)
    assert tokens_of(after) == greedy(ids, adapters["c"]) != greedy(ids, adapters["a"])
    assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after.json()["choices"][0]["lora_versions"] == [[2, 0, 8]]
    listed = cards(server)["policy"]
    assert (listed["version"], listed["root"]) == (2, str(adapters["c"]))


def test_unload_then_the_name_is_404(server, adapters, tokenizer):
    assert admin(server, "/v1/load_lora_adapter", lora_name="gone", lora_path=str(adapters["b"])).status_code == 200
    ids = tokenizer.encode(PROMPT)
    assert complete(server, "gone", ids).status_code == 200
    response = admin(server, "/v1/unload_lora_adapter", lora_name="gone")
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'gone' removed successfully."
    missing = complete(server, "gone", ids)
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "The model `gone` does not exist.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    chat = post(server, "/v1/chat/completions", model="gone", messages=[{"role": "user", "content": "hi"}])
    assert chat.status_code == 404
    again = admin(server, "/v1/unload_lora_adapter", lora_name="gone")
    assert again.status_code == 404
    assert again.json()["error"]["message"] == "The lora adapter 'gone' cannot be found."
    assert "gone" not in cards(server)


def test_sglang_load_generate_with_lora_path_tensors_and_unload(server, adapters, greedy, tokenizer):
    """SGLang's routes answer its LoRAUpdateOutput; /generate's lora_path (one for all, or one per input) runs each
    input with its adapter, and a folder that is not loaded is refused (a user route never reads the server's
    disk); tensors load through /load_lora_adapter_from_tensors
    (safetensors or torch.save bytes; a pickle is refused); upsert replaces an adapter's weights."""
    loaded = admin(server, "/load_lora_adapter", lora_name="tenant", lora_path=str(adapters["b"]), pinned=True)
    assert loaded.status_code == 200
    assert loaded.json() == {
        "success": True,
        "error_message": "",
        "message": "LoRA adapter 'tenant' loaded.",
        "loaded_adapters": {"boot": str(adapters["a"]), "tenant": str(adapters["b"])},
    }
    ids = tokenizer.encode(PROMPT)
    one = sglang_greedy(server, ids, "tenant").json()
    assert one["output_ids"] == greedy(ids, adapters["b"])
    assert one["meta_info"]["lora_name"] == "tenant"
    assert one["meta_info"]["lora_versions"] == [{"version": 1, "start": 0, "end": 8}]
    batch = sglang_greedy(server, [ids, ids, ids], ["tenant", None, "boot"]).json()
    assert [r["output_ids"] for r in batch] == [
        greedy(ids, adapters["b"]),
        greedy(ids, None),
        greedy(ids, adapters["a"]),
    ]
    assert "lora_name" not in batch[1]["meta_info"]
    before = cards(server)
    by_folder = sglang_greedy(server, ids, str(adapters["c"]))  # not loaded: refused, nothing read
    assert by_folder.status_code == 400 and "/load_lora_adapter" in by_folder.text
    assert cards(server) == before

    config = json.loads((adapters["b"] / "adapter_config.json").read_text())
    from_tensors = admin(
        server,
        "/load_lora_adapter_from_tensors",
        lora_name="pushed",
        config_dict=config,
        serialized_named_tensors=[safetensors_b64(adapters["b"])],
        load_format=None,
    )
    assert from_tensors.status_code == 200 and from_tensors.json()["success"] is True
    assert from_tensors.json()["loaded_adapters"]["pushed"] == "__tensor__"
    assert sglang_greedy(server, ids, "pushed").json()["output_ids"] == greedy(ids, adapters["b"])
    assert tokens_of(complete(server, "pushed", ids)) == greedy(ids, adapters["b"])
    assert cards(server)["pushed"]["root"] is None

    from safetensors.torch import load_file

    buffer = io.BytesIO()
    torch.save(load_file(str(adapters["c"] / "adapter_model.safetensors")), buffer)
    upsert = admin(
        server,
        "/load_lora_adapter_from_tensors",
        lora_name="pushed",
        config_dict=config,
        upsert=True,
        serialized_tensors=base64.b64encode(buffer.getvalue()).decode(),
    )  # SGLang's older field
    assert upsert.status_code == 200, upsert.text
    assert sglang_greedy(server, ids, "pushed").json()["output_ids"] == greedy(ids, adapters["c"])
    assert cards(server)["pushed"]["version"] == 2
    before = cards(server)
    pickled = admin(
        server,
        "/load_lora_adapter_from_tensors",
        lora_name="evil",
        config_dict=config,
        serialized_named_tensors=[base64.b64encode(pickle.dumps({"x": 1})).decode()],
    )
    assert pickled.status_code == 400 and pickled.json()["success"] is False
    assert "pickle" in pickled.json()["error_message"] and cards(server) == before

    for name in ("tenant", "pushed"):
        unloaded = admin(server, "/unload_lora_adapter", lora_name=name)
        assert unloaded.status_code == 200 and name not in unloaded.json()["loaded_adapters"]
    unknown = admin(server, "/unload_lora_adapter", lora_name="tenant")
    assert unknown.status_code == 400 and unknown.json()["success"] is False
    assert "not loaded" in unknown.json()["error_message"]
    assert set(cards(server)) == {"A", "boot"}


def test_admin_client_pushes_adapters_from_memory_and_through_the_weight_session(server, adapters, greedy, tokenizer):
    """hotswap's AdminClient: an adapter's tensors from this process (no folder), then its next version over
    shared memory through the weight session (target "lora:<name>"), each served on the next request."""
    from safetensors.torch import load_file

    from hotswap.entrypoints.client import AdminClient, AdminError

    client = AdminClient(server, admin_key=KEY)
    try:
        config = json.loads((adapters["b"] / "adapter_config.json").read_text())
        b = load_file(str(adapters["b"] / "adapter_model.safetensors"))
        assert client.push_lora_adapter("mem", b.items(), config)["mem"] == "__tensor__"
        ids = tokenizer.encode(PROMPT)
        assert tokens_of(complete(server, "mem", ids)) == greedy(ids, adapters["b"])
        c = load_file(str(adapters["c"] / "adapter_model.safetensors"))
        assert client.push_weights(c.items(), backend="shm", target="lora:mem") == "0"  # the model's version stays
        after = complete(server, "mem", ids)
        assert tokens_of(after) == greedy(ids, adapters["c"])
        assert after.json()["choices"][0]["lora_versions"] == [[2, 0, 8]]
        client.load_lora_adapter("disk", str(adapters["a"]))
        assert tokens_of(complete(server, "disk", ids)) == greedy(ids, adapters["a"])
        client.unload_lora_adapter("disk")
        with pytest.raises(AdminError, match="cannot be found"):
            client.unload_lora_adapter("disk")
        with pytest.raises(AdminError, match="max_lora_rank"):
            client.push_lora_adapter(
                "big",
                load_file(str(adapters["big"] / "adapter_model.safetensors")).items(),
                json.loads((adapters["big"] / "adapter_config.json").read_text()),
            )
    finally:
        client.close()


def test_refused_loads_are_4xx_naming_the_problem_and_change_nothing(server, adapters, tokenizer):
    before = cards(server)
    vllm_cases = [
        ({"lora_name": "x", "lora_path": str(adapters["big"])}, 400, "max_lora_rank"),
        ({"lora_name": "x", "lora_path": str(adapters["badmod"])}, 400, "nope_proj"),
        ({"lora_name": "x", "lora_path": str(adapters["plain"])}, 400, "adapter_config.json"),
        ({"lora_name": "x", "lora_path": str(adapters["corrupt"])}, 400, "header|safetensors"),
        ({"lora_name": "x", "lora_path": str(adapters["plain"] / "missing")}, 404, "No adapter found"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "boot", "lora_path": str(adapters["b"])}, 400, "already been loaded"),
        ({"lora_name": "A", "lora_path": str(adapters["b"])}, 400, "served model"),
    ]
    for body, status, words in vllm_cases:
        response = admin(server, "/v1/load_lora_adapter", **body)
        assert response.status_code == status, (body, response.text)
        assert re.search(words, response.json()["error"]["message"]), (body, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert cards(server) == before, body
    sglang_cases = [
        ({"lora_name": "x", "lora_path": str(adapters["big"])}, "max_lora_rank"),
        ({"lora_name": "x", "lora_path": str(adapters["badmod"])}, "nope_proj"),
        ({"lora_name": "x", "lora_path": str(adapters["corrupt"])}, "header|safetensors"),
        ({"lora_name": "x", "lora_path": str(adapters["plain"] / "missing")}, "not a folder"),
        ({"lora_name": "boot", "lora_path": str(adapters["b"])}, "already loaded"),
    ]
    for body, words in sglang_cases:
        response = admin(server, "/load_lora_adapter", **body)
        assert response.status_code == 400 and response.json()["success"] is False, body
        assert re.search(words, response.json()["error_message"]), (body, response.text)
        assert cards(server) == before, body
    config = json.loads((adapters["big"] / "adapter_config.json").read_text())
    tensors = admin(
        server,
        "/load_lora_adapter_from_tensors",
        lora_name="x",
        config_dict=config,
        serialized_named_tensors=[safetensors_b64(adapters["big"])],
    )
    assert tensors.status_code == 400 and "max_lora_rank" in tensors.json()["error_message"]
    unknown = sglang_greedy(server, tokenizer.encode(PROMPT), "no-such-adapter")
    assert unknown.status_code == 400 and "no-such-adapter" in unknown.json()["error"]["message"]
    assert cards(server) == before

    # too many: --max-cpu-loras 4 holds "boot" and three more; the fifth is refused, nothing evicted
    for i, folder in enumerate(("a", "b", "c")):
        assert (
            admin(server, "/v1/load_lora_adapter", lora_name=f"t{i}", lora_path=str(adapters[folder])).status_code
            == 200
        )
    full = cards(server)
    refused = admin(server, "/v1/load_lora_adapter", lora_name="t3", lora_path=str(adapters["a"]))
    assert refused.status_code == 400 and "max_cpu_loras" in refused.json()["error"]["message"]
    refused = admin(server, "/load_lora_adapter", lora_name="t3", lora_path=str(adapters["a"]))
    assert refused.status_code == 400 and "max_cpu_loras" in refused.json()["error_message"]
    assert cards(server) == full and len(full) == 5


def test_the_admin_key_guards_the_lora_routes(server, adapters):
    before = cards(server)
    routes = [
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["b"])}),
        ("/v1/unload_lora_adapter", {"lora_name": "boot"}),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["b"])}),
        ("/load_lora_adapter_from_tensors", {"lora_name": "x", "config_dict": {}, "serialized_named_tensors": []}),
        ("/unload_lora_adapter", {"lora_name": "boot"}),
    ]
    for route, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.post(f"{server}{route}", json=body, headers=headers)
            assert response.status_code == 401, (route, headers)
        cross_site = httpx.post(f"{server}{route}", json=body, headers={**AUTH, "Origin": "http://evil.example"})
        assert cross_site.status_code == 403, route
    assert cards(server) == before


def test_trl_async_grpo_client_publishes_versioned_adapters(server, adapters, greedy, tokenizer, ckpts, monkeypatch):
    """TRL's AsyncGRPO: its capability probe accepts the server's /server_info (adapter-only syncs), then its
    `VLLMClient` publishes "<name>-v1" and "<name>-v2" between pause (mode keep) and resume, its rollouts name each
    version as their model, and the version that fell out of max_staleness=0 is unloaded (then 404)."""
    import requests
    from accelerate import PartialState
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    send = requests.Session.request

    def with_admin_key(self, method, url, **kwargs):  # TRL sends no key; this server asks for one
        kwargs["headers"] = {**(kwargs.get("headers") or {}), **AUTH}
        return send(self, method, url, **kwargs)

    monkeypatch.setattr(requests.Session, "request", with_admin_key)
    PartialState()  # the trainer's process state, which TRL's logging expects (CPU here)
    client = VLLMClient(server, server_timeout=30)
    client.wait_for_server_ready(poll_interval_s=0.1)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(ckpts["A"])),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    assert select_adapter_sync(client.get_server_info(), peft_model, types.SimpleNamespace(max_staleness=0)) is True

    ids = tokenizer.encode(PROMPT)

    def rollout(version: int) -> httpx.Response:  # the rollout worker's /v1/completions payload
        return post(
            server,
            "/v1/completions",
            model=f"trl-policy-v{version}",
            prompt=ids,
            max_tokens=TOKENS,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            repetition_penalty=1.0,
            n=1,
            return_token_ids=True,
            logprobs=0,
            seed=12345,
            ignore_eos=True,
        )

    max_staleness = 0
    for version, folder in ((1, adapters["a"]), (2, adapters["b"])):
        client.pause()
        client.load_lora_adapter(f"trl-policy-v{version}", str(folder))
        client.resume()
        stale = version - (max_staleness + 1)
        if stale > 0:
            client.unload_lora_adapter(f"trl-policy-v{stale}")
        out = rollout(version)
        assert tokens_of(out) == greedy(ids, folder)
        assert len(out.json()["choices"][0]["logprobs"]["token_logprobs"]) == TOKENS
    assert rollout(1).status_code == 404
    assert set(cards(server)) == {"A", "boot", "trl-policy-v2"}
    client.unload_lora_adapter("trl-policy-v1")  # a missing name: not an error for TRL (no raise)


def test_lora_routes_without_enable_lora_are_refused(ckpts, adapters):
    """A server started without --enable-lora (an in-process app) refuses every LoRA route with 400 naming the
    flag, and reports lora_config None (TRL then syncs merged weights)."""
    from hotswap.engine.async_llm_engine import AsyncLLMEngine
    from hotswap.entrypoints.server import create_app

    engine = AsyncLLMEngine.from_kwargs(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    app = create_app(engine, "A", admin_auth="none")

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
            vllm = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["a"])})
            assert vllm.status_code == 400 and "--enable-lora" in vllm.json()["error"]["message"]
            sglang = await http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["a"])})
            assert sglang.status_code == 400 and "--enable-lora" in sglang.json()["error_message"]
            generate = await http.post("/generate", json={"text": "hi", "lora_path": str(adapters["a"])})
            assert generate.status_code == 400 and "--enable-lora" in generate.json()["error"]["message"]
            unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
            assert unload.status_code == 400 and "--enable-lora" in unload.json()["error"]["message"]
            model = await http.post("/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 1})
            assert model.status_code == 404
            assert (await http.get("/server_info")).json()["vllm_config"]["lora_config"] is None
            assert [c["id"] for c in (await http.get("/v1/models")).json()["data"]] == ["A"]

    async def main() -> None:
        try:
            await run()
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.unit
def test_serve_flags_parse_vllm_and_sglang_adapter_forms():
    from hotswap.cli import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "ckpt",
            "--enable-lora",
            "--max-loras",
            "3",
            "--max-lora-rank",
            "32",
            "--max-cpu-loras",
            "6",
            "--lora-version-policy",
            "switch",
            "--lora-modules",
            "a=/p/a",
            '{"name": "b", "path": "/p/b"}',
            "--lora-paths",
            "/p/c",
            "d=/p/d",
            '{"lora_name": "e", "lora_path": "/p/e", "pinned": true}',
        ]
    )
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras, args.lora_version_policy) == (
        True,
        3,
        32,
        6,
        "switch",
    )
    assert args.lora_modules == [("a", "/p/a"), ("b", "/p/b"), ("/p/c", "/p/c"), ("d", "/p/d"), ("e", "/p/e")]
    defaults = build_parser().parse_args(["serve", "ckpt", "--max-loras-per-batch", "4"])
    assert (defaults.enable_lora, defaults.max_loras, defaults.max_cpu_loras, defaults.lora_modules) == (
        False,
        4,
        None,
        [],
    )
    for bad in (["--lora-modules", "/no/name"], ["--lora-modules", '{"name": "x"}'], ["--lora-version-policy", "x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "ckpt", *bad])
