"""Serving while weights change: async streaming, pause modes, per-token weight versions, prefix-cache policy,
sleep/wake."""

from __future__ import annotations

import asyncio
import functools
import itertools
import operator
import os
import random
import time

import pytest
from safetensors.torch import load_file

from conftest import PROMPTS, hf_greedy
from hotswap import LLM, EngineConfig, SamplingParams
from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.outputs import WeightVersionSpan
from hotswap.testing import make_tiny_model
from hotswap.transfer.tensors import tensors_update_info

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tensors(ckpts):
    return {k: list(load_file(str(v / "model.safetensors")).items()) for k, v in ckpts.items()}


def ref(path, tokenizer, prompt_ids: list[int], n: int) -> list[int]:
    return hf_greedy(str(path), tuple(prompt_ids), n)[0]


def make_engine(path, **kwargs) -> AsyncLLMEngine:
    return AsyncLLMEngine(EngineConfig.from_kwargs(str(path), kv_cache_memory_bytes=1 << 23, **kwargs))


async def push(engine: AsyncLLMEngine, named) -> None:
    await engine.start_weight_update()
    await engine.update_weights(tensors_update_info(named))
    await engine.finish_weight_update()


async def collect(engine, prompt, params, request_id=None):
    outs = [o async for o in engine.generate(prompt, params, request_id)]
    return outs


def test_async_streams_deltas_cumulative_and_final(ckpts):
    async def main():
        engine = make_engine(ckpts["A"])
        await engine.init_weight_transfer_engine({"backend": "tensors"})
        kinds = {}
        for kind in ("delta", "cumulative", "final_only"):
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind, logprobs=0)
            kinds[kind] = await collect(engine, PROMPTS[1], params)
        await engine.shutdown()
        return engine, kinds

    engine, kinds = asyncio.run(main())
    delta, cumulative, final = kinds["delta"], kinds["cumulative"], kinds["final_only"]
    full = cumulative[-1].outputs[0]
    assert len(delta) == 12 and len(cumulative) == 12 and len(final) == 1
    assert "".join(o.outputs[0].text for o in delta) == full.text == final[0].outputs[0].text
    assert functools.reduce(operator.iadd, (o.outputs[0].token_ids for o in delta), []) == full.token_ids
    delta_lps = functools.reduce(operator.iadd, (o.outputs[0].logprobs for o in delta), [])
    assert [list(d) for d in delta_lps] == [list(d) for d in full.logprobs]  # runs differ in prefix-cache hits
    assert all(
        abs(a[t].logprob - b[t].logprob) < 1e-4 for a, b in zip(delta_lps, full.logprobs, strict=True) for t in a
    )
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 13))
    ids = engine.tokenizer.encode(PROMPTS[1])
    assert full.token_ids == ref(ckpts["A"], engine.tokenizer, ids, 12)
    assert all(not o.finished for o in delta[:-1]) and delta[-1].finished


def test_async_abort_and_cancellation(ckpts):
    async def main():
        engine = make_engine(ckpts["A"])
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        outs = []
        async for out in engine.generate(PROMPTS[0], params, "r1"):
            outs.append(out)
            if len(out.outputs[0].token_ids) == 5:
                await engine.abort("r1")
        gen = engine.generate(PROMPTS[0], params, "r2")
        await gen.__anext__()
        await gen.aclose()  # a client that goes away: the step loop aborts its request
        for _ in range(200):
            if "r2" not in engine.engine.requests:
                break
            await asyncio.sleep(0.01)
        assert "r2" not in engine.engine.requests
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert 5 <= len(outs[-1].outputs[0].token_ids) < 200


async def wait_tokens(engine: AsyncLLMEngine, count: int, timeout_s: float = 60.0) -> None:
    """Waits until every running request has produced at least `count` tokens. Fails (instead of waiting for ever)
    when the requests it saw all finished first: the test's requests must outlast the time the test takes to look."""
    seen = False
    deadline = time.monotonic() + timeout_s
    while True:
        seqs = [s for r in engine.engine.requests.values() for s in r.seqs]
        if seqs and all(s.num_output_tokens >= count for s in seqs):
            return
        seen = seen or bool(seqs)
        assert not (seen and not seqs), f"the requests finished before each had {count} tokens"
        assert time.monotonic() < deadline, f"the requests did not reach {count} tokens in {timeout_s:g} s"
        await asyncio.sleep(0.001)


def test_pause_abort_keeps_partial_output(ckpts):
    async def main():
        engine = make_engine(ckpts["A"])
        # long enough (about 0.5 s on an idle machine) that the pause lands mid-request even on a loaded one
        params = SamplingParams(temperature=0, max_tokens=800, ignore_eos=True)
        tasks = [asyncio.create_task(collect(engine, p, params)) for p in PROMPTS[:4]]
        await wait_tokens(engine, 3)
        await engine.pause_generation("abort")
        results = await asyncio.gather(*tasks)
        assert await engine.is_paused()
        late = asyncio.create_task(collect(engine, PROMPTS[5], SamplingParams(temperature=0, max_tokens=4)))
        await asyncio.sleep(0.05)
        assert not late.done()  # queued while paused
        await engine.resume_generation()
        late_out = await late
        await engine.shutdown()
        return results, late_out

    results, late_out = asyncio.run(main())
    for outs in results:
        final = outs[-1].outputs[0]
        assert final.finish_reason == "abort" and 3 <= len(final.token_ids) < 800
    assert late_out[-1].outputs[0].finish_reason == "length"


def test_pause_wait_finishes_on_old_weights(ckpts, tensors):
    async def main():
        engine = make_engine(ckpts["A"])
        await engine.init_weight_transfer_engine({"backend": "tensors"})
        tasks = [asyncio.create_task(collect(engine, p, GREEDY)) for p in PROMPTS[:4]]
        await wait_tokens(engine, 2)
        with pytest.raises(RuntimeError, match="pause_generation"):
            await engine.start_weight_update()  # not paused, requests in flight
        await engine.pause_generation("wait")
        assert not engine.engine.requests  # pause returned after they finished
        await push(engine, tensors["B"])
        await engine.resume_generation()
        after = await collect(engine, PROMPTS[0], GREEDY)
        await engine.shutdown()
        return [t.result()[-1] for t in tasks], after[-1], engine

    finals, after, engine = asyncio.run(main())
    tok = engine.tokenizer
    for prompt, out in zip(PROMPTS[:4], finals, strict=True):
        assert out.outputs[0].token_ids == ref(ckpts["A"], tok, tok.encode(prompt), 24)
        assert out.outputs[0].weight_versions == [WeightVersionSpan(0, 0, 24)]
    assert after.outputs[0].token_ids == ref(ckpts["B"], tok, tok.encode(PROMPTS[0]), 24)
    assert after.outputs[0].weight_versions == [WeightVersionSpan(1, 0, 24)]
    assert after.admission_weight_version == 1


@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_keep_continues_after_update(ckpts, tensors, clear_cache):
    async def main():
        engine = make_engine(ckpts["A"])
        await engine.init_weight_transfer_engine({"backend": "tensors"})
        tasks = [asyncio.create_task(collect(engine, p, GREEDY)) for p in PROMPTS[:4]]
        await wait_tokens(engine, 4)
        await engine.pause_generation("keep", clear_cache=clear_cache)
        await push(engine, tensors["B"])
        await engine.resume_generation()
        finals = [(await t)[-1] for t in tasks]
        await engine.shutdown()
        return finals, engine

    finals, engine = asyncio.run(main())
    tok = engine.tokenizer
    for prompt, out in zip(PROMPTS[:4], finals, strict=True):
        c = out.outputs[0]
        assert len(c.token_ids) == 24 and c.finish_reason == "length"
        (old, new) = c.weight_versions
        assert old.version == 0 and new.version == 1 and old.start_token == 0
        assert old.end_token == new.start_token >= 4 and new.end_token == 24
        freeze = old.end_token
        ids = tok.encode(prompt)
        assert c.token_ids[:freeze] == ref(ckpts["A"], tok, ids, freeze)
        if clear_cache:  # recomputed under B: exactly B's continuation from the freeze point
            assert c.token_ids[freeze:] == ref(ckpts["B"], tok, ids + c.token_ids[:freeze], 24 - freeze)


def test_version_spans_in_a_scripted_scenario(ckpts, tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    engine = llm.llm_engine
    engine.add_request("s", None, llm.get_tokenizer().encode(PROMPTS[2]), SamplingParams(max_tokens=10, temperature=0))
    for _ in range(3):
        engine.step()  # prefill + 2 decodes: 3 tokens at version 0
    llm.pause_generation("keep", clear_cache=False)
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(tensors["B"]))
    llm.finish_weight_update(weight_version=41)
    llm.resume_generation()
    final = []
    while not final:
        final = engine.step()
    out = final[0]
    assert out.admission_weight_version == 0
    assert out.outputs[0].weight_versions == [WeightVersionSpan(0, 0, 3), WeightVersionSpan(41, 3, 10)]


def test_salt_policy_never_serves_an_old_version_prefix(ckpts, tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, block_size=4, prefix_cache_policy="salt")
    tok = llm.get_tokenizer()
    prompt = PROMPTS[7]
    ids = tok.encode(prompt)
    llm.generate(prompt, GREEDY, use_tqdm=False)
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # same version: the prefix is reused
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(tensors["B"]))
    llm.finish_weight_update()
    assert llm.llm_engine.block_manager.cached  # old entries are not dropped, only never hit
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert first.outputs[0].token_ids == ref(ckpts["B"], tok, ids, 24)
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0 and second.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.slow
def test_storm_of_clients_during_fifty_updates(ckpts, tensors):
    """8 clients x 25 requests while 50 pause/update/resume cycles run: every request completes and every
    token carries a version that was live while its request ran."""
    versions_pushed: list[int] = []

    async def client(engine, cid):
        rng = random.Random(cid)
        results = []
        for i in range(25):
            params = SamplingParams(temperature=0.8, seed=cid * 100 + i, max_tokens=rng.randint(2, 10))
            outs = await collect(engine, PROMPTS[rng.randrange(8)], params)
            results.append(outs[-1])
        return results

    async def updater(engine):
        for i in range(50):
            mode = ("keep", "wait")[i % 2]
            await engine.pause_generation(mode, clear_cache=bool(i % 3))
            await push(engine, tensors["B" if i % 2 == 0 else "A"])
            versions_pushed.append(await engine.get_weight_version())
            await engine.resume_generation()
            await asyncio.sleep(0.005)

    async def main():
        engine = make_engine(ckpts["A"], max_num_seqs=16)
        await engine.init_weight_transfer_engine({"backend": "tensors"})
        results = await asyncio.gather(*(client(engine, c) for c in range(8)), updater(engine))
        await engine.shutdown()
        return results[:8]

    per_client = asyncio.run(main())
    outs = [o for results in per_client for o in results]
    assert len(outs) == 200
    for out in outs:
        c = out.outputs[0]
        assert out.finished and c.finish_reason in ("length", "stop")
        spans = c.weight_versions
        assert spans[0].start_token == 0 and spans[-1].end_token == len(c.token_ids)
        assert all(a.end_token == b.start_token for a, b in itertools.pairwise(spans))
        versions = [s.version for s in spans]
        assert versions == sorted(versions) and versions[0] >= out.admission_weight_version
        assert all(0 <= v <= 50 for v in versions)
    assert versions_pushed == list(range(1, 51))
    assert sum(len(o.outputs[0].weight_versions) > 1 for o in outs) > 0  # some requests crossed an update


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_sleep_wake_restores_outputs_and_returns_memory(tmp_path):
    path = make_tiny_model(tmp_path / "m9", preset="9m")
    kv_bytes = 16 << 20
    llm = LLM(str(path), kv_cache_memory_bytes=kv_bytes, max_model_len=256, block_size=16)
    weight_bytes = sum(llm.apply_model(lambda m: [p.numel() * p.element_size() for p in m.parameters()])[0])
    capacity = llm.config.cache_config.num_kv_blocks * 16
    # prompts of 120 tokens that together outgrow the cache: the prefills touch every KV block (so its pages are
    # resident before sleep) and decoding preempts
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(120)]} for i in range(capacity // 120 + 2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    rss = rss_bytes()
    llm.sleep(level=1)
    assert rss - rss_bytes() >= kv_bytes * 0.95
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts[:1], params, use_tqdm=False)
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in before
    ]
    rss = rss_bytes()
    llm.sleep(level=2)
    assert rss - rss_bytes() >= kv_bytes * 0.95 + weight_bytes * 0.8
    llm.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts[:1], params, use_tqdm=False)
    llm.reload_weights()
    llm.wake_up(["kv_cache"])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in before
    ]


def test_group_abort_by_ids_and_by_prefix_returns_partial_outputs(ckpts):
    """`abort_requests` ends a group between two steps: each stream gets its partial output (tokens, logprobs,
    version spans) with finish_reason 'abort'; requests outside the group finish normally."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=400, ignore_eos=True, logprobs=1)

    async def main():
        engine = make_engine(ckpts["A"])
        ids = ["grp::0", "grp::1", "grp::2", "solo", "pair-a"]
        short = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        tasks = {
            rid: asyncio.create_task(collect(engine, PROMPTS[i], short if rid == "solo" else params, rid))
            for i, rid in enumerate(ids)
        }
        await wait_tokens(engine, 2)
        by_prefix = await engine.abort_requests(prefix="grp::")
        by_id = await engine.abort_requests(["pair-a", "no-such-request"])
        finals = {rid: (await task)[-1] for rid, task in tasks.items()}
        await engine.shutdown()
        return by_prefix, by_id, finals

    by_prefix, by_id, finals = asyncio.run(main())
    assert sorted(by_prefix) == ["grp::0", "grp::1", "grp::2"] and by_id == ["pair-a"]
    for rid in (*by_prefix, *by_id):
        c = finals[rid].outputs[0]
        assert finals[rid].finished and c.finish_reason == "abort" and 2 <= len(c.token_ids) < 400
        assert len(c.logprobs) == len(c.token_ids) and c.weight_versions[-1].end_token == len(c.token_ids)
    solo = finals["solo"].outputs[0]
    assert solo.finish_reason == "length" and len(solo.token_ids) == 30
