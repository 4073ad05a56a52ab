"""Teacher scoring for on-policy distillation (docs/teacher-scoring.md): top-K logprobs (K up to 256, and the whole
vocabulary) of sampled and prompt tokens at a temperature, equal to transformers' log_softmax(logits / T); the
compact base64 form on the HTTP routes, equal to the JSON form bit for bit; `score_tokens` (and
`/v1/score_tokens`) without generating; and the deterministic mode's bits against the trainer's forward."""

from __future__ import annotations

import base64
import math
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from conftest import hf_model
from hotswap import LLM, SamplingParams
from hotswap.entrypoints.logprobs_wire import compact, decode, entries_compact
from hotswap.model.layers.sampler import prompt_logprobs_of, results_for
from hotswap.outputs import Logprob
from hotswap.testing import make_tiny_model
from hotswap.wire import PromptLogprobsAsk, SampleSpec
from server_helpers import post, running_server

VOCAB = 1024  # a vocabulary well above K = 256
T = 0.7
K = 256
TOL = 2e-4  # float32 forwards of two implementations, logprobs down to about -25
TEXT = "the quick brown fox jumps over the lazy dog and then it runs far away into the woods"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("teacher") / "m", seed=3, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def processed(model: Path) -> LLM:
    """An engine whose logprobs (sampled and prompt) are those of the processed distribution, K up to the
    vocabulary."""
    return LLM(str(model), kv_cache_memory_bytes=1 << 24, max_logprobs=-1, logprobs_mode="processed_logprobs")


@pytest.fixture(scope="module")
def ids(processed: LLM) -> list[int]:
    return processed.get_tokenizer().encode(TEXT)


def reference(model: Path, seq: list[int], temperature: float = 1.0) -> torch.Tensor:
    """transformers' log_softmax(logits / T) after each token of `seq` but the last: [len - 1, V] float32."""
    with torch.no_grad():
        logits = hf_model(str(model))(torch.tensor([seq])).logits[0, :-1].float()
    return (logits / temperature).log_softmax(-1)


def top_of(entry: dict[int, Logprob], token: int, k: int) -> tuple[list[int], list[float]]:
    """The top-k (ids, logprobs) of a vLLM logprobs entry, by rank (the scored token left out when outside it)."""
    items = list(entry.items())
    if len(items) > k:
        assert items[0][0] == token
        items = items[1:]
    items.sort(key=lambda item: item[1].rank or 0)
    return [t for t, _ in items], [lp.logprob for _, lp in items]


def check_rank(ref_row: torch.Tensor, token: int, rank: int) -> None:
    """Asserts that `rank` is the token's rank under `ref_row` (1 + the tokens more likely), up to near-ties."""
    value = ref_row[token]
    assert int((ref_row > value + TOL).sum()) + 1 <= rank <= int((ref_row > value - TOL).sum()) + 1


def check_top(ref_row: torch.Tensor, ids: list[int], values: list[float], k: int) -> float:
    """Asserts that (ids, values) are `ref_row`'s k largest (by value: a near-tie at the K-th place may swap ids)
    and returns the largest |difference|."""
    assert len(ids) == len(values) == k and len(set(ids)) == k
    got = torch.tensor(values)
    assert torch.all(got[:-1] >= got[1:]), "most likely first"
    diff = max((ref_row[torch.tensor(ids)] - got).abs().max().item(), (ref_row.topk(k).values - got).abs().max().item())
    assert diff < TOL
    return diff


# ---- the engine: sampled and prompt tokens, top-256 at T = 0.7 and the whole vocabulary ------------------------


def test_top256_at_t07_of_sampled_and_prompt_tokens_equal_transformers(processed, model, ids):
    """processed_logprobs at T = 0.7: every sampled and every prompt position's top-256 (and the token's own
    logprob and rank) equal transformers' log_softmax(logits / 0.7); raw log_softmax(logits) differs."""
    params = SamplingParams(temperature=T, seed=5, max_tokens=10, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    out = processed.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    c = out.outputs[0]
    seq = ids + list(c.token_ids)
    ref = reference(model, seq, T)
    raw = reference(model, seq)
    entries = [*out.prompt_logprobs[1:], *c.logprobs]
    assert len(entries) == len(seq) - 1
    worst = 0.0
    for pos, entry in enumerate(entries):
        token = seq[pos + 1]
        top_ids, top_values = top_of(entry, token, K)
        worst = max(worst, check_top(ref[pos], top_ids, top_values, K))
        assert abs(entry[token].logprob - ref[pos, token].item()) < TOL
        check_rank(ref[pos], token, entry[token].rank)
    print(f"top-{K} at T={T} vs transformers: max |diff| {worst:.2e} over {len(entries)} positions")
    prompt_chosen = torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
    raw_chosen = raw[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (prompt_chosen - raw_chosen).abs().max() > 0.05, "prompt logprobs are the processed distribution's"


def test_raw_modes_keep_raw_prompt_logprobs(model, ids):
    """vLLM's behaviour under the default raw_logprobs: prompt logprobs are log_softmax(logits) whatever the
    request's temperature."""
    llm = LLM(str(model), kv_cache_memory_bytes=1 << 22, max_logprobs=K)
    out = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=T, max_tokens=1, prompt_logprobs=K), use_tqdm=False
    )[0]
    raw = reference(model, ids)
    for pos in range(1, len(ids)):
        top_ids, top_values = top_of(out.prompt_logprobs[pos], ids[pos], K)
        check_top(raw[pos - 1], top_ids, top_values, K)


def test_filters_apply_to_prompt_positions_like_sampled_ones(processed, model, ids):
    """With top_k 40 at T = 0.7, a prompt position's distribution is the 40 most likely tokens renormalised
    (the rest -inf), as the sampled tokens' are."""
    out = processed.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=T, top_k=40, max_tokens=1, prompt_logprobs=50),
        use_tqdm=False,
    )[0]
    scaled = reference(model, ids, T)
    kept = scaled.topk(40).indices
    masked = torch.full_like(scaled, float("-inf")).scatter(1, kept, scaled.gather(1, kept)).log_softmax(-1)
    for pos in range(1, len(ids)):
        top_ids, top_values = top_of(out.prompt_logprobs[pos], ids[pos], 50)
        assert all(v == float("-inf") for v in top_values[40:])
        finite = torch.tensor(top_values[:40])
        assert (finite - masked[pos - 1, torch.tensor(top_ids[:40])]).abs().max() < TOL
        assert abs(sum(math.exp(v) for v in top_values[:40]) - 1.0) < 1e-4


def test_the_whole_vocabulary_with_minus_one(processed, model, ids):
    """logprobs=-1 and prompt_logprobs=-1 (vLLM's spelling) return every token's logprob at each position."""
    out = processed.generate(
        {"prompt_token_ids": ids[:8]},
        SamplingParams(temperature=T, seed=1, max_tokens=3, ignore_eos=True, logprobs=-1, prompt_logprobs=-1),
        use_tqdm=False,
    )[0]
    seq = ids[:8] + list(out.outputs[0].token_ids)
    ref = reference(model, seq, T)
    entries = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
    for pos, entry in enumerate(entries):
        assert len(entry) == VOCAB
        got = torch.tensor([entry[t].logprob for t in range(VOCAB)])
        assert (got - ref[pos]).abs().max() < TOL
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(str(model), kv_cache_memory_bytes=1 << 22).generate(
            "hi", SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False
        )


# ---- score_tokens ------------------------------------------------------------------------------------------------


def test_score_tokens_equals_transformers_without_generating(processed, model, ids):
    """score_tokens at T = 0.7 with top-256 (whatever the engine's logprobs_mode), in one call for sequences of
    unequal lengths; the whole vocabulary with -1; filters; nothing is generated or left in the cache."""
    seqs = [ids, ids[:5], ids[3:20], [ids[0], ids[1]]]
    free = processed.llm_engine.block_manager.num_free_blocks
    scores = processed.score_tokens(seqs, temperature=T, top_logprobs=K)
    assert processed.llm_engine.block_manager.num_free_blocks == free and not processed.llm_engine.requests
    worst = 0.0
    for seq, s in zip(seqs, scores, strict=True):
        ref = reference(model, seq, T)
        n = len(seq) - 1
        assert s.token_ids == seq and s.logprobs.shape == (n,) and s.top_ids.shape == (n, K)
        assert s.logprobs.dtype == np.float32 and s.top_ids.dtype == np.int32
        chosen = ref[torch.arange(n), torch.tensor(seq[1:])]
        worst = max(worst, (torch.from_numpy(s.logprobs) - chosen).abs().max().item())
        for pos in range(n):
            check_rank(ref[pos], seq[pos + 1], int(s.ranks[pos]))
            worst = max(worst, check_top(ref[pos], s.top_ids[pos].tolist(), s.top_logprobs[pos].tolist(), K))
    assert worst < TOL
    print(f"score_tokens top-{K} at T={T} vs transformers: max |diff| {worst:.2e}")
    whole = processed.score_tokens([ids[:6]], temperature=T, top_logprobs=-1)[0]
    assert whole.top_logprobs.shape == (5, VOCAB)
    assert np.allclose(np.exp(whole.top_logprobs.astype(np.float64)).sum(1), 1.0, atol=1e-5)
    filtered = processed.score_tokens([ids[:6]], temperature=T, top_k=10, top_logprobs=12)[0]
    assert np.isinf(filtered.top_logprobs[:, 10:]).all() and np.isfinite(filtered.top_logprobs[:, :10]).all()
    plain = processed.score_tokens([ids[:6]])[0]  # T = 1, no filter: the raw distribution
    assert (
        np.abs(plain.logprobs - reference(model, ids[:6])[torch.arange(5), torch.tensor(ids[1:6])].numpy()).max() < TOL
    )


def test_score_tokens_refuses_bad_input_and_the_engine_goes_on(model, ids):
    llm = LLM(
        str(model),
        kv_cache_memory_bytes=1 << 22,
        max_logprobs=K,
        max_model_len=128,
        max_num_batched_tokens=128,
        max_num_seqs=8,
    )
    for bad, match in [
        (dict(sequences=[]), "at least one"),
        (dict(sequences=[[]]), "empty"),
        (dict(sequences=[[1, VOCAB]]), "out of range"),
        (dict(sequences=[[1, -1]]), "out of range"),
        (dict(sequences=[[1] * 129]), "max_model_len"),
        (dict(sequences=[ids], top_logprobs=K + 1), "max_logprobs"),
        (dict(sequences=[ids], top_logprobs=-1), "max_logprobs"),
        (dict(sequences=[ids], temperature=-0.5), "temperature"),
        (dict(sequences=[ids], temperature=0.0), "temperature"),
        (dict(sequences=[ids], top_p=0.0), "top_p"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.score_tokens(**bad)
    alone = llm.score_tokens([ids], top_logprobs=K)[0]
    assert alone.top_ids.shape == (len(ids) - 1, K)
    calls = []
    llm.llm_engine.executor.collective_rpc = lambda *a, _rpc=llm.llm_engine.executor.collective_rpc, **kw: (
        calls.append(a[0]),
        _rpc(*a, **kw),
    )[1]
    several = llm.score_tokens([ids] * 5, top_logprobs=K)  # passes of at most max_num_batched_tokens = 128
    del llm.llm_engine.executor.collective_rpc
    per_pass = 128 // len(ids)
    assert 1 < per_pass < 5 and calls.count("execute_model") == -(-5 // per_pass)
    for s in several:
        assert np.abs(s.top_logprobs - alone.top_logprobs).max() < 1e-5
        assert np.abs(s.logprobs - alone.logprobs).max() < 1e-5
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.pause_generation("keep")
    assert llm.score_tokens([ids[:4]])[0].logprobs.shape == (3,)  # a paused engine still scores
    llm.resume_generation()


# ---- the deterministic mode: the trainer's forward, bit for bit ------------------------------------------------


@pytest.mark.cpu_only
def test_deterministic_mode_is_bitwise_the_trainers_forward(model, ids):
    """deterministic=True, processed_logprobs: score_tokens' top-256 and whole-vocabulary rows, and generate's
    prompt and sampled top-256, are torch.equal to `sequence_logprobs(trainer, [seq], temperature=0.7)`."""
    from transformers import AutoModelForCausalLM

    from hotswap.train.logprobs import sequence_logprobs

    trainer = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    llm = LLM(
        str(model),
        deterministic=True,
        kv_cache_memory_bytes=1 << 24,
        max_logprobs=-1,
        logprobs_mode="processed_logprobs",
    )
    try:
        scored = llm.score_tokens([ids, ids[:9]], temperature=T, top_logprobs=K)
        whole = llm.score_tokens([ids], temperature=T, top_logprobs=-1)[0]
        out = llm.generate(
            {"prompt_token_ids": ids},
            SamplingParams(temperature=T, seed=2, max_tokens=6, ignore_eos=True, logprobs=K, prompt_logprobs=K),
            use_tqdm=False,
        )[0]
    finally:
        llm.shutdown()
    with torch.no_grad():
        for seq, s in zip([ids, ids[:9]], scored, strict=True):
            ref = sequence_logprobs(trainer, [torch.tensor(seq)], temperature=T)[0]
            n = len(seq) - 1
            assert torch.equal(torch.from_numpy(s.logprobs), ref[torch.arange(n), torch.tensor(seq[1:])])
            assert torch.equal(torch.from_numpy(s.top_logprobs), ref.topk(K).values)
            assert torch.equal(ref.gather(1, torch.from_numpy(s.top_ids).long()), torch.from_numpy(s.top_logprobs))
        ref = sequence_logprobs(trainer, [torch.tensor(ids)], temperature=T)[0]
        assert torch.equal(torch.from_numpy(whole.top_logprobs), ref.sort(dim=-1, descending=True).values)
        c = out.outputs[0]
        seq = ids + list(c.token_ids)
        ref = sequence_logprobs(trainer, [torch.tensor(seq)], temperature=T)[0]
    for pos, entry in enumerate([*out.prompt_logprobs[1:], *c.logprobs]):
        top_ids, top_values = top_of(entry, seq[pos + 1], K)
        assert torch.equal(torch.tensor(top_values), ref[pos].topk(K).values)
        assert torch.equal(ref[pos, torch.tensor(top_ids)], torch.tensor(top_values))
        assert entry[seq[pos + 1]].logprob == ref[pos, seq[pos + 1]].item()


# ---- the compact form ----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_compact_arrays_round_trip_their_bits_and_rebuild_vllm_entries():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(7, 300, generator=gen).log_softmax(-1)
    values[2, 5] = float("-inf")
    top = values.topk(4)
    obj = compact(list(range(7)), values[:, 0], [1] * 7, top.indices, top.values)
    back = decode(obj)
    assert obj["k"] == 4 and obj["num_positions"] == 7
    assert np.array_equal(back["top_logprobs"].view(np.int32), top.values.numpy().view(np.int32))
    assert np.array_equal(back["top_ids"], top.indices.numpy()) and back["logprobs"][2] == values[2, 0]
    assert base64.b64decode(obj["top_logprobs"])[:4] == np.float32(top.values[0, 0]).tobytes()  # little-endian
    # a vLLM entry (the scored token first, then the top k) gives the same top arrays, the token outside them
    entries = [
        {9: Logprob(-9.0, 10), 1: Logprob(-0.1, 1), 2: Logprob(-0.2, 2)},
        {2: Logprob(-0.2, 2), 1: Logprob(-0.1, 1)},
    ]
    rebuilt = decode(entries_compact([9, 2], entries, 2))
    assert rebuilt["top_ids"].tolist() == [[1, 2], [1, 2]] and rebuilt["ranks"].tolist() == [10, 2]
    assert rebuilt["logprobs"].tolist() == [-9.0, np.float32(-0.2)]


@pytest.mark.unit
def test_prompt_rows_and_sampled_rows_share_one_function():
    """`prompt_logprobs_of` with a processed spec is `reported(...)` row by row: a sampled row with the same
    spec reports the same bits; one topk per distinct K gives each row what a topk of its own gives."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 600, generator=gen) * 3
    spec = SampleSpec(temperature=T, top_p=0.9, num_logprobs=K)
    ask = PromptLogprobsAsk(0, K, [3, 4, 5, 6, 7], SampleSpec(temperature=T, top_p=0.9), "processed_logprobs")
    prompt = prompt_logprobs_of(logits, ask.targets, ask)
    from hotswap.model.layers.sampler import reported

    values = reported(logits, [spec] * 5, "processed_logprobs")
    sampled = results_for(values, torch.tensor(ask.targets), [spec] * 5)
    for j, res in enumerate(sampled):
        assert res.logprob == prompt.logprobs[j] and res.rank == prompt.ranks[j]
        assert res.top_logprobs == prompt.top_logprobs[j] and res.top_ids == prompt.top_ids[j]
    mixed = results_for(values, torch.tensor(ask.targets), [SampleSpec(num_logprobs=k) for k in (2, K, 2, 0, None)])
    for j, k in enumerate((2, K, 2)):
        assert mixed[j].top_logprobs == values[j].topk(k).values.tolist()
    assert mixed[3].top_ids is None and mixed[3].rank is not None and mixed[4].rank is None
    raw = prompt_logprobs_of(logits, ask.targets, PromptLogprobsAsk(0, 3, ask.targets))
    assert raw.logprobs == logits.log_softmax(-1)[torch.arange(5), torch.tensor(ask.targets)].tolist()


# ---- over HTTP -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model):
    with running_server(
        str(model),
        "--admin-auth",
        "none",
        "--kv-cache-memory-bytes",
        str(1 << 23),
        "--max-logprobs",
        "-1",
        "--logprobs-mode",
        "processed_logprobs",
        "--served-model-name",
        "m",
    ) as base:
        yield base


def bits(values) -> np.ndarray:
    """float32 values (JSON numbers or an array) as their int32 bit patterns."""
    return np.asarray(values, dtype=np.float32).view(np.int32)


def test_base64_logprobs_decode_to_exactly_the_json_values(server, ids, model):
    """completions (sampled + prompt, top-256) and chat (top-256): the same request with logprobs_format
    "base64" gives arrays whose float32 bits are the JSON form's numbers; the JSON fields are left out."""
    body = dict(
        model="m",
        prompt=ids,
        max_tokens=6,
        temperature=T,
        seed=4,
        ignore_eos=True,
        logprobs=K,
        prompt_logprobs=K,
        return_token_ids=True,
        return_tokens_as_token_ids=True,
    )
    as_json = post(server, "/v1/completions", **body).json()["choices"][0]
    as_b64 = post(server, "/v1/completions", logprobs_format="base64", **body).json()["choices"][0]
    assert as_b64["logprobs"] is None and "prompt_logprobs" not in as_b64
    out = decode(as_b64["logprobs_b64"])
    assert out["token_ids"].tolist() == as_json["token_ids"] == as_b64["token_ids"]
    assert np.array_equal(out["logprobs"].view(np.int32), bits(as_json["logprobs"]["token_logprobs"]))
    for i, top in enumerate(as_json["logprobs"]["top_logprobs"]):
        want = {int(key.split(":")[1]): v for key, v in top.items()}
        got = dict(zip(out["top_ids"][i].tolist(), out["top_logprobs"][i].tolist(), strict=True))
        assert np.array_equal(bits([got[t] for t in got]), bits([want[t] for t in got]))
        assert set(want) - set(got) <= {as_json["token_ids"][i]}
    prompt = decode(as_b64["prompt_logprobs_b64"])
    assert prompt["token_ids"].tolist() == ids[1:] and prompt["top_ids"].shape == (len(ids) - 1, K)
    for i, entry in enumerate(as_json["prompt_logprobs"][1:]):
        assert bits(entry[str(ids[i + 1])]["logprob"]) == prompt["logprobs"][i].view(np.int32)
        assert entry[str(ids[i + 1])]["rank"] == prompt["ranks"][i]
        for t, v in zip(prompt["top_ids"][i].tolist(), prompt["top_logprobs"][i].tolist(), strict=True):
            assert bits(entry[str(t)]["logprob"]) == bits(v)
    ref = reference(model, ids, T)
    assert (torch.from_numpy(prompt["top_logprobs"].copy()) - ref.topk(K).values).abs().max() < TOL

    chat = dict(
        model="m",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=5,
        temperature=T,
        seed=9,
        logprobs=True,
        top_logprobs=K,
        return_tokens_as_token_ids=True,
    )
    # two salts: neither request reuses the other's cached prompt (a cache hit computes the prompt in other chunks)
    cj = post(server, "/v1/chat/completions", cache_salt="a", **chat).json()["choices"][0]
    cb = post(server, "/v1/chat/completions", cache_salt="b", logprobs_format="base64", **chat).json()["choices"][0]
    assert cb["logprobs"] is None
    arrays = decode(cb["logprobs_b64"])
    assert arrays["top_ids"].shape == (len(cj["logprobs"]["content"]), K)
    for i, token in enumerate(cj["logprobs"]["content"]):
        assert arrays["logprobs"][i].view(np.int32) == bits(token["logprob"])
        assert [int(t["token"].split(":")[1]) for t in token["top_logprobs"]] == arrays["top_ids"][i].tolist()
        assert np.array_equal(
            bits([t["logprob"] for t in token["top_logprobs"]]), arrays["top_logprobs"][i].view(np.int32)
        )


@pytest.mark.cpu_only
def test_score_tokens_route_json_base64_and_bad_input(server, ids, model):
    """/v1/score_tokens: JSON lists and base64 arrays of the same bits, equal to transformers at T = 0.7; bad
    input is a 400 naming the problem and the server goes on serving."""
    body = dict(model="m", input_ids=[ids, ids[:7]], temperature=T, top_logprobs=K)
    as_json = post(server, "/v1/score_tokens", **body).json()
    as_b64 = post(server, "/v1/score_tokens", logprobs_format="base64", **body).json()
    assert as_json["usage"]["prompt_tokens"] == len(ids) + 7 and as_json["weight_version"] == "0"
    for seq, j, b in zip([ids, ids[:7]], as_json["data"], as_b64["data"], strict=True):
        arrays = decode(b)
        assert j["token_ids"] == seq[1:] == arrays["token_ids"].tolist() and j["k"] == b["k"] == K
        assert np.array_equal(bits(j["top_logprobs"]), arrays["top_logprobs"].view(np.int32))
        assert np.array_equal(bits(j["logprobs"]), arrays["logprobs"].view(np.int32))
        assert j["top_ids"] == arrays["top_ids"].tolist() and j["ranks"] == arrays["ranks"].tolist()
        ref = reference(model, seq, T)
        assert (torch.tensor(j["top_logprobs"]) - ref.topk(K).values).abs().max() < TOL
    filtered = post(server, "/v1/score_tokens", model="m", input_ids=[ids[:5]], top_k=3, top_logprobs=5).json()
    assert filtered["data"][0]["top_logprobs"][0][3:] == [-9999.0, -9999.0]  # -inf, as vLLM shows it in JSON
    for bad, match in [
        (dict(input_ids=[]), "input_ids"),
        (dict(input_ids=[[]]), "empty"),
        (dict(input_ids=[[1, VOCAB + 5]]), "out of range"),
        (dict(input_ids=[ids], top_logprobs=VOCAB + 1), "max_logprobs"),
        (dict(input_ids=[ids], temperature=-1.0), "temperature"),
        (dict(input_ids=[[1, True]]), "input_ids"),
    ]:
        response = post(server, "/v1/score_tokens", model="m", **bad)
        assert response.status_code == 400, (bad, response.text)
        assert match in response.json()["error"]["message"]
    assert post(server, "/v1/score_tokens", model="other", input_ids=[ids]).status_code == 404
    again = post(server, "/v1/score_tokens", **body).json()
    assert again["data"][0]["top_logprobs"] == as_json["data"][0]["top_logprobs"]
    done = httpx.post(f"{server}/v1/completions", json=dict(model="m", prompt="hi", max_tokens=3), timeout=60)
    assert done.status_code == 200
