"""The kernel facade's policy: one decision per op and batch class, from a calibration cached beside the build;
one switch (HOTSWAP_NATIVE_KERNELS / use_mode) forces either path; both paths give the same outputs; and the
native ops equal their torch paths on every ISA build this machine can run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import PROMPTS
from hotswap import LLM, SamplingParams
from hotswap.kernels import emulation, measurements, native, ops, policy
from hotswap.kernels.policy import BATCHES, CALIBRATED, OPS, WIN_RATIO, Shapes, use_mode

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def built():
    if native.ops() is None:
        pytest.skip("native kernels unavailable (no C++ compiler)")


def test_the_table_decides_every_op_for_every_batch_class_in_every_mode(built):
    for mode in ("auto", "torch", "native"):
        with use_mode(mode) as resolved:
            table = resolved.table()
            assert [d.op for d in table] == list(OPS)
            for decision in table:
                assert set(decision.native) == set(BATCHES) and decision.reason
                if mode == "auto" and decision.op in CALIBRATED:
                    assert set(decision.ratios) == set(BATCHES) and all(r > 0 for r in decision.ratios.values())
                    assert all(decision.native[b] == (decision.ratios[b] < WIN_RATIO) for b in BATCHES)
            if mode != "auto":
                assert all(d.native[b] is (mode == "native") for d in table for b in BATCHES)
    with pytest.raises(ValueError, match="kernel mode"):
        with use_mode("fast"):
            pass


def test_decisions_follow_the_measured_ratios(built, monkeypatch):
    """Native only where it measured faster, per batch class; the decoder stack where it was timed faster than
    the modules (taken until timed)."""
    fake = {op: {4: 1.2, 16: 0.5, 64: 0.9} for op in CALIBRATED}
    fake["gated_linear"] = {4: 0.5, 16: 0.5, 64: 1.5}
    monkeypatch.setattr(policy, "_calibration", lambda kernels, shapes: fake)
    monkeypatch.setattr(policy, "_cached", lambda key, op: None)  # the stack not timed yet: taken
    resolved = policy._resolve("auto", Shapes())
    assert resolved.decisions["linear"].native == {4: False, 16: True, 64: True}
    assert resolved.decisions["decoder_stack"].native == {4: True, 16: True, 64: True}
    monkeypatch.setattr(policy, "_cached", lambda key, op: {4: 1.1, 16: 0.97, 64: 1.02})  # as timed on a model
    assert policy._resolve("auto", Shapes()).decisions["decoder_stack"].native == {4: False, 16: True, 64: False}
    assert resolved.uses("linear", 5) is False and resolved.uses("linear", 20) is True
    assert resolved.uses("gated_linear", 33) is False and resolved.uses("rms_norm", 500) is True
    assert all(resolved.decisions[op].native[b] for op in ("paged_attention", "write_kv_cache") for b in BATCHES)


def test_a_decode_step_moves_products_to_the_native_kernels_where_it_measured_them_faster(built, monkeypatch):
    """The stack's timing on the model tries every product native where the table put one on the BLAS; a product
    moves where that step was at least 5 % faster, for the modules too; the result is cached with the rest."""
    fake = {op: {4: 0.5, 16: 0.5, 64: 0.5} for op in CALIBRATED}
    fake["linear"] = {4: 1.3, 16: 0.6, 64: 0.97}
    fake["gated_linear"] = {4: 1.2, 16: 0.6, 64: 0.9}
    store: dict[str, dict[int, float]] = {}
    monkeypatch.setattr(policy, "_calibration", lambda kernels, shapes: fake)
    monkeypatch.setattr(policy, "_cached", lambda key, op: store.get(op))
    monkeypatch.setattr(policy, "_store", lambda key, op, ratios: store.__setitem__(op, ratios))
    monkeypatch.setattr(policy, "_policy", [policy._resolve("auto", Shapes())])
    monkeypatch.setattr(policy, "_forced", [])
    monkeypatch.setattr(policy, "_env_mode", ["auto"])
    asked = {}

    def measure(rows, variants):
        asked[rows] = list(variants)
        native_step = {4: 1.0, 16: 1.0, 64: 0.8}[rows]  # the table's step takes 1.0
        return [1.0, native_step][: len(variants)], 2.0

    resolved = policy.calibrate_stack(measure)
    assert asked[4] == [(False, False, True), (True, True, True)]
    assert asked[16] == [(True, True, True)]  # every product native already: nothing else to try
    assert asked[64] == [(False, True, True), (True, True, True)]
    assert resolved.decisions["linear"].native == {4: False, 16: True, 64: True}
    assert resolved.decisions["linear"].ratios[64] == 0.8 and "decode step" in resolved.decisions["linear"].reason
    assert resolved.decisions["gated_linear"].native == {4: False, 16: True, 64: True}
    assert resolved.decisions["gated_linear"].ratios == {4: 1.2, 16: 0.6, 64: 0.9}  # it was native at 64 already
    assert resolved.decisions["decoder_stack"].ratios == {4: 0.5, 16: 0.5, 64: 0.5}  # on the table's products
    assert policy.policy() is resolved and ops.policy().uses("linear", 64)
    assert store["stack_products"] == {4: 1.0, 16: 1.0, 64: 0.8}
    again = policy._resolve("auto", Shapes())  # a later process reads both from the cache
    assert again.decisions == resolved.decisions
    store.clear()  # a worker whose cache cannot hold a step: nothing timed, nothing moved or cached
    monkeypatch.setattr(policy, "_policy", [policy._resolve("auto", Shapes())])
    untimed = policy.calibrate_stack(lambda rows, variants: None)
    assert store == {} and untimed.decisions["linear"].native == {4: False, 16: True, 64: False}


def test_calibration_runs_on_the_models_shapes_once_and_is_cached_beside_the_build(built, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # a fresh cache (the library itself still loads)
    calls = []
    real = policy.calibrate
    monkeypatch.setattr(policy, "calibrate", lambda kernels, shapes: calls.append(shapes) or real(kernels, shapes))
    cfg = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 512,
        "num_hidden_layers": 2,
    }
    first = policy._resolve("auto", Shapes.of(cfg))
    cache = json.loads(measurements.cache_file().read_text())
    assert calls == [Shapes.of(cfg)] and Shapes.of(cfg).key() in cache
    second = policy._resolve("auto", Shapes.of(cfg))
    assert len(calls) == 1 and second.decisions == first.decisions


def test_one_switch_forces_each_path_with_the_same_outputs(built, llama_dir, monkeypatch):
    """`use_mode("torch")` runs no native op, `use_mode("native")` runs them; greedy tokens are the same. The
    environment variable is the same switch."""
    calls: list[str] = []
    real_ops = native.ops()

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real_ops, name)

    monkeypatch.setattr(ops, "_ops", lambda: Counting())
    tokens = {}
    for mode in ("torch", "native"):
        with use_mode(mode):
            calls.clear()
            llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22)
            tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)]
            if mode == "torch":
                assert calls == [] and llm.collective_rpc(lambda w: w.runner.attention_kernel) == [None]
            else:
                assert {"rms_norm", "paged_attention", "greedy_sample"} <= set(calls) or "decoder_layers" in calls
            llm.shutdown()
    assert tokens["torch"] == tokens["native"]
    for value, mode in (("0", "torch"), ("torch", "torch"), ("native", "native"), ("1", "auto"), ("auto", "auto")):
        monkeypatch.setenv("HOTSWAP_NATIVE_KERNELS", value)
        assert policy.mode() == mode


@pytest.mark.slow
def test_native_ops_equal_their_torch_paths_on_the_avx2_build(built):
    """The kernel tests (every op against its torch path, the decoder stack and the weight writes to the bit) on an
    AVX2-only build (`-march=x86-64-v3`, what AMD Zen 2/3 and older Intel servers run), in a fresh process with
    torch's own kernels (the torch paths) capped at AVX2 too, as on such a host. (`avx2-kernels`, the same build
    beside an uncapped torch, is the benchmarks' middle column; its build is the same one, checked by the probe.)"""
    if native.target_isa() == "generic":
        pytest.skip("this machine cannot run an x86-64-v3 build")
    probe = "from hotswap.kernels import native; print(native.target_isa(), native.ops().vector_bits())"
    for isa in ("avx2-kernels", "avx2"):
        env = {**os.environ, **emulation.ISA_ENV[isa]}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
        assert out.stdout.split() == ["avx2", "256"], (isa, out.stderr[-2000:])
    tests = [
        "tests/test_kernels.py",
        "tests/test_decoder_stack.py",
        "tests/test_weight_writes.py",
        "-k",
        "not stale_build and not failed_build",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:]


def test_the_avx2_emulation_caps_torchs_kernels_in_a_fresh_process():
    """`emulation.reexec_under("avx2")` restarts the process with hotswap's AVX2 build and ATen, MKL and oneDNN
    capped at AVX2 (read by torch only at load), and the calibration keys its cache by torch's ISA."""
    if native.target_isa() == "generic":
        pytest.skip("this machine has no AVX2")
    probe = (
        "import os, sys; from hotswap.kernels import emulation; emulation.reexec_under(sys.argv[1]); import torch; "
        "from hotswap.kernels import native, policy; "
        "print(native.target_isa(), torch.backends.cpu.get_cpu_capability(), policy.Shapes().key())"
    )
    keys = {}
    clean = {k: v for k, v in os.environ.items() if k not in emulation.ISA_ENV["avx2"]}
    for isa in ("avx2", "avx2-kernels"):
        out = subprocess.run([sys.executable, "-c", probe, isa], capture_output=True, text=True, timeout=120, env=clean)
        assert out.returncode == 0, out.stderr[-2000:]
        target, capability, keys[isa] = out.stdout.split()
        assert target == "avx2"
        if isa == "avx2":
            assert capability == "AVX2" and keys[isa].endswith("AVX2/AVX2/AVX2")
    assert keys["avx2"] != keys["avx2-kernels"]
    with pytest.raises(ValueError, match="isa must be one of"):
        emulation.reexec_under("avx1")


def test_the_calibration_times_the_models_dtype(built, monkeypatch, tmp_path):
    """bfloat16 models get their own calibration (the norms, SwiGLU gate and rotary timed in bfloat16)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cfg = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 512,
        "num_hidden_layers": 2,
    }
    import torch

    bf16, fp32 = Shapes.of(cfg, torch.bfloat16), Shapes.of(cfg)
    assert bf16.dtype == "bfloat16" and bf16.key() != fp32.key()
    resolved = policy._resolve("auto", bf16)
    assert all(set(resolved.decisions[op].ratios) == set(BATCHES) for op in CALIBRATED)
    assert bf16.key() in json.loads(measurements.cache_file().read_text())
