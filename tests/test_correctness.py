"""Greedy tokens and logprobs against Hugging Face transformers, for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, PROMPTS, hf_greedy
from hotswap import LLM, SamplingParams

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def assert_matches_transformers(path: str, llm: LLM, prompts: list[str], device: str = "cpu") -> None:
    """Greedy tokens equal to transformers' on the same device, float32 logprobs within 1e-4."""
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = tuple(tokenizer.encode(prompt))
        assert out.prompt_token_ids == list(ids)
        ref_tokens, ref_logprobs = hf_greedy(path, ids, MAX_TOKENS, torch.float32, device)
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
def test_greedy_matches_transformers(model_dirs, name, device):
    path = str(model_dirs[name])
    llm = LLM(path, kv_cache_memory_bytes=1 << 24, device=device)
    assert_matches_transformers(path, llm, PROMPTS, device)


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
def test_same_outputs_under_other_engine_settings(llama_dir, engine_kwargs, device):
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 24, device=device, **engine_kwargs)
    assert_matches_transformers(str(llama_dir), llm, PROMPTS, device)


def test_preemption_keeps_outputs_exact(llama_dir, device):
    # 12 blocks of 8 tokens cannot hold 8 sequences of up to ~50 tokens: the scheduler must preempt.
    per_block = 2 * 2 * 8 * 2 * 16 * 4  # K and V, layers, block, kv heads, head dim, fp32
    llm = LLM(str(llama_dir), block_size=8, max_model_len=96, kv_cache_memory_bytes=12 * per_block, device=device)
    assert llm.config.cache_config.num_kv_blocks == 12
    assert_matches_transformers(str(llama_dir), llm, PROMPTS, device)
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    assert llm.llm_engine.stats()["num_free_blocks"] == 12


def test_prefix_cache_hits_and_outputs_unchanged(llama_dir, device):
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 24, block_size=4, device=device)
    prefix = PROMPTS[7]
    prompts = [prefix + " yes", prefix + " no"]
    llm.generate(prompts[0], GREEDY, use_tqdm=False)
    before = llm.llm_engine.stats()["prefix_hit_tokens"]
    out = llm.generate(prompts[1], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 12
    assert llm.llm_engine.stats()["prefix_hit_tokens"] - before == out.num_cached_tokens
    assert_matches_transformers(str(llama_dir), llm, prompts, device)


def assert_near_transformers(path: str, llm: LLM, ref_dtype: torch.dtype, tolerance: float) -> None:
    """Transformers' greedy continuation in `ref_dtype`, scored by the engine (prompt logprobs, teacher-forced):
    within `tolerance` of transformers' logprobs at every step of every prompt. And the engine's own greedy tokens
    equal transformers' up to the first step where transformers' two best logprobs are within 2 x `tolerance`
    (bf16 logits often tie, 0.125 apart near 16: past such a step either token is the argmax). Scoring the same
    tokens keeps the comparison from depending on where a CPU's bf16 rounding breaks a near-tie."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, greedy, use_tqdm=False), strict=True):
        ids = tokenizer.encode(prompt)
        ref_tokens, ref_logprobs = hf_greedy(path, tuple(ids), 16, ref_dtype)
        scored = llm.generate([{"prompt_token_ids": ids + ref_tokens}], scoring, use_tqdm=False)[0].prompt_logprobs
        for step, token in enumerate(ref_tokens):
            diff = abs(scored[len(ids) + step][token].logprob - ref_logprobs[step][token].item())
            assert diff < tolerance, f"step {step} of {prompt!r}: {diff:.3f}"
        for step, (token, ref) in enumerate(zip(out.outputs[0].token_ids, ref_tokens, strict=True)):
            best = ref_logprobs[step].topk(2).values
            if best[0] - best[1] < 2 * tolerance:
                break  # a near-tie: the continuation may rightly differ from here
            assert token == ref, f"step {step} of {prompt!r}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_bf16_matches_transformers_in_bf16(model_dirs, arch, kv_cache_dtype):
    """The bf16 path (products on oneDNN-packed weights where they win) with the KV cache in float32 ("auto") or
    bf16, against transformers running the same weights in bf16."""
    path = str(model_dirs[arch])
    llm = LLM(path, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=1 << 24)
    expected = torch.float32 if kv_cache_dtype == "auto" else torch.bfloat16
    assert llm.apply_model(lambda m: m.model.layers[0].self_attn.attn.k_cache.dtype) == [expected]
    assert_near_transformers(path, llm, torch.bfloat16, tolerance=0.2)


def test_a_bf16_kv_cache_under_float32_weights(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_dtype="bfloat16", kv_cache_memory_bytes=1 << 24)
    assert llm.apply_model(lambda m: m.model.layers[0].self_attn.attn.k_cache.dtype) == [torch.bfloat16]
    assert_near_transformers(str(llama_dir), llm, torch.float32, tolerance=0.1)  # K and V keep 8 mantissa bits
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        LLM(str(llama_dir), kv_cache_dtype="fp8")


def test_bf16_and_fp16_generate(llama_dir):
    for dtype in ("bfloat16", "float16"):
        llm = LLM(str(llama_dir), dtype=dtype, kv_cache_memory_bytes=1 << 22)
        out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
        assert llm.apply_model(lambda m: m.model.embed_tokens.weight.dtype)[0] == getattr(__import__("torch"), dtype)
