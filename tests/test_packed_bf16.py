"""bf16 products on oneDNN-packed weights (`hotswap/kernels/packed.py`): the packed copies follow every change of
the weights they were made from (updates, rollbacks, user code, sleep and reload), so an engine always computes
with the weights it holds: its outputs equal a fresh engine's on the same weights, bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import PROMPTS
from hotswap import LLM, SamplingParams
from hotswap.kernels import packed
from transfer_helpers import Pusher

pytestmark = pytest.mark.skipif(not packed.supported(), reason="torch has no oneDNN bf16 support on this CPU")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
SCORING = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)


@pytest.fixture
def always_packed(monkeypatch):
    """Takes the packed path for every shape (the engine runs in this process), whatever the timing says."""
    monkeypatch.setattr(packed, "faster", lambda out_features, in_features: True)


def outputs(llm: LLM) -> list[tuple[list[int], list[float]]]:
    results = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
        for o in results
    ]


def scores(llm: LLM, runs: list[tuple[list[int], list[float]]]) -> list[list[float]]:
    """The engine's logprobs of each run's tokens after its prompt (prompt logprobs, teacher-forced)."""
    tok = llm.get_tokenizer()
    out = []
    for prompt, (tokens, _) in zip(PROMPTS[:4], runs, strict=True):
        ids = tok.encode(prompt)
        scored = llm.generate([{"prompt_token_ids": ids + tokens}], SCORING, use_tqdm=False)[0].prompt_logprobs
        out.append([scored[len(ids) + j][t].logprob for j, t in enumerate(tokens)])
    return out


def packed_modules(llm: LLM) -> int:
    return llm.apply_model(lambda m: sum(packed._ATTR in mod.__dict__ for mod in m.modules()))[0]


def test_packed_copies_follow_every_change_of_the_weights(ckpts, b_tensors, always_packed, monkeypatch):
    fresh_b = LLM(str(ckpts["B"]), dtype="bfloat16", kv_cache_memory_bytes=1 << 22)
    expected_b = outputs(fresh_b)
    del fresh_b
    llm = LLM(str(ckpts["A"]), dtype="bfloat16", kv_cache_memory_bytes=1 << 22)
    expected_a = outputs(llm)
    assert packed_modules(llm) > 0
    assert expected_a != expected_b
    llm.reload_weights(weights_iterator=b_tensors)  # an update: every layer written, its copy dropped
    assert outputs(llm) == expected_b
    # a session that wrote A's tensors, then aborted: rolled back to B
    pusher = Pusher(llm, "tensors")
    llm.start_weight_update()
    pusher.update(list(load_file(str(ckpts["A"] / "model.safetensors")).items()))
    llm.abort_weight_update()
    pusher.close()
    assert outputs(llm) == expected_b
    # user code that writes a weight: the packed copies go with it
    llm.apply_model(lambda m: m.model.layers[0].mlp.down_proj.weight.data.mul_(-1))
    changed = outputs(llm)
    monkeypatch.setattr(packed, "faster", lambda out_features, in_features: False)  # the plain product
    plain = outputs(llm)
    on_plain = scores(llm, plain)
    monkeypatch.setattr(packed, "faster", lambda out_features, in_features: True)
    on_packed = scores(llm, plain)  # the same tokens, teacher-forced, through the (refreshed) packed copies
    assert changed != expected_b
    # within bf16 rounding (the packed and plain products may take different oneDNN kernels: AMX or not), while a
    # stale packed copy of the written weight would move them by far more
    assert max(abs(a - b) for x, y in zip(on_plain, on_packed, strict=True) for a, b in zip(x, y, strict=True)) < 0.2
    # sleep level 2 returns the weights' memory (and the copies'); a reload from the folder brings A back
    llm.sleep(2)
    assert packed_modules(llm) == 0
    llm.wake_up()
    llm.reload_weights(weights_path=str(ckpts["A"]))
    assert outputs(llm) == expected_a
    assert torch.bfloat16 == llm.apply_model(lambda m: m.model.embed_tokens.weight.dtype)[0]


def test_the_bf16_gate_is_measured_on_streamed_weights_and_cached(monkeypatch, tmp_path):
    """`faster` times the packed product against `F.linear` over more weight than a cache holds, once per machine:
    the ratios land beside the build, and cached ratios decide (a CPU where the plain product wins keeps it)."""
    import json

    from hotswap.kernels import measurements, policy

    monkeypatch.setattr(measurements, "cache_file", lambda: tmp_path / "calibration.json")
    monkeypatch.setattr(packed, "STREAM_BYTES", 1 << 20)  # the rule, not the size, under test: keep it quick
    calls = []
    real = packed.linear
    monkeypatch.setattr(packed, "linear", lambda *a: calls.append(1) or real(*a))
    packed.faster.cache_clear()
    try:
        first = packed.faster(48, 64)
        assert len(calls) >= 2 * 6 * (1 << 20) // (48 * 64 * 2)  # every pass went over all the copies
        key = f"48x64{policy.threads_and_isa()}"
        stored = json.loads((tmp_path / "calibration.json").read_text())[key]["packed_bf16_linear"]
        assert set(stored) == {"1", str(packed.PACK_ROWS)}
        assert first == all(r < measurements.WIN_RATIO for r in stored.values())
        losing = {"1": 0.5, str(packed.PACK_ROWS): 1.2}  # must win at both batch sizes
        (tmp_path / "calibration.json").write_text(json.dumps({key: {"packed_bf16_linear": losing}}))
        packed.faster.cache_clear()
        calls.clear()
        assert packed.faster(48, 64) is False and calls == []
    finally:
        packed.faster.cache_clear()
