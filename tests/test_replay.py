"""Routing replay and sampling masks (docs/replay.md).

Routed experts: every row a completion returns equals the top-k of transformers' router logits for the same
tokens (as a set per layer; a row whose k-th and (k+1)-th probabilities are within 1e-5 of each other may pick
either), for Qwen3-MoE and Mixtral, through prefix-cache hits, chunked prefill, forced preemption, speculation,
n=2, an abort, an update mid-request (each row against the weights that computed it), and expert parallelism.
Forced routes change the prompt logprobs exactly as transformers under `hotswap.train.replay_routes`. Sampling
masks equal the kept set computed from transformers' logits for top-k, top-p and min-p. Over HTTP, both vLLM's
and SGLang's shapes decode as slime and verl decode them."""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM, SamplingParams
from hotswap.testing import make_tiny_model
from hotswap.train import replay_routes
from hotswap.transfer.tensors import tensors_update_info

KV = 1 << 23
TIE = 1e-5  # a router margin below this may pick either expert


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


PROMPTS = [prompt_ids(n, seed) for seed, n in enumerate((37, 9, 23, 50))]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("replay")
    return {
        "qwen3_moe": make_tiny_model(root / "q", "qwen3_moe", seed=0),
        "qwen3_moe_B": make_tiny_model(root / "qB", "qwen3_moe", seed=1),
        "mixtral": make_tiny_model(root / "m", "mixtral", seed=0),
        "llama": make_tiny_model(root / "l", "llama", seed=0),
    }


_hf: dict[str, torch.nn.Module] = {}


def hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _hf:
        _hf[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _hf[key]


def hf_routes(path: Path, ids: list[int], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' top-k experts per token and layer [T, L, k] (sorted), and the margin between the k-th and
    the (k+1)-th probability [T, L]."""
    with torch.no_grad():
        out = hf(path)(torch.tensor([ids]), output_router_logits=True)
    probs = torch.stack([r.float() for r in out.router_logits], dim=1).softmax(dim=-1)  # [T, L, E]
    top = probs.topk(top_k + 1, dim=-1)
    return top.indices[..., :top_k].sort(dim=-1).values, top.values[..., top_k - 1] - top.values[..., top_k]


def assert_routes_match(path: Path, prompt: list[int], completion, rows_from=None) -> None:
    """The completion's routes have one row per token run forward and equal transformers' top-k on the whole
    sequence (near ties aside). `rows_from(p)`: the checkpoint that computed row p (default `path`)."""
    routes = completion.routed_experts
    ids = list(prompt) + list(completion.token_ids)
    assert routes is not None and routes.shape[0] == len(ids) - 1, None if routes is None else routes.shape
    assert routes.dtype == np.uint8
    mine = torch.from_numpy(routes.astype(np.int64)).sort(dim=-1).values
    sources = {rows_from(p) if rows_from else path for p in range(len(ids) - 1)}
    expected = {src: hf_routes(src, ids, routes.shape[2]) for src in sources}
    mismatched = 0
    for p in range(len(ids) - 1):
        top, margin = expected[rows_from(p) if rows_from else path]
        for layer in range(routes.shape[1]):
            if not torch.equal(mine[p, layer], top[p, layer]):
                assert margin[p, layer] < TIE, f"row {p} layer {layer}: {mine[p, layer]} != {top[p, layer]}"
                mismatched += 1
    assert mismatched <= max(1, routes.shape[0] * routes.shape[1] // 100)


def generate(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


ROUTES = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, return_routed_experts=True)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_routes_equal_transformers_and_a_prefix_cache_hit_returns_the_same(moe, arch):
    llm = LLM(str(moe[arch]), kv_cache_memory_bytes=KV, block_size=8)
    first = generate(llm, PROMPTS, ROUTES)
    for prompt, out in zip(PROMPTS, first, strict=True):
        assert_routes_match(moe[arch], prompt, out.outputs[0])
    again = generate(llm, PROMPTS, ROUTES)
    assert all(out.num_cached_tokens > 0 for out, p in zip(again, PROMPTS, strict=True) if len(p) > 8)
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(a.outputs[0].routed_experts, b.outputs[0].routed_experts)
    plain = generate(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    assert plain.routed_experts is None  # only asked for


def test_blocks_cached_without_routes_are_computed_again_for_a_request_that_wants_them(moe):
    llm = LLM(str(moe["qwen3_moe"]), kv_cache_memory_bytes=KV, block_size=8)
    generate(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4))
    out = generate(llm, PROMPTS[:1], ROUTES)[0]
    assert out.num_cached_tokens == 0
    assert_routes_match(moe["qwen3_moe"], PROMPTS[0], out.outputs[0])
    assert generate(llm, PROMPTS[:1], ROUTES)[0].num_cached_tokens > 0  # now cached with its routes


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("scenario", ["chunked", "preempted", "ngram", "n2_seeded"])
def test_routes_hold_through_scheduling(moe, scenario, arch):
    path = moe[arch]
    kwargs: dict = {"kv_cache_memory_bytes": KV}
    params = ROUTES
    if scenario == "chunked":
        kwargs.update(max_num_batched_tokens=16, long_prefill_token_threshold=8, max_num_seqs=4)
    elif scenario == "preempted":
        kwargs.update(block_size=4, num_kv_blocks=24, max_model_len=80, max_num_batched_tokens=64, max_num_seqs=4)
    elif scenario == "ngram":
        kwargs.update(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    else:
        params = SamplingParams(
            n=2, temperature=1.0, seed=7, max_tokens=12, return_routed_experts=True, ignore_eos=True
        )
    llm = LLM(str(path), **kwargs)
    prompts = PROMPTS if scenario != "ngram" else [p[:8] * 4 for p in PROMPTS]  # repeats to propose from
    outs = generate(llm, prompts, params)
    stats = llm.llm_engine.stats()
    if scenario == "preempted":
        assert stats["num_preemptions"] > 0
    if scenario == "ngram":
        assert stats["spec_accepted_tokens"] > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs) == params.n
        for c in out.outputs:
            assert_routes_match(path, prompt, c)


def test_an_abort_returns_the_routes_of_the_tokens_so_far(moe):
    llm = LLM(str(moe["qwen3_moe"]), kv_cache_memory_bytes=KV)
    engine = llm.llm_engine
    engine.add_request("r", None, PROMPTS[0], ROUTES)
    for _ in range(4):
        engine.step()
    out = engine.abort_request("r")
    c = out.outputs[0]
    assert c.finish_reason == "abort" and len(c.token_ids) == 4
    assert_routes_match(moe["qwen3_moe"], PROMPTS[0], c)


def test_an_update_mid_request_gives_each_row_from_the_weights_that_computed_it(moe):
    """Three tokens on A, then B committed under a 'keep' pause that clears the cache: the sequence is recomputed
    on B, the rows of the passes that sampled A's tokens stay A's, the later rows are B's (the version spans say
    which token came from which)."""
    a, b = moe["qwen3_moe"], moe["qwen3_moe_B"]
    llm = LLM(str(a), kv_cache_memory_bytes=KV)
    engine = llm.llm_engine
    engine.add_request("r", None, PROMPTS[2], ROUTES)
    for _ in range(3):
        engine.step()
    llm.pause_generation("keep", clear_cache=True)
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(list(load_file(str(b / "model.safetensors")).items())))
    llm.finish_weight_update()
    llm.resume_generation()
    final: list = []
    while not final:
        final = engine.step()
    c = final[0].outputs[0]
    assert [(s.version, s.start_token, s.end_token) for s in c.weight_versions] == [(0, 0, 3), (1, 3, 12)]
    first_b_row = len(PROMPTS[2]) - 1 + 3  # the pass that sampled output token 3
    assert_routes_match(a, PROMPTS[2], c, rows_from=lambda p: a if p < first_b_row else b)


def test_forced_routes_change_prompt_logprobs_as_transformers_replay_does(moe):
    for arch in ("qwen3_moe", "mixtral"):
        path = moe[arch]
        llm = LLM(str(path), kv_cache_memory_bytes=KV)
        layers, top_k, experts = llm.llm_engine.routing_shape
        ids = PROMPTS[0]
        rng = np.random.default_rng(0)
        forced = np.stack(
            [np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)]) for _ in range(len(ids) - 1)]
        )
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, forced_routed_experts=forced)
        forced_out = generate(llm, [ids], params)[0]
        natural_out = generate(llm, [ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
        mine = torch.tensor(
            [entry[t].logprob for entry, t in zip(forced_out.prompt_logprobs[1:], ids[1:], strict=True)]
        )
        natural = torch.tensor(
            [entry[t].logprob for entry, t in zip(natural_out.prompt_logprobs[1:], ids[1:], strict=True)]
        )
        x = torch.tensor([ids])
        with torch.no_grad(), replay_routes(hf(path), [forced], (1, len(ids))):
            reference = hf(path)(x).logits[0, :-1].float().log_softmax(-1).gather(1, x[0, 1:, None]).squeeze(1)
        assert (mine - natural).abs().max() > 0.1  # the forced experts matter
        torch.testing.assert_close(mine, reference, atol=1e-4, rtol=0)
        with torch.no_grad():  # outside the block the router chooses again
            restored = hf(path)(x).logits[0, :-1].float().log_softmax(-1).gather(1, x[0, 1:, None]).squeeze(1)
        torch.testing.assert_close(natural, restored, atol=1e-4, rtol=0)


def test_recorded_routes_replayed_in_the_trainer_give_its_own_forward(moe):
    """Routes an engine rollout recorded, replayed in transformers, leave its logprobs as they are (they are its own
    choices): what R3 relies on."""
    path = moe["qwen3_moe"]
    llm = LLM(str(path), kv_cache_memory_bytes=KV)
    out = generate(
        llm,
        PROMPTS[:2],
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, return_routed_experts=True),
    )
    seqs = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS[:2], out, strict=True)]
    width = max(map(len, seqs))
    x = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    model = hf(path)
    with torch.no_grad():
        natural = model(x, attention_mask=mask).logits
        with replay_routes(model, [o.outputs[0].routed_experts for o in out], tuple(x.shape)):
            replayed = model(x, attention_mask=mask).logits
    for i, s in enumerate(seqs):
        torch.testing.assert_close(replayed[i, : len(s) - 1], natural[i, : len(s) - 1], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.zeros((3, 2, 3), dtype=np.int64), r"this model needs \[tokens, 2, 2\]"),
        (np.full((3, 2, 2), 9), r"outside \[0, 8\)"),
        (np.zeros((100, 2, 2), dtype=np.int64), "at most one row per prompt token"),
        (np.zeros((3, 2, 2), dtype=np.int64), "names an expert twice"),
        ([[[0.5, 1.0]]], "integer expert ids"),
    ],
)
def test_bad_forced_routes_are_refused_naming_the_problem(moe, bad, message):
    llm = LLM(str(moe["qwen3_moe"]), kv_cache_memory_bytes=KV)
    with pytest.raises(ValueError, match=message):
        generate(llm, PROMPTS[:1], SamplingParams(max_tokens=1, forced_routed_experts=bad))
    dense = LLM(str(moe["llama"]), kv_cache_memory_bytes=KV)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        generate(dense, PROMPTS[:1], SamplingParams(max_tokens=1, return_routed_experts=True))
    assert generate(llm, PROMPTS[:1], ROUTES)[0].outputs[0].routed_experts is not None  # still serving


def kept_from_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> tuple[set[int], set[int]]:
    """The kept set by the definitions (vLLM's order: min-p, then top-k, then top-p over what is left), and the
    tokens at a boundary (within TIE of a threshold) that may fall either way."""
    probs = (logits / temperature).softmax(-1).double()
    keep = torch.ones_like(probs, dtype=torch.bool)
    ambiguous: set[int] = set()
    if min_p > 0:
        threshold = probs.max() * min_p
        keep &= probs >= threshold
        ambiguous |= set(((probs - threshold).abs() < TIE).nonzero().flatten().tolist())
    order = probs.masked_fill(~keep, -1).argsort(descending=True)
    if top_k > 0:
        keep[order[top_k:]] = False
        ambiguous |= set(((probs - probs[order[top_k - 1]]).abs() < TIE).nonzero().flatten().tolist())
    if top_p < 1:
        p = probs.masked_fill(~keep, 0)
        p = p / p.sum()
        sorted_p = p[order]
        before = sorted_p.cumsum(0) - sorted_p  # mass ahead of each token
        cut = before >= top_p
        cut[0] = False
        keep[order[cut]] = False
        ambiguous |= set(order[(before - top_p).abs() < TIE].tolist())
    return set(keep.nonzero().flatten().tolist()), ambiguous


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(20, 1.0, 0.0), (-1, 0.6, 0.0), (-1, 1.0, 0.3), (50, 0.8, 0.05)],
    ids=["top_k", "top_p", "min_p", "all_three"],
)
def test_sampling_masks_equal_the_kept_set_from_transformers_logits(moe, top_k, top_p, min_p):
    path = moe["qwen3_moe"]
    llm = LLM(str(path), kv_cache_memory_bytes=KV)
    params = SamplingParams(
        n=2,
        temperature=0.8,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=11,
        max_tokens=6,
        ignore_eos=True,
        return_sampling_mask=True,
    )
    for prompt, out in zip(PROMPTS[:2], generate(llm, PROMPTS[:2], params), strict=True):
        for c in out.outputs:
            mask = c.sampling_mask
            assert mask is not None and len(mask.full) == len(c.token_ids) and not any(mask.full)
            ids = prompt + c.token_ids
            with torch.no_grad():
                logits = hf(path)(torch.tensor([ids])).logits[0].float()
            for i, token in enumerate(c.token_ids):
                kept = mask.row(i)
                assert kept == sorted(kept) and token in kept
                expected, ambiguous = kept_from_logits(logits[len(prompt) - 1 + i], 0.8, top_k, top_p, min_p)
                assert set(kept) ^ expected <= ambiguous, (i, sorted(set(kept) ^ expected))


def test_full_vocabulary_and_greedy_tokens_are_marked_whole(moe):
    llm = LLM(
        str(moe["qwen3_moe"]),
        kv_cache_memory_bytes=KV,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    for params in (
        SamplingParams(temperature=0.0, max_tokens=4, return_sampling_mask=True),
        SamplingParams(temperature=1.0, seed=1, max_tokens=4, return_sampling_mask=True),
        # min_tokens bans EOS, but no filter is on: still the whole-vocabulary marker, not V-1 ids
        SamplingParams(temperature=1.0, seed=1, max_tokens=4, min_tokens=4, return_sampling_mask=True),
    ):
        c = generate(llm, PROMPTS[:1], params)[0].outputs[0]
        assert c.sampling_mask.full == [True] * 4 and c.sampling_mask.token_ids == []
        assert [c.sampling_mask.row(i) for i in range(4)] == [None] * 4
    c = generate(
        llm,
        [PROMPTS[0][:6] * 4],
        SamplingParams(temperature=1.0, top_k=5, seed=1, max_tokens=8, ignore_eos=True, return_sampling_mask=True),
    )[0].outputs[0]
    assert all(len(c.sampling_mask.row(i)) == 5 and t in c.sampling_mask.row(i) for i, t in enumerate(c.token_ids))


@pytest.mark.slow
def test_routes_under_expert_parallelism_are_global_ids(tmp_path):
    path = make_tiny_model(tmp_path / "m7", "qwen3_moe", seed=0, num_experts=7)
    llm = LLM(str(path), kv_cache_memory_bytes=KV, tensor_parallel_size=2, enable_expert_parallel=True)
    outs = generate(llm, PROMPTS[:2], ROUTES)
    for prompt, out in zip(PROMPTS[:2], outs, strict=True):
        assert_routes_match(path, prompt, out.outputs[0])
    assert max(int(o.outputs[0].routed_experts.max()) for o in outs) >= 4  # rank 1's experts appear by global id
    llm.shutdown()


def test_http_shapes_decode_as_slime_and_verl_decode_them(moe):
    import httpx

    from server_helpers import running_server

    path = moe["qwen3_moe"]
    reference = generate(LLM(str(path), kv_cache_memory_bytes=KV), PROMPTS[:1], ROUTES)[0].outputs[0]
    layers, top_k = reference.routed_experts.shape[1:]
    with running_server(str(path), "--kv-cache-memory-bytes", str(KV)) as base:
        # vLLM's completions: a base64 .npy per choice (decoded as prime-rl / SkyRL do)
        body = {
            "model": Path(path).name,
            "prompt": PROMPTS[0],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "return_routed_experts": True,
            "return_token_ids": True,
        }
        choice = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
        routes = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"], validate=True)), allow_pickle=False)
        assert np.array_equal(routes, reference.routed_experts)
        # SGLang's /generate: flat int32 from routed_experts_start_len on (decoded as slime does)
        gen = {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            "return_routed_experts": True,
            "routed_experts_start_len": 5,
        }
        meta = httpx.post(f"{base}/generate", json=gen, timeout=60).json()["meta_info"]
        flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        assert meta["routed_experts_start_len"] == 5
        assert np.array_equal(flat.reshape(-1, layers, top_k), reference.routed_experts[5:].astype(np.int32))
        # streamed: the routes come with the final chunk only
        chunks = []
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0])
        assert [("routed_experts" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert chunks[-1]["finish_reason"] == "length"
        streamed = np.load(io.BytesIO(base64.b64decode(chunks[-1]["routed_experts"])), allow_pickle=False)
        assert np.array_equal(streamed, reference.routed_experts)
        # sampling masks: vLLM's per-token lists and SGLang's CSR (slime's custom_params key)
        body = {
            **body,
            "temperature": 1.0,
            "top_k": 7,
            "seed": 2,
            "return_sampling_mask": True,
            "return_routed_experts": False,
        }
        choice = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert "routed_experts" not in choice
        assert all(
            len(row) == 7 and t in row for row, t in zip(choice["sampling_mask"], choice["token_ids"], strict=True)
        )
        gen = {
            "input_ids": PROMPTS[0],
            "sampling_params": {
                "max_new_tokens": 6,
                "temperature": 1.0,
                "top_p": 0.5,
                "custom_params": {"return_top_p_token_ids": True},
            },
        }
        result = httpx.post(f"{base}/generate", json=gen, timeout=60).json()
        ids, offsets = result["meta_info"]["top_p_token_ids"], result["meta_info"]["top_p_token_offsets"]
        assert len(offsets) == len(result["output_ids"]) + 1
        assert all(t in ids[offsets[i] : offsets[i + 1]] for i, t in enumerate(result["output_ids"]))
        # forced routes over HTTP: vLLM's own base64 .npy shape; a bad one is a 400 naming the problem
        forced = {
            "model": Path(path).name,
            "prompt": PROMPTS[0],
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "forced_routed_experts": choice_npy(reference.routed_experts[: len(PROMPTS[0])]),
        }
        assert httpx.post(f"{base}/v1/completions", json=forced, timeout=60).status_code == 200
        bad = {**forced, "forced_routed_experts": [[[0, 0]] * layers]}
        refused = httpx.post(f"{base}/v1/completions", json=bad, timeout=60)
        assert refused.status_code == 400 and "twice" in refused.text
        bad_sgl = {"input_ids": PROMPTS[0], "forced_routed_experts": "not base64!"}
        refused = httpx.post(f"{base}/generate", json=bad_sgl, timeout=60)
        assert refused.status_code == 400 and "base64" in refused.text


def choice_npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()
