"""Weight versions are labels, as SGLang and vLLM have them: any string a trainer gives ("step-1",
"run7/ckpt-00042") names the version it committed and comes back wherever a version is shown, while an integer
still orders versions inside; a rename never touches weights or requests unless asked; a bad label is refused
before anything moves."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from safetensors.torch import load_file

from conftest import PROMPTS, hf_greedy, serves
from hotswap import LLM, SamplingParams
from hotswap.transfer.tensors import tensors_update_info
from server_helpers import post, running_server

BAD_LABELS = ["", "   ", "x" * 257, True, 1.5, ["step-1"], -1]


def test_labels_name_versions_and_spans_in_the_python_api(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    engine = llm.llm_engine
    a_tensors = list(load_file(str(ckpts["A"] / "model.safetensors")).items())
    llm.init_weight_transfer_engine({"backend": "tensors"})
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request("r", None, llm.get_tokenizer().encode(PROMPTS[2]), params)
    final = []
    for tensors, steps in ((b_tensors, 3), (a_tensors, 3)):
        for _ in range(steps):
            engine.step()
        llm.pause_generation("keep", clear_cache=False)
        llm.start_weight_update()
        llm.update_weights(tensors_update_info(tensors))
        llm.finish_weight_update(weight_version="step-1")  # the same label twice: two versions
        llm.resume_generation()
    while not final:
        final = engine.step()
    spans = [(s.version, s.label, s.start_token, s.end_token) for s in final[0].outputs[0].weight_versions]
    assert spans == [(0, "0", 0, 3), (1, "step-1", 3, 6), (2, "step-1", 6, 12)]
    assert final[0].admission_weight_version_label == "0"
    assert llm.get_weight_version() == 2 and llm.get_weight_version_label() == "step-1"

    llm.reload_weights(weights_path=str(ckpts["B"]), weight_version="run7/ckpt-00042")
    assert llm.get_weight_version() == 3 and llm.get_weight_version_label() == "run7/ckpt-00042"
    assert serves(llm, ckpts["B"])
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert [(s.version, s.label) for s in out.outputs[0].weight_versions] == [(3, "run7/ckpt-00042")]
    llm.reload_weights(weights_path=str(ckpts["B"]), weight_version=7)  # an integer sets the integer
    assert (llm.get_weight_version(), llm.get_weight_version_label()) == (7, "7")
    llm.reload_weights(weights_path=str(ckpts["B"]), weight_version="0012")  # digits: that integer, as written
    assert (llm.get_weight_version(), llm.get_weight_version_label()) == (12, "0012")

    checksums = llm.weight_checksums()
    assert llm.update_weight_version("renamed") == "renamed"  # a rename: weights and the integer untouched
    assert llm.weight_checksums() == checksums and llm.get_weight_version() == 12
    for bad in BAD_LABELS:
        with pytest.raises(ValueError, match="weight_version"):
            llm.reload_weights(weights_path=str(ckpts["A"]), weight_version=bad)
        with pytest.raises(ValueError, match="new_version"):
            llm.update_weight_version(bad)
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(a_tensors))
    with pytest.raises(ValueError, match="weight_version"):
        llm.finish_weight_update(weight_version="")
    llm.abort_weight_update()  # the refused finish left the session open: the caller decides
    assert llm.weight_checksums() == checksums and serves(llm, ckpts["B"])
    assert (llm.get_weight_version(), llm.get_weight_version_label()) == (12, "renamed")


# ---- over HTTP: SGLang's and vLLM's routes ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(ckpts):
    with running_server(str(ckpts["A"]), "--admin-auth", "none", "--kv-cache-memory-bytes", str(1 << 23)) as base:
        yield base


def label(base: str) -> str:
    return httpx.get(f"{base}/get_weight_version").json()["weight_version"]


def sglang_greedy(base: str, ids: list[int], n: int = 8) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    return post(base, "/generate", **body).json()


class Stream:
    """A streaming vLLM-shaped completion read in a thread: its text chunks, last choice and token count."""

    def __init__(self, base: str, ids: list[int], max_tokens: int) -> None:
        self.first = threading.Event()
        self.tokens = 0
        self.last: dict = {}
        body = {"model": "A", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        body.update(ignore_eos=True, return_weight_versions=True, return_token_ids=True)
        self.thread = threading.Thread(target=self._read, args=(base, body))
        self.thread.start()
        assert self.first.wait(60)

    def _read(self, base: str, body: dict) -> None:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    self.tokens += len(choice.get("token_ids") or [])
                    self.last = choice
                    self.first.set()

    def result(self) -> dict:
        self.thread.join(120)
        assert not self.thread.is_alive()
        return self.last


def test_sglang_disk_update_takes_a_label_and_every_route_returns_it(server, ckpts, tokenizer):
    ids = tokenizer.encode(PROMPTS[1])
    r = post(server, "/update_weights_from_disk", model_path=str(ckpts["B"]), weight_version="step-1")
    assert r.status_code == 200 and r.json()["success"], r.text
    out = sglang_greedy(server, ids)
    assert out["output_ids"] == hf_greedy(str(ckpts["B"]), tuple(ids), 8)[0]
    assert out["meta_info"]["weight_version"] == "step-1"
    assert out["meta_info"]["weight_versions"] == [{"version": "step-1", "start": 0, "end": 8, "version_id": 1}]
    assert label(server) == "step-1"
    assert httpx.get(f"{server}/model_info").json()["weight_version"] == "step-1"
    assert httpx.get(f"{server}/server_info").json()["weight_version"] == "step-1"
    assert httpx.get(f"{server}/weight_info").json() == {"weight_version": "step-1"}
    assert httpx.get(f"{server}/weight_checksums").json()["weight_version"] == "step-1"
    metrics = httpx.get(f"{server}/metrics").text
    assert 'hotswap_weight_version_info{weight_version="step-1"} 1' in metrics
    assert "hotswap_weight_version 1" in metrics


def test_a_vllm_session_label_reaches_the_spans_of_a_stream_that_straddled_it(server, ckpts, tokenizer):
    start = label(server)
    stream = Stream(server, tokenizer.encode(PROMPTS[3]), 400)
    assert post(server, "/pause", mode="keep").status_code == 200  # the update lands mid-stream, however fast
    assert post(server, "/init_weight_transfer_engine", init_info={"backend": "disk"}).status_code == 200
    assert post(server, "/start_weight_update").status_code == 200
    assert post(server, "/update_weights", update_info={"path": str(ckpts["A"])}).status_code == 200
    done = post(server, "/finish_weight_update", weight_version="run7/ckpt-00042")
    assert done.status_code == 200 and done.json()["weight_version"] == "run7/ckpt-00042"
    assert post(server, "/resume").status_code == 200
    last = stream.result()
    assert last["finish_reason"] == "length" and stream.tokens == 400
    spans = last["weight_versions"]
    assert [s["version"] for s in spans] == [start, "run7/ckpt-00042"] and spans[1]["end"] == 400
    assert spans[1]["version_id"] == spans[0]["version_id"] + 1
    ids = tokenizer.encode(PROMPTS[1])
    assert sglang_greedy(server, ids)["output_ids"] == hf_greedy(str(ckpts["A"]), tuple(ids), 8)[0]
    assert label(server) == "run7/ckpt-00042"


def test_a_rename_during_a_stream_does_not_end_it_unless_asked(server, tokenizer):
    checksums = httpx.get(f"{server}/weight_checksums").json()["checksums"]
    stream = Stream(server, tokenizer.encode(PROMPTS[0]), 900)
    r = post(server, "/update_weight_version", new_version="renamed")
    assert r.json() == {"success": True, "message": "Weight version updated.", "new_version": "renamed"}
    running = httpx.get(f"{server}/metrics").text
    assert "hotswap_requests_running 1" in running  # the rename landed while the stream generated
    last = stream.result()
    assert last["finish_reason"] == "length" and stream.tokens == 900
    assert [s["version"] for s in last["weight_versions"]] == ["renamed"]
    assert httpx.get(f"{server}/weight_checksums").json()["checksums"] == checksums
    # abort_all_requests: the stream ends now with its partial output
    stream = Stream(server, tokenizer.encode(PROMPTS[0]), 900)
    assert post(server, "/pause", mode="keep").status_code == 200
    r = post(server, "/update_weight_version", new_version="renamed-again", abort_all_requests=True)
    assert r.json()["new_version"] == "renamed-again"
    assert post(server, "/resume").status_code == 200
    last = stream.result()
    assert last["finish_reason"] == "abort" and 0 < stream.tokens < 900
    assert label(server) == "renamed-again"


@pytest.mark.parametrize("bad", BAD_LABELS, ids=["empty", "blank", "long", "bool", "float", "list", "negative"])
def test_a_bad_label_is_a_400_naming_the_field_before_anything_moves(server, ckpts, bad):
    before = httpx.get(f"{server}/weight_checksums").json()
    declared = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
    for path, body, field in (
        ("/update_weights_from_disk", {"model_path": str(ckpts["B"]), "weight_version": bad}, "weight_version"),
        ("/update_weights_from_distributed", {**declared, "weight_version": bad}, "weight_version"),
        ("/reload_weights", {"weights_path": str(ckpts["B"]), "weight_version": bad}, "weight_version"),
        ("/update_weight_version", {"new_version": bad}, "new_version"),
    ):
        r = post(server, path, **body)
        assert r.status_code == 400 and field in r.text, (path, r.text)
    assert post(server, "/init_weight_transfer_engine", init_info={"backend": "disk"}).status_code == 200
    assert post(server, "/start_weight_update").status_code == 200
    assert post(server, "/update_weights", update_info={"path": str(ckpts["B"])}).status_code == 200
    r = post(server, "/finish_weight_update", weight_version=bad)
    assert r.status_code == 400 and "weight_version" in r.text
    assert post(server, "/abort_weight_update").status_code == 200  # the refused finish kept its session
    assert httpx.get(f"{server}/weight_checksums").json() == before
