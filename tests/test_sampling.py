"""Sampling semantics: seeds, n > 1 with shared KV blocks, stop conditions, filters."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from hotswap import LLM, SamplingParams
from hotswap.model.layers.sampler import draw, sample
from hotswap.wire import SampleSpec


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory_bytes=1 << 24)


def test_seeded_request_is_reproducible_alone_or_in_a_crowd(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=24 + i, ignore_eos=True) for i in range(16)]
    crowd = llm.generate(PROMPTS[:8] * 2 + [PROMPTS[1]], [*others, seeded], use_tqdm=False)
    assert crowd[-1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate(PROMPTS[1], different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n4_shares_prompt_blocks_and_samples_distinct_completions(llama_dir):
    llm = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 24, block_size=4, enable_prefix_caching=False)
    prompt = PROMPTS[7]
    num_prompt_blocks = -(-len(llm.get_tokenizer().encode(prompt)) // 4)
    out = llm.generate(
        prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 16 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # The three siblings took references to every prompt block instead of recomputing them.
    assert llm.llm_engine.stats()["shared_block_refs"] == 3 * num_prompt_blocks
    assert llm.llm_engine.stats()["num_free_blocks"] == llm.config.cache_config.num_kv_blocks


def test_n_greedy_siblings_equal_single_greedy(llm):
    single = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    multi = llm.generate(PROMPTS[3], SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert all(c.token_ids == single[0].outputs[0].token_ids for c in multi[0].outputs)


def test_stop_token_ids_end_with_stop_reason(llm):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    stop_token = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_token)
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_token]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token


def test_stop_string_is_cut_from_text(llm):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    text = greedy.text
    stop = text[10:13]
    assert stop.strip(), "fixture text too short"
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, stop=[stop, "never-seen-zzz"]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert len(out.token_ids) < len(greedy.token_ids)


def test_min_tokens_suppresses_stop_tokens(llm):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    out = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=32, min_tokens=10, stop_token_ids=[greedy.token_ids[0]]),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) >= 10
    assert greedy.token_ids[0] not in out[0].outputs[0].token_ids[:10]


def test_max_tokens_gives_length(llm):
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 5


def test_eos_ends_generation_unless_ignored(llm):
    eos = llm.get_tokenizer().eos_token_id
    # The test models rarely rank EOS first, so sample very hot: across 32 samples EOS is drawn somewhere.
    outs = llm.generate(PROMPTS[:4], SamplingParams(temperature=50.0, max_tokens=200, seed=3, n=8), use_tqdm=False)
    completions = [c for o in outs for c in o.outputs]
    with_eos = [c for c in completions if eos in c.token_ids]
    assert with_eos, "no sample drew EOS; raise the temperature or the sample count"
    for c in with_eos:
        assert c.token_ids[-1] == eos and c.token_ids.count(eos) == 1 and c.finish_reason == "stop"
    ignoring = llm.generate(
        PROMPTS[:4], SamplingParams(temperature=50.0, max_tokens=200, seed=3, n=8, ignore_eos=True), use_tqdm=False
    )
    same_seed = [c for o in ignoring for c in o.outputs]
    assert all(len(c.token_ids) == 200 and c.finish_reason == "length" for c in same_seed)
    assert any(eos in c.token_ids[:-1] for c in same_seed)


def test_stop_string_inside_min_tokens_is_not_matched(llm):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    first_char = greedy.text.strip()[0]
    out = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, min_tokens=6, stop=[first_char]),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 6
    assert first_char in llm.get_tokenizer().decode(out.token_ids[:6])  # present, but inside min_tokens
    # A stop may only match text that ends after the first 6 tokens; the text is cut at the match.
    text6 = llm.get_tokenizer().decode(out.token_ids[:6])
    assert out.finish_reason == "length" or len(out.text) >= len(text6) - len(first_char) + 1


def test_seeded_sampling_survives_preemption(llama_dir):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    roomy = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 24)
    expected = roomy.generate(PROMPTS, params, use_tqdm=False)
    per_block = 2 * 2 * 8 * 2 * 16 * 4
    tight = LLM(str(llama_dir), block_size=8, max_model_len=96, kv_cache_memory_bytes=12 * per_block)
    got = tight.generate(PROMPTS, params, use_tqdm=False)
    assert tight.llm_engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_logprobs_topk_entries(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=0, max_tokens=6, logprobs=3), use_tqdm=False)[
        0
    ].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked][:3] == [1, 2, 3]
        assert ranked[0].logprob >= ranked[1].logprob >= ranked[2].logprob
        assert all(lp.decoded_token is not None for lp in entry.values())


@pytest.mark.unit
def test_sampler_filters():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    order = logits[0].argsort(descending=True)
    for _ in range(50):
        (res,) = sample(logits, [SampleSpec(temperature=1.0, top_k=3)])
        assert res.token_id in order[:3].tolist()
        (res,) = sample(logits, [SampleSpec(temperature=1.0, top_p=1e-6)])
        assert res.token_id == order[0].item()
        (res,) = sample(logits, [SampleSpec(temperature=1.0, min_p=0.999)])
        assert res.token_id == order[0].item()
    probs = logits[0].softmax(-1)
    keep = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    seen = {sample(logits, [SampleSpec(temperature=1.0, top_p=0.5)])[0].token_id for _ in range(300)}
    assert seen <= set(order[:keep].tolist()) and len(seen) > 1


@pytest.mark.unit
def test_plain_greedy_fast_path_equals_the_general_path():
    """All-greedy rows without logprobs take the one-pass kernel; asking for logprobs takes the general path."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 3000, generator=gen) * 3
    fast = sample(logits, [SampleSpec() for _ in range(16)])
    general = sample(logits, [SampleSpec(num_logprobs=0) for _ in range(16)])
    assert [r.token_id for r in fast] == [r.token_id for r in general] == logits.argmax(-1).tolist()
    for f, g in zip(fast, general, strict=True):
        assert abs(f.logprob - g.logprob) < 1e-5


@pytest.mark.unit
def test_min_p_applies_before_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    # min_p 0.5 keeps {0: .5, 1: .3}; renormalized, top_p 0.6 keeps only token 0 (vLLM's order)
    assert {sample(logits, [SampleSpec(temperature=1.0, min_p=0.5, top_p=0.6)])[0].token_id for _ in range(200)} == {0}


@pytest.mark.unit
def test_sampler_matches_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [SampleSpec(temperature=1.0)])[0].token_id] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


@pytest.mark.unit
def test_inverse_cdf_draw_is_exact_at_its_edges_and_never_picks_a_zero():
    """`draw` maps u to the token where the running sum passes u x total: the first and last uniforms land on the
    first and last tokens with mass, zero-probability tokens (filtered, at the ends or inside) are never drawn, and
    on a 5-token row the draws of a fine grid of uniforms split exactly in proportion to the probabilities."""
    row = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    top = 1.0 - 2.0**-24  # the largest float32 below 1 (torch.rand's largest value)
    picks = draw(row.expand(3, 6), torch.tensor([0.0, top, 0.5]))
    assert picks.tolist() == [1, 4, 3]
    grid = (torch.arange(4000, dtype=torch.float64) / 4000).float()
    counts = torch.bincount(draw(row.expand(4000, 6), grid), minlength=6)
    assert counts.tolist() == [0, 1000, 0, 2000, 1000, 0]
    rows = torch.rand(512, 300) * (torch.rand(512, 300) > 0.7)
    rows[:, 17] += 1e-30  # a row with some mass everywhere it is not zero
    picked = draw(rows, torch.rand(512))
    assert bool((rows.gather(1, picked[:, None]) > 0).all())


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_max_logprobs_bounds_requests_and_minus_one_allows_the_vocabulary(llama_dir, llm):
    with pytest.raises(ValueError, match="max_logprobs=20"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, logprobs=21), use_tqdm=False)
    wide = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22, max_logprobs=-1)
    vocab = wide.llm_engine.config.model_config.hf_config["vocab_size"]
    out = wide.generate(PROMPTS[0], SamplingParams(max_tokens=1, logprobs=vocab), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) >= vocab
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22, max_logprobs=-2)


# ---- penalties, logit bias, prompt logprobs (vLLM's SamplingParams fields) -----------------------------------


def _hf_greedy_with(path, ids: list[int], steps: int, adjust) -> list[int]:
    """Greedy decoding with transformers' logits, `adjust(logits, tokens_so_far)` applied before each argmax."""
    from conftest import hf_model

    model, tokens = hf_model(str(path)), list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            tokens.append(int(adjust(logits, tokens).argmax()))
    return tokens[len(ids) :]


def test_penalties_and_logit_bias_equal_their_definitions(llm, llama_dir):
    """repetition_penalty (over prompt and output), presence and frequency penalties (over the output) and
    logit_bias, on transformers' logits step by step, give the same greedy tokens."""
    ids = llm.get_tokenizer().encode(PROMPTS[1])

    def repetition(logits, tokens):
        seen = torch.tensor(sorted(set(tokens)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 1.4, logits[seen] * 1.4)
        return logits

    def presence_frequency(logits, tokens):
        counts = torch.bincount(torch.tensor(tokens[len(ids) :], dtype=torch.long), minlength=logits.shape[0])
        return logits - 0.9 * counts - 0.6 * (counts > 0)

    def bias(logits, tokens):
        logits[7] += 25.0
        logits[9] -= 100.0
        return logits

    cases = [
        (dict(repetition_penalty=1.4), repetition),
        (dict(presence_penalty=0.6, frequency_penalty=0.9), presence_frequency),
        (dict(logit_bias={"7": 25.0, 9: -100}), bias),
    ]
    plain = (
        llm.generate(
            {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    for fields, adjust in cases:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **fields)
        got = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == _hf_greedy_with(llama_dir, ids, 16, adjust), fields
        assert got != plain, f"{fields} changed nothing: the case cannot fail"


def test_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(llm, llama_dir):
    from conftest import hf_model

    ids = llm.get_tokenizer().encode(PROMPTS[7] + " " + PROMPTS[3])
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, n=2, prompt_logprobs=3), use_tqdm=False)[
        0
    ]
    assert out.num_cached_tokens == 0
    with torch.no_grad():
        ref = hf_model(str(llama_dir))(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert entry[ids[pos]].rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
        top = ref[pos - 1].topk(3).indices.tolist()
        assert set(top) <= set(entry)
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0


def test_include_stop_str_in_output_and_validation(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text
    stop = text[5:8]
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop=stop), use_tqdm=False)
    kept = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=40, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept[0].outputs[0].text == cut[0].outputs[0].text + stop
    for bad, match in [
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty="x"), "frequency_penalty"),
        (dict(logit_bias={"a": 1}), "logit_bias keys"),
        (dict(logit_bias={1: 200}), "logit_bias"),
        (dict(prompt_logprobs=-2), "prompt_logprobs"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="below the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs=50 exceeds max_logprobs"):
        llm.generate(PROMPTS[0], SamplingParams(prompt_logprobs=50), use_tqdm=False)


@pytest.mark.cuda
def test_the_sampler_on_a_device_equals_the_host(device):
    """Logits left on the GPU: greedy rows, filters, penalties, logit bias, banned tokens and seeded draws give the
    tokens the host gives (the uniforms are drawn on the host), logprobs within float rounding."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 3000, generator=gen) * 4
    specs = [
        SampleSpec(),
        SampleSpec(num_logprobs=5),
        SampleSpec(temperature=0.7, seed=1, top_k=50),
        SampleSpec(temperature=1.0, seed=2, top_p=0.9),
        SampleSpec(temperature=1.3, seed=3, min_p=0.05),
        SampleSpec(temperature=1.0, seed=4, logit_bias={7: 30.0}),
        SampleSpec(temperature=0.0, banned_token_ids=[int(logits[6].argmax())]),
        SampleSpec(
            temperature=0.9,
            seed=5,
            repetition_penalty=1.3,
            seen_token_ids=[1, 2, 3],
            num_prompt_tokens=1,
            presence_penalty=0.5,
            frequency_penalty=0.2,
        ),
        *[SampleSpec(temperature=1.0, seed=10 + i, num_logprobs=2) for i in range(4)],
    ]
    host = sample(logits, specs)
    on_device = sample(logits.to(device), specs)
    assert [r.token_id for r in on_device] == [r.token_id for r in host]
    for a, b in zip(on_device, host, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4 and a.top_ids == b.top_ids
