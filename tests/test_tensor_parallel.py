"""Tensor parallelism across worker processes: outputs, every weight path, failures, no orphans."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from conftest import PROMPTS, hf_greedy, hf_model
from hotswap import LLM, SamplingParams
from hotswap.testing import make_tiny_model
from transfer_helpers import BACKENDS, Pusher

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
pytestmark = pytest.mark.slow


def outputs(llm: LLM, prompts=PROMPTS[:6]):
    return llm.generate(prompts, GREEDY, use_tqdm=False)


def assert_matches(path, llm: LLM, prompts=PROMPTS[:6]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    got = [o.outputs[0].token_ids for o in outputs(llm, prompts)]
    assert got == [hf_greedy(str(path), tuple(tok.encode(p)), 16)[0] for p in prompts]
    return got


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.executor.processes]


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {"num_key_value_heads": 1}),  # one KV head, replicated on both ranks
        ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}),  # 3 KV heads: uneven
        ("llama", {"hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3}),  # 5 + 4 heads
        ("qwen2", {}),  # 2 KV heads split, q/k/v bias
        ("qwen3", {"tie_word_embeddings": True}),  # q/k norm, tied vocab-parallel head
    ],
    ids=["llama-kv1", "llama-kv3", "llama-9-heads", "qwen2", "qwen3-tied"],
)
def test_tp2_matches_tp1_and_transformers(tmp_path, arch, overrides):
    path = make_tiny_model(tmp_path / arch, arch=arch, **overrides)
    tp1 = LLM(str(path), kv_cache_memory_bytes=1 << 22)
    expected = assert_matches(path, tp1)
    tp2 = LLM(str(path), kv_cache_memory_bytes=1 << 22, tensor_parallel_size=2)
    assert assert_matches(path, tp2) == expected
    lp1 = [o.outputs[0].logprobs for o in outputs(tp1)]
    lp2 = [o.outputs[0].logprobs for o in outputs(tp2)]
    for a, b in zip(lp1, lp2, strict=True):
        for ea, eb in zip(a, b, strict=True):
            assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea)
    tp2.shutdown()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    kw = {"num_key_value_heads": 1}
    return {"A": make_tiny_model(root / "A", seed=0, **kw), "B": make_tiny_model(root / "B", seed=1, **kw)}


@pytest.fixture(scope="module")
def tp2(ckpts):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, tensor_parallel_size=2, rpc_timeout_s=60)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_updates_through_every_transport_at_tp2(tp2, ckpts, backend):
    b = list(load_file(str(ckpts["B"] / "model.safetensors")).items())
    a = list(load_file(str(ckpts["A"] / "model.safetensors")).items())
    pusher = Pusher(tp2, backend)
    pusher.push(b)
    assert_matches(ckpts["B"], tp2)
    pusher.push(a)
    assert_matches(ckpts["A"], tp2)
    pusher.close()


def test_reload_and_bad_update_at_tp2(tp2, ckpts):
    tp2.reload_weights(weights_path=str(ckpts["B"]))
    assert_matches(ckpts["B"], tp2)
    with pytest.raises(ValueError, match="expected shape"):
        tp2.reload_weights(
            weights_iterator=[
                ("model.norm.weight", load_file(str(ckpts["A"] / "model.safetensors"))["model.norm.weight"][:5])
            ]
        )
    assert_matches(ckpts["B"], tp2)
    tp2.reload_weights(weights_path=str(ckpts["A"]))
    assert_matches(ckpts["A"], tp2)


def test_generator_iterator_at_tp2(tp2, ckpts):
    """The README's headline call, a trainer's `named_parameters()` generator, works with worker processes."""
    trainer = hf_model(str(ckpts["B"]))
    tp2.reload_weights(weights_iterator=trainer.named_parameters())
    assert_matches(ckpts["B"], tp2)
    a = load_file(str(ckpts["A"] / "model.safetensors"))
    tp2.reload_weights(weights_iterator=((name, tensor) for name, tensor in a.items()))
    assert_matches(ckpts["A"], tp2)


def worker_settings(llm: LLM) -> list[tuple[str, bool, bool]]:
    return llm.collective_rpc(
        lambda w: (
            w.config.model_config.model,
            w.config.weight_transfer_config.atomic,
            w.config.weight_transfer_config.check_finite,
        )
    )


def engine_settings(llm: LLM) -> tuple[str, bool, bool]:
    wt = llm.config.weight_transfer_config
    return (llm.config.model_config.model, wt.atomic, wt.check_finite)


def test_engine_config_equals_the_workers_at_tp2(tp2, ckpts, tmp_path):
    """Live config changes and folder reloads reach the engine's config only after every worker took them."""
    assert worker_settings(tp2) == [engine_settings(tp2)] * 2
    tp2.reload_weights(weights_path=str(ckpts["B"]))
    tp2.update_config({"weight_transfer_config": {"atomic": False}})
    assert engine_settings(tp2) == (str(ckpts["B"]), False, True)
    assert worker_settings(tp2) == [engine_settings(tp2)] * 2
    other = make_tiny_model(tmp_path / "other", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    for bad in (
        {"weight_transfer_config": {"atomic": True, "bucket_size_bytes": -1}},  # invalid value: nothing applied
        {"cache_config": {"block_size": 8}},  # not a live field
        {"model_config": {"model": str(other)}},  # another model's shape
    ):
        with pytest.raises(ValueError):
            tp2.update_config(bad)
        assert engine_settings(tp2) == (str(ckpts["B"]), False, True)
        assert worker_settings(tp2) == [engine_settings(tp2)] * 2
    with pytest.raises(ValueError, match="different model shape"):
        tp2.reload_weights(weights_path=str(other))
    assert worker_settings(tp2) == [engine_settings(tp2)] * 2
    tp2.update_config({"model_config": {"model": str(ckpts["A"])}, "weight_transfer_config": {"atomic": True}})
    tp2.reload_weights()
    assert engine_settings(tp2) == (str(ckpts["A"]), True, True)
    assert worker_settings(tp2) == [engine_settings(tp2)] * 2
    assert_matches(ckpts["A"], tp2)


def test_killed_worker_gives_a_clear_error_quickly(ckpts):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, tensor_parallel_size=2, rpc_timeout_s=30)
    pids = worker_pids(llm)
    os.kill(pids[1], 9)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="died"):
        outputs(llm)
    assert time.monotonic() - start < 15
    with pytest.raises(RuntimeError, match="unusable"):
        outputs(llm)
    assert not any(alive(p) for p in pids)


def test_no_orphans_after_del_or_parent_exit(ckpts):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, tensor_parallel_size=2)
    pids = worker_pids(llm)
    assert all(alive(p) for p in pids)
    del llm
    import gc

    gc.collect()
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)

    script = (
        "import os, sys\n"
        "from hotswap import LLM\n"
        f"llm = LLM({str(ckpts['A'])!r}, kv_cache_memory_bytes=1 << 22, tensor_parallel_size=2)\n"
        "print(' '.join(str(p.pid) for p in llm.llm_engine.executor.processes), flush=True)\n"
        "os.kill(os.getpid(), 9)\n"  # the parent dies without any cleanup
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    child_pids = [int(p) for p in out.stdout.split()]
    assert len(child_pids) == 2
    deadline = time.monotonic() + 15
    while any(alive(p) for p in child_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in child_pids)


@pytest.mark.parametrize("backend", ["tensors", "shm"])
def test_pre_sliced_tensors_from_the_trainer(tp2, ckpts, backend):
    """A trainer that already holds sharded weights sends each rank only its part (tp_ranks names the rank)."""
    from hotswap.transfer.shm import ShmSender
    from hotswap.transfer.tensors import tensors_update_info

    plans = tp2.collective_rpc("shard_plan")
    assert plans[0] != plans[1]
    pairs, ranks = [], []
    for name, tensor in load_file(str(ckpts["B"] / "model.safetensors")).items():
        for rank, plan in enumerate(plans):
            if not plan[name]:
                if rank == 0:
                    pairs.append((name, tensor))
                    ranks.append(None)  # held whole by every rank: sent once
                continue
            part = tensor
            for dim, start, length in plan[name]:
                part = part.narrow(dim, start, length)
            pairs.append((name, part.contiguous()))
            ranks.append(rank)
    sender = ShmSender() if backend == "shm" else None
    info = sender.write(pairs) if sender else tensors_update_info(pairs)
    tp2.init_weight_transfer_engine({"backend": backend})
    tp2.start_weight_update()
    tp2.update_weights({**info, "tp_ranks": ranks})
    tp2.finish_weight_update()
    assert_matches(ckpts["B"], tp2)
    tp2.start_weight_update()
    a = load_file(str(ckpts["A"] / "model.safetensors"))
    good_for_rank1 = [(n, t) for (n, t), r in zip(pairs, ranks, strict=True) if r == 1]
    whole = [("model.layers.0.mlp.down_proj.weight", a["model.layers.0.mlp.down_proj.weight"])]
    bad_pairs = good_for_rank1 + whole  # rank 1 would load its part; rank 0 gets a whole tensor marked as its slice
    bad = tensors_update_info(bad_pairs) if backend == "tensors" else sender.write(bad_pairs)
    with pytest.raises(ValueError, match="pre-sliced"):
        tp2.update_weights({**bad, "tp_ranks": [1] * len(good_for_rank1) + [0]})
    assert_matches(ckpts["B"], tp2)  # both ranks rolled back, nothing half-applied
    tp2.start_weight_update()  # and every rank is ready for a new session
    tp2.abort_weight_update()
    tp2.reload_weights(weights_path=str(ckpts["A"]))
    assert_matches(ckpts["A"], tp2)
    tp2.shutdown_weight_transfer_engine()
    if sender:
        sender.close()
