"""Chunked prefill: a step runs the running sequences' next tokens and chunks of prompts within
`max_num_batched_tokens`; outputs stay those of transformers at any chunk size, and every feature composes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, hf_model
from hotswap import LLM, SamplingParams
from hotswap.engine.scheduler import is_decoding
from hotswap.model.layers.attention import AttentionMetadata
from hotswap.testing import make_tiny_model
from hotswap.transfer.tensors import tensors_update_info

KV = 1 << 24
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=2)

# chunk sizes down to one token: through the step budget alone, or a per-prompt cap with several prompts in flight
CHUNKINGS = {
    "budget-1": {"max_num_batched_tokens": 1, "max_num_seqs": 1},
    "cap-1": {
        "long_prefill_token_threshold": 1,
        "max_num_partial_prefills": 4,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
    },
    "budget-7": {"max_num_batched_tokens": 7, "max_num_seqs": 4, "block_size": 4},
    "budget-16": {"max_num_batched_tokens": 16, "max_num_seqs": 8, "block_size": 4},
    "budget-4096": {"max_num_batched_tokens": 4096},
}


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


PROMPT_IDS = [prompt_ids(n, seed) for seed, n in enumerate((37, 5, 23, 61))]


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dirs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chunked")
    return {"llama": model_dirs["llama"], "qwen3_moe": make_tiny_model(root / "qwen3_moe", "qwen3_moe")}


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("chunked_draft") / "draft",
        seed=11,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )


def assert_exact(
    path: Path, outputs, prompts: list[list[int]], prompt_logprobs: bool = True, max_tokens: int = MAX_TOKENS
) -> None:
    """Greedy tokens equal transformers'; sampled and prompt logprobs within 1e-4 of its log-softmax."""
    for ids, out in zip(prompts, outputs, strict=True):
        tokens, rows = hf_greedy(str(path), tuple(ids), max_tokens)
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"greedy tokens differ for a prompt of {len(ids)} tokens"
        for step, token in enumerate(tokens):
            assert abs(completion.logprobs[step][token].logprob - rows[step][token].item()) < 1e-4
        if not prompt_logprobs:
            continue
        with torch.no_grad():
            ref = hf_model(str(path))(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4, pos
            assert set(ref[pos - 1].topk(2).indices.tolist()) <= set(entry)


@dataclass
class Step:
    """A step as scheduled: per sequence (request id, tokens run, whether it decodes), and whether it prefills."""

    rows: list[tuple[str, int, bool]]
    is_prefill: bool

    @property
    def num_tokens(self) -> list[int]:
        return [n for _, n, _ in self.rows]


def record_steps(llm: LLM) -> list[Step]:
    """Every step the scheduler hands out from now on, as it was when scheduled."""
    scheduler, steps = llm.llm_engine.scheduler, []
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out is not None:
            steps.append(
                Step(
                    [
                        (seq.request.request_id, n, is_decoding(seq))
                        for seq, n in zip(out.seqs, out.num_tokens, strict=True)
                    ],
                    out.is_prefill,
                )
            )
        return out

    scheduler.schedule = recording
    return steps


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_outputs_equal_transformers_at_any_chunk_size(models, model, chunking):
    llm = LLM(str(models[model]), kv_cache_memory_bytes=KV, **CHUNKINGS[chunking])
    steps = record_steps(llm)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPT_IDS], GREEDY, use_tqdm=False)
    assert_exact(models[model], outputs, PROMPT_IDS)
    budget = llm.config.scheduler_config.max_num_batched_tokens
    cap = llm.config.scheduler_config.chunk_cap
    assert all(sum(step.num_tokens) <= budget for step in steps)
    if cap < max(map(len, PROMPT_IDS)):  # the longest prompt ran in chunks no longer than the cap
        assert max(n for step in steps for n in step.num_tokens) == cap


def test_a_long_prompt_shares_steps_with_running_decodes(llama_dir):
    """Four sequences decode while a 300-token prompt arrives: every step runs all four decodes plus a chunk that
    fills the rest of the 32-token budget, and every output is transformers'."""
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=KV, max_num_batched_tokens=32, max_num_seqs=8)
    engine = llm.llm_engine
    short = [prompt_ids(7, 100 + i) for i in range(4)]
    long = prompt_ids(300, 200)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    for i, ids in enumerate(short):
        engine.add_request(f"short-{i}", None, ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()  # the four prompts, whole
    assert all(is_decoding(r.seqs[0]) for r in engine.requests.values())
    steps = record_steps(llm)
    engine.add_request("long", None, long, params)
    finished = {}
    while engine.requests:
        for out in engine.step():
            finished[out.request_id] = out
    prefill_steps = [s for s in steps if any(rid == "long" and not decoding for rid, _, decoding in s.rows)]
    assert len(prefill_steps) == -(-300 // 28)  # 28 = 32 - the four decodes
    for step in prefill_steps:
        decodes = [n for rid, n, _ in step.rows if rid != "long"]
        assert decodes == [1, 1, 1, 1], "a decode waited for the prefill"
        assert sum(step.num_tokens) <= 32
    assert [sum(s.num_tokens) for s in prefill_steps[:-1]] == [32] * (len(prefill_steps) - 1)
    tokens, _ = hf_greedy(str(llama_dir), tuple(long), MAX_TOKENS)
    assert finished["long"].outputs[0].token_ids == tokens
    for i, ids in enumerate(short):
        assert finished[f"short-{i}"].outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(ids), 40)[0]


def test_a_chunk_longer_than_the_kernel_takes_attends_apart_from_the_decodes(llama_dir, monkeypatch):
    """A 700-token chunk (past the native kernel's query length) beside decodes: the step attends in two groups
    (no decode padded to the chunk) and outputs stay transformers'."""
    splits = []
    original = AttentionMetadata._split.__func__

    def counting(cls, *args, **kwargs):
        splits.append(args[0])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AttentionMetadata, "_split", classmethod(counting))
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=KV, max_num_batched_tokens=1024, max_num_seqs=8)
    engine = llm.llm_engine
    short = [prompt_ids(6, 300 + i) for i in range(3)]
    for i, ids in enumerate(short):
        engine.add_request(f"short-{i}", None, ids, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.step()
    long = prompt_ids(700, 400)
    engine.add_request("long", None, long, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finished = {}
    while engine.requests:
        finished.update((o.request_id, o) for o in engine.step())
    assert [1, 1, 1, 700] in splits
    assert finished["long"].outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(long), MAX_TOKENS)[0]
    for i, ids in enumerate(short):
        assert finished[f"short-{i}"].outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(ids), 20)[0]


def test_chunks_extend_a_cached_prompt_across_block_boundaries(llama_dir):
    """A second turn (the first turn's prompt and output, then new tokens) hits the prefix cache and runs the rest
    in chunks of 7 over blocks of 4: chunk boundaries fall inside blocks, and outputs stay transformers'."""
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=KV, max_num_batched_tokens=7, max_num_seqs=4, block_size=4)
    first = PROMPT_IDS[3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    turn1 = llm.generate({"prompt_token_ids": first}, params, use_tqdm=False)[0]
    second = first + turn1.outputs[0].token_ids + prompt_ids(19, 500)
    turn2 = llm.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert turn2.num_cached_tokens >= 60
    assert_exact(llama_dir, [turn1, turn2], [first, second], prompt_logprobs=False)


def test_preemption_and_recomputation_in_chunks(llama_dir):
    per_block = 2 * 2 * 8 * 2 * 16 * 4  # K and V, layers, block, kv heads, head dim, fp32
    llm = LLM(
        str(llama_dir),
        block_size=8,
        max_model_len=96,
        kv_cache_memory_bytes=12 * per_block,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    prompts = [prompt_ids(n, 600 + n) for n in (30, 12, 25, 40, 9, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    assert_exact(llama_dir, outputs, prompts, max_tokens=24)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_alternates_with_chunked_prefill(llama_dir, draft, method, device):
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config["model"] = str(draft)
    llm = LLM(
        str(llama_dir),
        kv_cache_memory_bytes=KV,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        speculative_config=config,
        device=device,
    )
    steps = record_steps(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPT_IDS], params, use_tqdm=False)
    assert_exact(llama_dir, outputs, PROMPT_IDS, prompt_logprobs=False)
    assert llm.llm_engine.stats()["spec_draft_tokens"] > 0
    for step in steps:  # prefill chunks and speculative decodes never share a step
        assert step.is_prefill == (not any(decoding for _, _, decoding in step.rows))
    assert any(s.is_prefill and max(s.num_tokens) < len(PROMPT_IDS[3]) for s in steps)  # prompts were chunked


def test_n_samples_with_a_seed_are_the_same_chunked_or_not(llama_dir):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPT_IDS]
    whole = LLM(str(llama_dir), kv_cache_memory_bytes=KV, enable_chunked_prefill=False)
    chunked = LLM(str(llama_dir), kv_cache_memory_bytes=KV, max_num_batched_tokens=16, max_num_seqs=16)
    for a, b in zip(
        whole.generate(prompts, params, use_tqdm=False), chunked.generate(prompts, params, use_tqdm=False), strict=True
    ):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("clear_cache", [True, False])
def test_an_update_landing_mid_prefill_restarts_the_prompt_on_the_new_weights(ckpts, b_tensors, clear_cache):
    """A prompt part-way through its prefill when weights B are committed starts again, all on B (whether the pause
    cleared the cache or kept it): its tokens, logprobs and prompt logprobs are those of transformers on B."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV, max_num_batched_tokens=16, max_num_seqs=4)
    engine = llm.llm_engine
    ids = prompt_ids(61, 700)
    engine.add_request("r", None, ids, GREEDY)
    engine.step()
    engine.step()
    seq = engine.requests["r"].seqs[0]
    assert seq.num_computed_tokens == 32 and engine.requests["r"].num_prompt_logprobs() == 32
    llm.pause_generation("keep", clear_cache=clear_cache)
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(b_tensors))
    llm.finish_weight_update()
    assert seq.num_computed_tokens == 0 and engine.requests["r"].num_prompt_logprobs() == 0
    llm.resume_generation()
    out = None
    while engine.requests:
        out = next(iter(engine.step()), out)
    assert out is not None and out.outputs[0].weight_versions[0].version == 1
    assert_exact(ckpts["B"], [out], [ids])


@pytest.mark.cpu_only
def test_serve_flags_set_the_step_budget_and_refuse_an_impossible_one(ckpts):
    import httpx

    from server_helpers import running_server

    ids = prompt_ids(61, 800)
    with running_server(
        str(ckpts["A"]),
        "--max-num-batched-tokens",
        "16",
        "--max-num-seqs",
        "4",
        "--long-prefill-token-threshold",
        "8",
        "--kv-cache-memory-bytes",
        str(1 << 22),
    ) as base:
        body = {"model": "A", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["usage"]["prompt_tokens"] == 61
    tokenizer_ids = hf_greedy(str(ckpts["A"]), tuple(ids), MAX_TOKENS)[0]
    from transformers import AutoTokenizer

    assert out["choices"][0]["text"] == AutoTokenizer.from_pretrained(str(ckpts["A"])).decode(tokenizer_ids)
    with pytest.raises(RuntimeError, match="max_num_batched_tokens=8 cannot hold one step of max_num_seqs=256"):
        with running_server(str(ckpts["A"]), "--max-num-batched-tokens", "8"):
            pass


@pytest.mark.parametrize("chunked", [True, False])
def test_samples_of_one_prompt_sent_apart_compute_its_kv_once(llama_dir, chunked):
    """Eight requests of the same 40-token prompt (GRPO's samples, sent one by one) and another prompt: the first
    of the eight runs the prompt while the other seven wait one step, then find its two full blocks in the prefix
    cache and run only the last 8 tokens; the other prompt is not held back. Outputs stay transformers'."""
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=KV, enable_chunked_prefill=chunked)
    steps = record_steps(llm)
    shared, other = prompt_ids(40, 900), prompt_ids(23, 901)
    prompts = [shared] * 4 + [other] + [shared] * 4
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    assert sorted(steps[0].num_tokens) == [23, 40]
    assert steps[1].num_tokens == [8] * 7 or steps[1].num_tokens == [1, 1] + [8] * 7  # (the first two decode)
    assert [o.num_cached_tokens for o in outputs] == [0, 32, 32, 32, 0, 32, 32, 32, 32]
    assert_exact(llama_dir, outputs, prompts, prompt_logprobs=False)


def test_a_wait_pause_drains_when_a_preempted_prompt_without_output_is_queued_first(llama_dir):
    """Nine KV blocks of 4 tokens: two short sequences decode while a 24-token prompt is part-way through its
    prefill and a sequence with output runs behind it. A 'wait' pause, then the decodes' new blocks preempt the
    last two, which queue as [prompt without output, sequence with output]: draining admits the second (it has
    output) past the first, finishes it, and the engine becomes PAUSED; on resume the prompt runs."""
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # K and V, layers, block, kv heads, head dim, fp32
    llm = LLM(
        str(llama_dir),
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        long_prefill_token_threshold=4,
        enable_prefix_caching=False,
        max_model_len=36,
        kv_cache_memory_bytes=9 * per_block,
    )
    engine = llm.llm_engine
    assert llm.config.cache_config.num_kv_blocks == 9
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {"S1": prompt_ids(3, 1), "S2": prompt_ids(3, 2), "U": prompt_ids(24, 3), "R": prompt_ids(2, 4)}
    for name, ids in prompts.items():
        engine.add_request(name, None, ids, params)
    engine.step()
    engine.step()
    assert [s.request.request_id for s in engine.scheduler.running] == ["S1", "S2", "U", "R"]
    engine.pause("wait")
    for _ in range(100):  # draining: the engine steps until every sequence with output finished
        if engine.is_paused():
            break
        engine.step()
    assert engine.is_paused() and set(engine.requests) == {"U"}
    assert not engine.requests["U"].seqs[0].started
    engine.resume()
    finished = {}
    while engine.requests:
        finished.update((o.request_id, o) for o in engine.step())
    assert finished["U"].outputs[0].token_ids == hf_greedy(str(llama_dir), tuple(prompts["U"]), 12)[0]


def test_a_request_with_n_samples_counts_n_sequences_while_its_prompt_runs(llama_dir):
    """max_num_seqs=4: a request with n=3 whose prompt is part-way holds three of the four places, so only one
    more request starts beside it (counted as one, all three others would start, and the fork would make six)."""
    llm = LLM(
        str(llama_dir),
        kv_cache_memory_bytes=KV,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        long_prefill_token_threshold=4,
    )
    engine = llm.llm_engine
    engine.add_request("wide", None, prompt_ids(30, 5), SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    for i in range(3):
        engine.add_request(f"r{i}", None, prompt_ids(3, 6 + i), SamplingParams(max_tokens=40, ignore_eos=True))
    most = 0
    while engine.requests:
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 4
