"""fp32 products through oneDNN where it beats torch's BLAS (`hotswap/kernels/packed.py`, `dense_linear`): the
same values as `F.linear` up to fp32 rounding, taken exactly where the per-shape measurement says it wins (and
not where it loses), the measurement cached with the calibration, and an engine on either path generating
transformers' tokens."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import PROMPTS, hf_greedy
from hotswap import LLM, SamplingParams
from hotswap.kernels import measurements, ops, packed, policy

pytestmark = pytest.mark.skipif(not packed.dense_supported(), reason="torch has no oneDNN linear here")


def test_dense_linear_equals_f_linear_and_is_taken_only_where_it_wins(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    for rows in (1, 3, 100, 300):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(
            packed.dense_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5
        )
    calls: list[str] = []
    real = packed.dense_linear
    monkeypatch.setattr(packed, "dense_linear", lambda *a: calls.append("dnn") or real(*a))
    x = torch.randn(100, 64, generator=gen)  # above the native kernels' rows: what a BLAS would run
    for wins in (True, False):
        monkeypatch.setattr(packed, "dense_faster", lambda out_features, in_features, wins=wins: wins)
        calls.clear()
        with torch.no_grad():
            torch.testing.assert_close(ops.linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        assert calls == (["dnn"] if wins else [])
    w = weight.clone().requires_grad_(True)
    calls.clear()
    ops.linear(x, w, bias).sum().backward()  # autograd keeps torch's own product
    assert calls == [] and w.grad is not None


def test_the_measurement_is_cached_beside_the_build_and_decides(monkeypatch, tmp_path):
    monkeypatch.setattr(measurements, "cache_file", lambda: tmp_path / "calibration.json")
    packed.dense_faster.cache_clear()
    try:
        first = packed.dense_faster(48, 32)
        key = f"48x32{policy.threads_and_isa()}"
        stored = json.loads((tmp_path / "calibration.json").read_text())[key]["dense_fp32_linear"]
        assert set(stored) == {str(r) for r in packed.DENSE_ROWS}
        assert first == all(r < measurements.WIN_RATIO for r in stored.values())
        losing = {str(r): 1.2 for r in packed.DENSE_ROWS}  # a CPU where the BLAS wins: the cached ratios say so
        (tmp_path / "calibration.json").write_text(json.dumps({key: {"dense_fp32_linear": losing}}))
        packed.dense_faster.cache_clear()
        assert packed.dense_faster(48, 32) is False
    finally:
        packed.dense_faster.cache_clear()


@pytest.mark.parametrize("wins", [True, False])
def test_an_engine_on_either_path_generates_transformers_tokens(llama_dir, monkeypatch, wins):
    """One prompt at a time: its decode steps have one row, below the native kernels' range, so its products go
    to oneDNN or the BLAS as the measurement says."""
    monkeypatch.setattr(packed, "dense_faster", lambda out_features, in_features: wins)
    calls: list[int] = []
    real = packed.dense_linear
    monkeypatch.setattr(packed, "dense_linear", lambda *a: calls.append(1) or real(*a))
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tok = llm.get_tokenizer()
    for prompt in PROMPTS[:3]:
        out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(tok.encode(prompt)), 8)[0]
    assert bool(calls) == wins


def test_bf16_products_without_bf16_hardware_run_in_float32_where_that_measured_faster(monkeypatch, tmp_path):
    """Where torch has no oneDNN bf16 (an AVX2-only CPU), a bf16 product above the small-batch rows is timed once
    in float32 against torch's bf16 `F.linear`, the ratio cached; it runs in float32 exactly where that won, and
    equals `F.linear` up to the sums' order."""
    from hotswap.kernels import ops as facade

    monkeypatch.setattr(measurements, "cache_file", lambda: tmp_path / "calibration.json")
    monkeypatch.setattr(packed, "supported", lambda: False)
    gate = packed.upcast_faster
    gate.cache_clear()
    try:
        first = gate(24, 32)
        key = f"24x32{policy.threads_and_isa()}"
        stored = json.loads((tmp_path / "calibration.json").read_text())[key]["upcast_bf16_linear"]
        assert first == (stored[str(packed.UPCAST_ROWS)] < measurements.WIN_RATIO)
        calls = []
        real = packed.upcast_linear
        monkeypatch.setattr(packed, "upcast_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
        w, b = torch.randn(24, 32).bfloat16(), torch.randn(24).bfloat16()
        for wins in (True, False):
            monkeypatch.setattr(packed, "upcast_faster", lambda out_features, in_features, wins=wins: wins)
            for rows in (facade.SMALL_BATCH_ROWS + 1, 300, facade.SMALL_BATCH_ROWS):
                calls.clear()
                x = torch.randn(rows, 32).bfloat16()
                out = facade.linear(x, w, b)
                torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), atol=0.05, rtol=0.02)
                assert calls == ([rows] if wins and rows > facade.SMALL_BATCH_ROWS else [])
    finally:
        gate.cache_clear()
