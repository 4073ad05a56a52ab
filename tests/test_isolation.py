"""One request's failure stays in that request: bad sampling fields are refused at admission, and a request
that fails inside a step ends alone while the others in its batch finish."""

from __future__ import annotations

import asyncio

import pytest

from conftest import PROMPTS
from hotswap import LLM, EngineConfig, SamplingParams
from hotswap.engine.async_llm_engine import AsyncLLMEngine


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_k": 2**63}, "top_k=.*exceeds the vocabulary size"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": float("inf")}, "top_p must be a finite number"),
        ({"min_p": float("nan")}, "min_p must be a finite number"),
    ],
)
def test_bad_sampling_fields_are_refused_at_admission(llama_dir, fields, message):
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22)
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, **fields), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)) == 2


@pytest.fixture
def seed_666_fails(monkeypatch):
    """The sampler raises for any batch holding a request with seed 666."""
    from hotswap.worker import model_runner

    real = model_runner.sample

    def sample(logits, specs, *args, **kwargs):
        if any(spec.seed == 666 for spec in specs):
            raise RuntimeError("sampler failure for seed 666")
        return real(logits, specs, *args, **kwargs)

    monkeypatch.setattr(model_runner, "sample", sample)


def test_a_request_failing_in_a_step_ends_alone(llama_dir, seed_666_fails):
    """Requests batched together; one of them makes the sampler raise. It gets the error; the other three
    finish with the same tokens as when run without it."""
    good = SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)
    bad = SamplingParams(temperature=0.8, seed=666, max_tokens=12, ignore_eos=True)
    config = EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=1 << 22)

    async def run(with_bad: bool) -> list:
        engine = AsyncLLMEngine(config)

        async def one(prompt, params):
            last = None
            async for out in engine.generate(prompt, params):
                last = out
            return last.outputs[0].token_ids

        jobs = [one(p, good) for p in PROMPTS[:3]]
        if with_bad:
            jobs.insert(1, one(PROMPTS[3], bad))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        await engine.shutdown()
        return results

    alone = asyncio.run(run(False))
    mixed = asyncio.run(run(True))
    assert isinstance(mixed[1], RuntimeError) and "seed 666" in str(mixed[1])
    assert [mixed[0], *mixed[2:]] == alone


def test_a_request_failing_alone_in_its_prefill_does_not_end_the_decoding_ones(llama_dir, seed_666_fails):
    good = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    bad = SamplingParams(temperature=0.8, seed=666, max_tokens=4, ignore_eos=True)

    async def run() -> list:
        engine = AsyncLLMEngine(EngineConfig.from_kwargs(str(llama_dir), kv_cache_memory_bytes=1 << 22))

        async def one(prompt, params, delay=0.0):
            await asyncio.sleep(delay)
            last = None
            async for out in engine.generate(prompt, params):
                last = out
            return last.outputs[0].token_ids

        results = await asyncio.gather(
            one(PROMPTS[0], good), one(PROMPTS[1], good), one(PROMPTS[2], bad, 0.05), return_exceptions=True
        )
        await engine.shutdown()
        return results

    first, second, failed = asyncio.run(run())
    assert isinstance(failed, RuntimeError) and "seed 666" in str(failed)
    assert len(first) == 40 and len(second) == 40
