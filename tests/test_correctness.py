"""Greedy tokens and logprobs against Hugging Face transformers, for every supported architecture."""

from __future__ import annotations

import pytest

from conftest import ARCHS, PROMPTS, hf_greedy
from hotswap import LLM, SamplingParams

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def assert_matches_transformers(path: str, llm: LLM, prompts: list[str]) -> None:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = tuple(tokenizer.encode(prompt))
        assert out.prompt_token_ids == list(ids)
        ref_tokens, ref_logprobs = hf_greedy(path, ids, MAX_TOKENS)
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"greedy tokens differ for {prompt!r}"
        assert completion.finish_reason == "length"
        assert len(completion.logprobs) == MAX_TOKENS
        total = 0.0
        for step, token in enumerate(completion.token_ids):
            entry = completion.logprobs[step]
            expected = ref_logprobs[step][token].item()
            assert abs(entry[token].logprob - expected) < 1e-4
            assert entry[token].rank == 1  # greedy picks the most likely token
            total += entry[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-5)


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_matches_transformers(model_dirs, name):
    path = str(model_dirs[name])
    llm = LLM(path, kv_cache_memory_bytes=1 << 24)
    assert_matches_transformers(path, llm, PROMPTS)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"enable_prefix_caching": False},
        {"max_num_seqs": 2},
        {"block_size": 4, "max_num_batched_tokens": 128, "max_model_len": 128, "max_num_seqs": 64},
        {"enable_chunked_prefill": False},
    ],
    ids=["no-prefix-cache", "max-num-seqs-2", "block-size-4", "unchunked"],
)
def test_same_outputs_under_other_engine_settings(llama_dir, engine_kwargs):
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 24, **engine_kwargs)
    assert_matches_transformers(str(llama_dir), llm, PROMPTS)


def test_preemption_keeps_outputs_exact(llama_dir):
    # 12 blocks of 8 tokens cannot hold 8 sequences of up to ~50 tokens: the scheduler must preempt.
    per_block = 2 * 2 * 8 * 2 * 16 * 4  # K and V, layers, block, kv heads, head dim, fp32
    llm = LLM(str(llama_dir), block_size=8, max_model_len=96, kv_cache_memory_bytes=12 * per_block)
    assert llm.config.cache_config.num_kv_blocks == 12
    assert_matches_transformers(str(llama_dir), llm, PROMPTS)
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    assert llm.llm_engine.stats()["num_free_blocks"] == 12


def test_prefix_cache_hits_and_outputs_unchanged(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 24, block_size=4)
    prefix = PROMPTS[7]
    prompts = [prefix + " yes", prefix + " no"]
    llm.generate(prompts[0], GREEDY, use_tqdm=False)
    before = llm.llm_engine.stats()["prefix_hit_tokens"]
    out = llm.generate(prompts[1], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 12
    assert llm.llm_engine.stats()["prefix_hit_tokens"] - before == out.num_cached_tokens
    assert_matches_transformers(str(llama_dir), llm, prompts)


def test_bf16_and_fp16_generate(llama_dir):
    for dtype in ("bfloat16", "float16"):
        llm = LLM(str(llama_dir), dtype=dtype, kv_cache_memory_bytes=1 << 22)
        out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
        assert llm.apply_model(lambda m: m.model.embed_tokens.weight.dtype)[0] == getattr(__import__("torch"), dtype)
