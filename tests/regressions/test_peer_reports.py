"""Peers' weight-sync bugs as scenarios run through hotswap's public API (docs/weight-sync.md has the table: the
report, the scenario, what hotswap does). Each update either commits bit-exact (the engine's weight checksums,
and its greedy tokens, equal those of a fresh engine loaded with the new weights) or is refused / rolled back with
every weight as before, and the engine keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotswap import LLM, SamplingParams
from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.testing import make_tiny_model
from hotswap.transfer.shm import ShmSender
from hotswap.transfer.tensors import tensors_update_info
from transfer_helpers import BACKENDS, Pusher

KV = 1 << 22
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["the quick brown fox", "hello world, said the", "1 2 3 4"]


def state(path: Path) -> dict[str, torch.Tensor]:
    return dict(load_file(str(path / "model.safetensors")))


def sums(llm) -> dict[str, str]:
    return llm.collective_rpc("weight_checksums")[0]


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_as_fresh(llm: LLM, path: Path, **kwargs) -> None:
    """`llm` holds exactly the weights of a fresh engine loaded from `path` (same config) and generates its
    tokens."""
    fresh = LLM(str(path), kv_cache_memory_bytes=KV, **kwargs)
    assert sums(llm) == sums(fresh)
    assert tokens(llm) == tokens(fresh)
    fresh.llm_engine.shutdown()


def folder_with(base: Path, tensors: dict[str, torch.Tensor], where: Path) -> Path:
    """A checkpoint folder: `base`'s config and tokenizer with `tensors` as its weights."""
    where.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (where / f.name).write_bytes(f.read_bytes())
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(where / "model.safetensors"))
    return where


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_reports")
    return {label: make_tiny_model(root / label, "qwen3_moe", seed=seed) for label, seed in (("A", 0), ("B", 1))}


# ---- MoE -----------------------------------------------------------------------------------------------------


def test_vllm_42821_a_second_load_of_moe_weights_is_exact(moe):
    """vllm#42821: `load_weights` silently corrupted the MoE forward on its second call (a layout swap done once
    at init). Here: A -> B -> A -> B by in-place reloads, each exactly the fresh engine of that checkpoint."""
    llm = LLM(str(moe["A"]), kv_cache_memory_bytes=KV)
    for label in ("B", "A", "B"):
        llm.reload_weights(weights_iterator=list(state(moe[label]).items()))
        assert_as_fresh(llm, moe[label])


def test_skyrl_1680_a_multi_chunk_moe_sync_keeps_the_layers_absent_from_each_chunk(moe):
    """SkyRL#1680: per-chunk finalization restored every layer absent from the chunk ("MoE gibberish"). Here:
    B sent in per-layer chunks, once as several update_weights of one session and once as one committed session
    per chunk; layers a chunk does not name keep what the earlier chunks wrote."""
    b = state(moe["B"])
    chunks: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in b.items():
        key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        chunks.setdefault(key, []).append((name, t))
    assert len(chunks) >= 3
    llm = LLM(str(moe["A"]), kv_cache_memory_bytes=KV)
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    for named in chunks.values():
        llm.update_weights(tensors_update_info(named))
    llm.finish_weight_update()
    assert_as_fresh(llm, moe["B"])
    llm.reload_weights(weights_iterator=list(state(moe["A"]).items()))
    for named in chunks.values():
        llm.start_weight_update()
        llm.update_weights(tensors_update_info(named))
        llm.finish_weight_update()
    assert_as_fresh(llm, moe["B"])


def test_rocm_atom_2028_every_routed_expert_is_synced(moe):
    """ROCm/ATOM#2028: the routed experts were never synced, and nothing said so. Here: after an update by
    per-expert names, every expert projection of every layer holds B's bytes; an update that leaves experts out
    of a full checkpoint reload is refused naming them."""
    b = state(moe["B"])
    experts = [n for n in b if ".experts." in n]
    llm = LLM(str(moe["A"]), kv_cache_memory_bytes=KV)
    llm.reload_weights(weights_iterator=list(b.items()))
    engine_sums = sums(llm)
    fresh = sums(LLM(str(moe["B"]), kv_cache_memory_bytes=KV))
    assert len(experts) == 2 * 8 * 3 and all(engine_sums[n] == fresh[n] for n in experts)
    partial = {n: t for n, t in b.items() if n not in experts[:3]}
    with pytest.raises(ValueError, match=r"missing tensors.*experts"):
        llm.reload_weights(weights_path=str(folder_with(moe["B"], partial, moe["B"].parent / "no_experts")))
    assert sums(llm) == engine_sums


def test_sglang_14178_buckets_smaller_than_one_tensor_are_exact(ckpts):
    """sglang#14178: garbled output after updating with small buckets. Here: torch_dist with a 4 KiB bucket, far
    below one tensor, and an in-session stream of one tensor per update."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    pusher = Pusher(llm, "torch_dist", bucket_size_bytes=4096)
    try:
        pusher.push(list(state(ckpts["B"]).items()))
    finally:
        pusher.close()
    assert_as_fresh(llm, ckpts["B"])


# ---- sleep and caches ----------------------------------------------------------------------------------------


def test_trl_5312_weights_pushed_around_sleep_mode_are_synchronized(ckpts):
    """trl#5312: with sleep mode on, the weights were not synchronized (logp diff 0.015 -> 0.201). Here: sleep 1,
    wake the weights, push B, wake the KV cache: the engine serves exactly B."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    tokens(llm)
    llm.sleep(level=1)
    llm.wake_up(["weights"])
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(list(state(ckpts["B"]).items())))
    llm.finish_weight_update()
    llm.wake_up(["kv_cache"])
    assert_as_fresh(llm, ckpts["B"])


def test_verl_7904_free_cache_engine_then_sync(ckpts):
    """verl#7904: garbled output after a weight sync with free_cache_engine=true. Here: sleep level 2 (weights
    released), the engine refuses to generate on what is left, a full push of B restores it exactly."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="weights"):
        tokens(llm)
    llm.reload_weights(weights_iterator=list(state(ckpts["B"]).items()))
    assert_as_fresh(llm, ckpts["B"])


@pytest.mark.parametrize("policy", ["reset", "salt"])
def test_nemo_rl_4018_no_kv_of_an_older_version_is_served(ckpts, policy):
    """NeMo-RL#4018: KV up to 17 steps old was served from the prefix cache. Here: a prompt cached under A, then
    B committed: the same prompt hits no block of A and gives B's tokens."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV, block_size=4, prefix_cache_policy=policy)
    tokens(llm)
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0  # A's blocks are cached
    llm.reload_weights(weights_iterator=list(state(ckpts["B"]).items()))
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert_as_fresh(llm, ckpts["B"], block_size=4, prefix_cache_policy=policy)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_vllm_46009_post_processing_never_rebinds_parameter_storage(ckpts, quantization):
    """vllm#46009: post-processing rebound `param.data`, breaking addresses captured earlier (CUDA graphs):
    rewards collapsed to 0. Here: every parameter keeps its storage through reloads, sessions and fp8
    re-quantization."""
    kwargs = {"quantization": quantization} if quantization else {}
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV, **kwargs)
    ptrs = llm.apply_model(lambda m: [p.data_ptr() for p in m.parameters()])[0]
    llm.reload_weights(weights_iterator=list(state(ckpts["B"]).items()))
    pusher = Pusher(llm, "shm")
    try:
        pusher.push(list(state(ckpts["A"]).items()))
    finally:
        pusher.close()
    assert llm.apply_model(lambda m: [p.data_ptr() for p in m.parameters()])[0] == ptrs
    assert_as_fresh(llm, ckpts["A"], **kwargs)


def test_vllm_57854_a_failed_update_restores_bit_for_bit(ckpts):
    """vllm#57854: restore was not a clean rollback. Here: a streamed update whose last tensor holds a NaN (the
    others already written), on a float32 and on an fp8 model (scales too): every byte as before."""
    for kwargs in ({}, {"quantization": "fp8"}):
        llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV, **kwargs)
        before, before_tokens = sums(llm), tokens(llm)
        named = list(state(ckpts["B"]).items())
        bad = named[-1][1].clone()
        bad.view(-1)[0] = float("nan")
        named[-1] = (named[-1][0], bad)
        pusher = Pusher(llm, "shm")
        try:
            with pytest.raises(ValueError, match="NaN"):
                pusher.push(named)
        finally:
            pusher.close()
        assert sums(llm) == before and tokens(llm) == before_tokens


# ---- serving through updates ---------------------------------------------------------------------------------


def test_miles_2372_a_version_bump_aborts_nothing(ckpts):
    """miles#2372: a version bump aborted every request in flight. Here: requests in flight through a 'keep'
    pause and an update finish with all their tokens, their spans naming both versions."""

    async def main():
        engine = AsyncLLMEngine.from_kwargs(str(ckpts["A"]), kv_cache_memory_bytes=KV)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

        async def run(prompt: str):
            last = None
            async for out in engine.generate(prompt, params):
                last = out
            return last

        tasks = [asyncio.create_task(run(p)) for p in PROMPTS]
        while sum(len(r.seqs[0].token_ids) - r.seqs[0].num_prompt_tokens for r in engine.engine.requests.values()) < 6:
            await asyncio.sleep(0.01)
        await engine.pause_generation("keep", clear_cache=False)
        await engine.reload_weights(weights_iterator=list(state(ckpts["B"]).items()), weight_version="v2")
        await engine.resume_generation()
        outs = [await t for t in tasks]
        await engine.shutdown()
        return outs

    for out in asyncio.run(main()):
        c = out.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 24
        assert [s.label for s in c.weight_versions][-1] == "v2"


@pytest.mark.parametrize("clear_cache", [False, True], ids=["keep", "retract"])
def test_updates_during_keep_and_retract_pauses(ckpts, clear_cache):
    """An update while requests are frozen with their KV ('keep', SGLang's in_place) or retracted to the queue
    without it ('retract'): the weights are exactly B's, and the requests go on on B."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, llm.get_tokenizer().encode(p), GREEDY)
    for _ in range(3):
        engine.step()
    llm.pause_generation("keep", clear_cache=clear_cache)
    llm.reload_weights(weights_iterator=list(state(ckpts["B"]).items()))
    llm.resume_generation()
    done = []
    while engine.requests:
        done += engine.step()
    assert len(done) == len(PROMPTS) and all(o.outputs[0].finish_reason == "length" for o in done)
    assert sums(llm) == sums(LLM(str(ckpts["B"]), kv_cache_memory_bytes=KV))


# ---- model shapes and layouts ----------------------------------------------------------------------------------


def test_tied_heads_follow_the_embedding(tmp_path):
    """A tied lm_head is the embedding: updating `model.embed_tokens.weight` changes the head with it (never a
    stale copy), and a separate `lm_head.weight` in the same update is refused as a duplicate."""
    a = make_tiny_model(tmp_path / "A", tie_word_embeddings=True, seed=0)
    b = make_tiny_model(tmp_path / "B", tie_word_embeddings=True, seed=1)
    llm = LLM(str(a), kv_cache_memory_bytes=KV)
    llm.reload_weights(weights_iterator=list(state(b).items()))
    assert_as_fresh(llm, b)
    embed = state(a)["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="duplicate tensors for the same"):
        llm.reload_weights(weights_iterator=[("model.embed_tokens.weight", embed), ("lm_head.weight", embed)])
    assert_as_fresh(llm, b)


@pytest.mark.parametrize("block", [None, [16, 16]], ids=["per-row", "block-scales"])
def test_fp8_updates_equal_a_fresh_fp8_engine(ckpts, block):
    """fp8 re-quantization after an update, with per-row scales and with block scales (DeepSeek / Qwen FP8
    layout): the bytes and scales equal a fresh fp8 engine loaded with B."""
    kwargs = {"quantization": "fp8", **({"weight_block_size": block} if block else {})}
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV, **kwargs)
    llm.reload_weights(weights_iterator=list(state(ckpts["B"]).items()))
    assert_as_fresh(llm, ckpts["B"], **kwargs)


@pytest.mark.slow
def test_tensor_parallel_chunking_is_exact(ckpts):
    """TP=2: each rank takes its slices of every tensor (and of fused qkv / gate_up); both ranks hold exactly
    what a fresh TP=2 engine loaded with B holds."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV, tensor_parallel_size=2)
    pusher = Pusher(llm, "torch_dist", bucket_size_bytes=1 << 14)
    try:
        pusher.push(list(state(ckpts["B"]).items()))
    finally:
        pusher.close()
    fresh = LLM(str(ckpts["B"]), kv_cache_memory_bytes=KV, tensor_parallel_size=2)
    assert llm.collective_rpc("weight_checksums") == fresh.collective_rpc("weight_checksums")
    assert tokens(llm) == tokens(fresh)
    llm.llm_engine.shutdown()
    fresh.llm_engine.shutdown()


# ---- drafts --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("report_drafts")
    small = {
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
    }
    return {label: make_tiny_model(root / label, seed=seed, **small) for label, seed in (("A", 21), ("B", 22))}


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_27718_miles_1926_draft_and_target_sync_together_over_every_transport(ckpts, drafts, backend):
    """sglang#27718 / miles#1926: the speculative draft was left stale after a sync. Here: one session with
    target 'all' carries B and the draft's B ("draft."-prefixed) over each transport: both equal fresh loads, the
    draft is current, and outputs are the target's own."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3}
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV, speculative_config={**spec, "model": str(drafts["A"])})
    named = list(state(ckpts["B"]).items()) + [(f"draft.{n}", t) for n, t in state(drafts["B"]).items()]
    pusher = Pusher(llm, backend)
    try:
        llm.start_weight_update(target="all")
        pusher.update(named)
        llm.finish_weight_update()
    finally:
        pusher.close()
    engine = llm.llm_engine
    assert not engine.draft_stale and engine.draft_weight_version == engine.weight_version == 1
    fresh = LLM(str(ckpts["B"]), kv_cache_memory_bytes=KV, speculative_config={**spec, "model": str(drafts["B"])})
    assert llm.collective_rpc("weight_checksums", ("all",))[0] == fresh.collective_rpc("weight_checksums", ("all",))[0]
    assert tokens(llm) == tokens(fresh)
    llm.reload_weights(weights_iterator=list(state(ckpts["A"]).items()))  # the target alone: the draft is stale
    assert engine.draft_stale
    assert tokens(llm) == tokens(LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_reload_from_a_folder_and_from_tensors(ckpts, level):
    """After sleep level 1 or 2: a reload from a folder, then one from tensors, each exact."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    llm.sleep(level=level)
    llm.wake_up()
    llm.reload_weights(weights_path=str(ckpts["B"]))
    assert_as_fresh(llm, ckpts["B"])
    llm.sleep(level=level)
    llm.wake_up()
    llm.reload_weights(weights_iterator=list(state(ckpts["A"]).items()))
    assert_as_fresh(llm, ckpts["A"])


def test_a_shm_segment_reused_by_the_trainer_is_read_as_published(ckpts):
    """A trainer that reuses its shared segment for the next push while the engine may still read the previous
    one (torn reads): each push is verified against its own publication, and both commit exactly."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    llm.init_weight_transfer_engine({"backend": "shm"})
    sender = ShmSender()
    try:
        for label in ("B", "A", "B"):
            info = sender.write(list(state(ckpts[label]).items()))
            llm.start_weight_update()
            llm.update_weights(info)
            llm.finish_weight_update()
            assert sums(llm) == sums(LLM(str(ckpts[label]), kv_cache_memory_bytes=KV))
    finally:
        llm.shutdown_weight_transfer_engine()
        sender.close()
