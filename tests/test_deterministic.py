"""Deterministic mode: a request's tokens and logprobs are the same bits whatever else runs ("needle in a batch"),
and `hotswap.train.token_logprobs` on the trainer's transformers model equals them. Every comparison is
`torch.equal` on float64 tensors built from the float32 values (exact)."""

from __future__ import annotations

import contextlib
import copy
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hotswap import LLM, SamplingParams
from hotswap.config import EngineConfig
from hotswap.testing import make_tiny_model
from hotswap.train import replay_routes, token_logprobs

KV = 1 << 24
NEEDLE = "the quick brown fox jumps over the lazy dog and then"
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=5),
    "seeded": SamplingParams(
        temperature=0.9, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=5
    ),
}
KINDS = ["dense", "moe", "fp8", "moe_fp8"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("det")
    return {
        "dense": make_tiny_model(root / "dense", seed=0),
        "dense_B": make_tiny_model(root / "dense_B", seed=1),
        "moe": make_tiny_model(root / "moe", arch="qwen3_moe", seed=0),
        "moe_B": make_tiny_model(root / "moe_B", arch="qwen3_moe", seed=1),
    }


def engine_kwargs(kind: str) -> dict[str, Any]:
    if kind == "moe_fp8":  # block scales: per-row scales of experts would differ between one rank and two
        return {"quantization": "fp8", "weight_block_size": (8, 8)}
    return {"quantization": "fp8"} if kind == "fp8" else {}


def model_of(models: dict[str, Path], kind: str, which: str = "") -> Path:
    return models[("moe" if kind.startswith("moe") else "dense") + which]


def det_llm(models: dict[str, Path], kind: str, which: str = "", **kwargs: Any) -> LLM:
    kwargs = {"kv_cache_memory_bytes": KV, **engine_kwargs(kind), **kwargs}
    return LLM(str(model_of(models, kind, which)), deterministic=True, **kwargs)


_engines: dict[str, LLM] = {}


def base(models: dict[str, Path], kind: str) -> LLM:
    """One deterministic engine per model kind, shared by the tests of this module."""
    if kind not in _engines:
        _engines[kind] = det_llm(models, kind)
    return _engines[kind]


def signature(out: Any, prompt: bool = True) -> dict[str, torch.Tensor]:
    """Everything a request returns that deterministic mode promises, as exact tensors."""
    c = out.outputs[0]
    sampled = [d[t] for d, t in zip(c.logprobs, c.token_ids, strict=True)]
    found = {
        "tokens": torch.tensor(c.token_ids),
        "logprobs": torch.tensor([lp.logprob for lp in sampled], dtype=torch.float64),
        "top_ids": torch.tensor([sorted(d) for d in c.logprobs]),
        "top_logprobs": torch.tensor([[d[k].logprob for k in sorted(d)] for d in c.logprobs], dtype=torch.float64),
    }
    if prompt:
        rows = out.prompt_logprobs[1:]
        found["prompt_ids"] = torch.tensor([sorted(d) for d in rows])
        found["prompt_logprobs"] = torch.tensor([[d[k].logprob for k in sorted(d)] for d in rows], dtype=torch.float64)
    return found


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for key in want:
        assert torch.equal(got[key], want[key]), f"{what}: {key} differs"


def others(n: int, seed: int) -> list[tuple[dict[str, Any], SamplingParams]]:
    """n random requests: prompts of 1-40 token ids, 1-16 new tokens, greedy or sampled, some with logprobs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(1, 41))]}
        params = SamplingParams(
            temperature=rng.choice([0.0, 1.0]),
            max_tokens=rng.randrange(1, 17),
            ignore_eos=True,
            logprobs=rng.choice([None, 2]),
        )
        out.append((prompt, params))
    return out


def needle_in(
    llm: LLM, mode: str, crowd: list[tuple[dict[str, Any], SamplingParams]], at: int
) -> dict[str, torch.Tensor]:
    prompts: list[Any] = [p for p, _ in crowd]
    params = [s for _, s in crowd]
    prompts.insert(at, NEEDLE)
    params.insert(at, PARAMS[mode])
    return signature(llm.generate(prompts, params, use_tqdm=False)[at])


def alone(llm: LLM, mode: str) -> dict[str, torch.Tensor]:
    return needle_in(llm, mode, [], 0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_is_the_same_bits_in_any_batch_at_any_place(models, kind):
    llm = base(models, kind)
    for mode in PARAMS:
        want = alone(llm, mode)
        for n, at in ((1, 1), (7, 3), (63, 0), (255, 255)):
            assert_same(needle_in(llm, mode, others(n, seed=n), at), want, f"{kind} {mode} among {n} at {at}")


@pytest.mark.parametrize("kind", KINDS)
def test_chunking_caching_preemption_and_speculation_change_no_bit(models, kind):
    llm = base(models, kind)
    want = {mode: alone(llm, mode) for mode in PARAMS}
    # a prefix-cache hit (requests with prompt logprobs never take one: the prompt's rows must be computed)
    for mode in PARAMS:
        params = copy.copy(PARAMS[mode])
        params.prompt_logprobs = None
        miss, hit = (llm.generate([NEEDLE], params, use_tqdm=False)[0] for _ in range(2))
        assert hit.num_cached_tokens > 0
        expected = {k: v for k, v in want[mode].items() if not k.startswith("prompt")}
        assert_same(signature(miss, prompt=False), expected, f"{kind} {mode} on a cache miss")
        assert_same(signature(hit, prompt=False), expected, f"{kind} {mode} on a cache hit")
    variants = {
        "chunked prefill of 4 tokens a step": {"max_num_batched_tokens": 4, "max_num_seqs": 4, "block_size": 4},
        "ngram speculation": {
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
        },
    }
    if kind == "dense":
        variants["draft speculation"] = {
            "speculative_config": {
                "method": "draft_model",
                "model": str(models["dense_B"]),
                "num_speculative_tokens": 3,
            }
        }
    for what, kwargs in variants.items():
        other = det_llm(models, kind, **kwargs)
        try:
            for mode in PARAMS:
                assert_same(alone(other, mode), want[mode], f"{kind} {mode} with {what}")
        finally:
            other.shutdown()
    # preemption: a cache of 12 blocks of 8 that the crowd outgrows; the needle is recomputed at least once
    per_block = 2 * 2 * 8 * 2 * 16 * 4  # K and V, layers, block, kv heads, head dim, fp32
    crowded = det_llm(
        models,
        kind,
        block_size=8,
        max_model_len=96,
        kv_cache_memory_bytes=12 * per_block,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )
    try:
        crowd = [
            (
                {"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(30)]},
                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            )
            for i in range(6)
        ]
        for mode in PARAMS:
            assert_same(needle_in(crowded, mode, crowd, 0), want[mode], f"{kind} {mode} with preemption")
        assert crowded.llm_engine.stats()["num_preemptions"] > 0
    finally:
        crowded.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_equal_one(models, kind):
    want = {mode: alone(base(models, kind), mode) for mode in PARAMS}
    tp2 = det_llm(models, kind, tensor_parallel_size=2)
    try:
        for mode in PARAMS:
            assert_same(alone(tp2, mode), want[mode], f"{kind} {mode} on two ranks")
            assert_same(needle_in(tp2, mode, others(7, seed=7), 3), want[mode], f"{kind} {mode} on two ranks, batched")
    finally:
        tp2.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_an_update_equals_a_fresh_engine_on_the_new_weights(models, kind):
    fresh = det_llm(models, kind, "_B")
    try:
        want = {mode: alone(fresh, mode) for mode in PARAMS}
    finally:
        fresh.shutdown()
    llm = det_llm(models, kind)
    try:
        before = alone(llm, "greedy")
        llm.reload_weights(weights_path=str(model_of(models, kind, "_B")))
        for mode in PARAMS:
            assert_same(alone(llm, mode), want[mode], f"{kind} {mode} after an update")
        assert not torch.equal(before["logprobs"], want["greedy"]["logprobs"])  # the update changed something
    finally:
        llm.shutdown()


# ---- the trainer's forward ----------------------------------------------------------------------------------


def hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def rollouts(llm: LLM, routes: bool = False) -> tuple[list[list[int]], list[torch.Tensor], list[Any] | None]:
    """Three prompts of unequal lengths, one sampled continuation each: the token ids, and the engine's logprob
    of every token after the first (prompt logprobs, then the sampled tokens'); with `routes`, also the experts
    each token but the last went through ([tokens - 1, sparse layers, top_k], a mixture-of-experts model)."""
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=10,
        ignore_eos=True,
        logprobs=0,
        prompt_logprobs=0,
        return_routed_experts=routes,
    )
    outs = llm.generate(["hello world", NEEDLE, "a b c d e f g"], params, use_tqdm=False)
    seqs, logprobs = [], []
    for o in outs:
        c = o.outputs[0]
        seqs.append(list(o.prompt_token_ids) + list(c.token_ids))
        values = [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)]
        values += [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]
        logprobs.append(torch.tensor(values, dtype=torch.float32))
    return seqs, logprobs, [o.outputs[0].routed_experts for o in outs] if routes else None


def padded(seqs: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs)) + 2
    ids = torch.full((len(seqs), width), 7, dtype=torch.long)  # padding holds a real token id: it must not count
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        start = width - len(s) if left else 0
        ids[i, start : start + len(s)] = torch.tensor(s)
        mask[i, start : start + len(s)] = 1
    return ids, mask


def routes_of_padded(routes: list[Any], seqs: list[list[int]], ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The engine's routes placed on a left-padded batch: [batch, width, sparse layers, top_k], -1 (the router
    chooses) on padding and on each sequence's last token (which no logprob depends on)."""
    layers, top_k = np.asarray(routes[0]).shape[1:]
    out = torch.full((*ids.shape, layers, top_k), -1, dtype=torch.long)
    for i, (r, s) in enumerate(zip(routes, seqs, strict=True)):
        first = int(mask[i].nonzero()[0])
        out[i, first : first + len(s) - 1] = torch.as_tensor(np.asarray(r), dtype=torch.long)
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_token_logprobs_equals_the_engine_bit_for_bit_and_back_propagates(models, kind):
    seqs, want, routes = rollouts(base(models, kind), routes=kind == "moe")
    trainer = hf(model_of(models, kind))
    for left in (True, False):
        ids, mask = padded(seqs, left)
        got = token_logprobs(trainer, ids, mask)
        assert got.shape == (len(seqs), ids.shape[1] - 1)
        for i, s in enumerate(seqs):
            first = int(mask[i].nonzero()[0])
            assert torch.equal(got[i, first : first + len(s) - 1], want[i]), f"row {i}, left padding {left}"
            assert not got[i, : max(first - 1, 0)].any() and not got[i, first + len(s) :].any()
    alone_row = token_logprobs(trainer, torch.tensor([seqs[1]]))
    assert torch.equal(alone_row[0], want[1])
    # differentiable: the gradient of the summed logprobs is transformers' own, up to float rounding. Both forwards
    # must compute one function: for a mixture of experts, transformers' forward takes the experts the engine took
    # (its router's own probabilities of them, as the engine weights them), since its rounding differs from the
    # engine's deterministic kernels and a near-tie in a router (seen on an AMD CPU) would otherwise send a token
    # to another expert in one of the two forwards, and the gradients would differ by far more than rounding.
    # token_logprobs routes as the engine does: its logprobs above are the engine's bits.
    ids, mask = padded(seqs, True)
    trainer.zero_grad()
    (token_logprobs(trainer, ids, mask) * mask[:, 1:]).sum().backward()
    ours = {n: p.grad.clone() for n, p in trainer.named_parameters()}
    forced = routes_of_padded(routes, seqs, ids, mask) if routes is not None else None

    def transformers_gradients(scored: torch.Tensor) -> dict[str, torch.Tensor]:
        trainer.zero_grad()
        shape = (len(ids), ids.shape[1])
        with contextlib.nullcontext() if forced is None else replay_routes(trainer, forced, shape):
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            logits = trainer(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        ref = logits[:, :-1].float().log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(2)
        (ref * scored).sum().backward()
        return {n: p.grad.clone() for n, p in trainer.named_parameters()}

    scored = mask[:, :-1] * mask[:, 1:]
    assert all(torch.isfinite(g).all() for g in ours.values())
    assert gradient_mismatches(ours, transformers_gradients(scored)) == []
    # and the comparison sees a wrong gradient: one token (of 66) left out of transformers' sum
    scored[0, -1] = 0
    assert "model.embed_tokens.weight" in gradient_mismatches(ours, transformers_gradients(scored))


def gradient_mismatches(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    """The parameters whose gradients differ by more than float32 rounding. The bound scales with the largest
    entry of each gradient, not with each entry: an entry is a sum over tokens (an embedding row: every occurrence
    of its token), where terms of magnitude ~30 can cancel to ~0.1, and the two forwards (the engine's
    deterministic kernels, transformers' torch ops) round those terms differently. Measured: 4.7e-4 at most in an
    embedding gradient whose largest entry is 27.7 (1.7e-5 of it), an entry of 0.094 among them (an elementwise
    rtol 1e-3 / atol 1e-4 failed there); one token left out of the sum is caught (the test above)."""
    bad = []
    for name, want in ref.items():
        scale = float(want.abs().max())
        if not torch.allclose(ours[name], want, rtol=1e-3, atol=max(1e-4 * scale, 1e-6)):
            bad.append(name)
    return bad


def test_token_logprobs_for_qwen3_and_tied_heads(tmp_path):
    for arch, kw in (("qwen3", {}), ("llama", {"tie_word_embeddings": True})):
        path = make_tiny_model(tmp_path / arch, arch=arch, **kw)
        llm = LLM(str(path), deterministic=True, kv_cache_memory_bytes=KV)
        try:
            seqs, want, _ = rollouts(llm)
        finally:
            llm.shutdown()
        ids, mask = padded(seqs, True)
        wrapped = torch.nn.Module()  # a DDP-style wrapper: parameters named `module.*`, no `config` of its own
        wrapped.module = hf(path)
        for trainer in (hf(path), wrapped):
            got = token_logprobs(trainer, ids, mask)
            for i, s in enumerate(seqs):
                first = int(mask[i].nonzero()[0])
                assert torch.equal(got[i, first : first + len(s) - 1], want[i]), f"{arch} row {i}"


def test_bad_settings_are_refused_with_the_reason(models):
    path = str(models["dense"])
    with pytest.raises(ValueError, match="float32"):
        EngineConfig.from_kwargs(path, deterministic=True, dtype="bfloat16")
    with pytest.raises(ValueError, match="tensor_parallel_size 1 or 2"):
        EngineConfig.from_kwargs(path, deterministic=True, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="KV cache in float32"):
        EngineConfig.from_kwargs(path, deterministic=True, kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="fp8 experts needs weight_block_size"):
        EngineConfig.from_kwargs(str(models["moe"]), deterministic=True, quantization="fp8")
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        EngineConfig.from_kwargs(
            str(models["moe"]), deterministic=True, tensor_parallel_size=2, enable_expert_parallel=True
        )
    trainer = hf(models["dense"])
    with pytest.raises(ValueError, match="contiguous"):
        token_logprobs(trainer, torch.tensor([[5, 6, 7]]), torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="batch, seq"):
        token_logprobs(trainer, torch.tensor([5, 6, 7]))


def test_parity_reports_zero_in_deterministic_mode_and_the_gap_by_default(models, capsys):
    from hotswap.cli import main
    from hotswap.train.parity import parity

    sequences = [[5, 17, 33, 2, 90, 41, 7], [300, 12, 9]]
    default, det = parity(models["dense"], sequences)
    assert det.mode == "deterministic" and det.bitwise_equal and det.positions == 8
    assert det.max_abs_logprob_diff == det.max_kl == det.max_tv == 0.0
    assert default.mode == "default" and 0.0 <= default.max_abs_logprob_diff < 1e-3 and default.max_tv < 1e-3
    trainer = hf(models["dense"])  # a trainer's model: the engine serves its weights
    (again,) = parity(trainer, sequences, tokenizer=str(models["dense"]), modes=("deterministic",))
    assert again.bitwise_equal
    assert main(["parity", "--model", str(models["dense"]), "--num-sequences", "2", "--length", "12"]) == 0
    out = capsys.readouterr().out
    assert "deterministic: 22 positions, max |d logprob| 0, KL mean 0 max 0, TV mean 0 max 0, bitwise equal" in out
    with pytest.raises(ValueError, match="unknown parity mode"):
        parity(models["dense"], sequences, modes=("fast",))


def test_serve_deterministic_returns_the_same_logprobs_alone_and_in_a_crowd(models):
    import asyncio

    import httpx

    from server_helpers import running_server

    model = models["dense"].name  # the served name: the folder's
    needle = {
        "model": model,
        "prompt": NEEDLE,
        "max_tokens": 10,
        "temperature": 0.8,
        "seed": 3,
        "logprobs": 3,
        "ignore_eos": True,
    }

    async def crowd(base: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            others = [
                client.post(
                    "/v1/completions",
                    json={"model": model, "prompt": [5 + i] * (3 + i), "max_tokens": 3 + i % 7, "temperature": 1.0},
                )
                for i in range(16)
            ]
            replies = await asyncio.gather(*others[:8], client.post("/v1/completions", json=needle), *others[8:])
            return dict(replies[8].json()["choices"][0]["logprobs"])

    # the SGLang spelling of the flag
    with running_server(str(models["dense"]), "--enable-deterministic-inference", "--admin-auth", "none") as base:
        alone = httpx.post(f"{base}/v1/completions", json=needle, timeout=120).json()["choices"][0]["logprobs"]
        among = asyncio.run(crowd(base))
    assert alone["tokens"] == among["tokens"]
    assert alone["token_logprobs"] == among["token_logprobs"]  # JSON floats round-trip exactly
    assert alone["top_logprobs"] == among["top_logprobs"]


def test_processed_logprobs_equal_token_logprobs_at_the_sampling_temperature(models):
    """vLLM's logprobs_mode: "processed_logprobs" reports the distribution sampled from (after temperature and
    filters); at temperature t without filters it is `token_logprobs(temperature=t)`, bit for bit."""
    llm = det_llm(models, "dense", logprobs_mode="processed_logprobs")
    try:
        params = SamplingParams(temperature=0.7, seed=11, max_tokens=8, ignore_eos=True, logprobs=2)
        out = llm.generate([NEEDLE], params, use_tqdm=False)[0]
        filtered = llm.generate(
            [NEEDLE],
            SamplingParams(temperature=0.7, top_k=3, seed=11, max_tokens=8, ignore_eos=True, logprobs=5),
            use_tqdm=False,
        )[0]
    finally:
        llm.shutdown()
    c = out.outputs[0]
    seq = list(out.prompt_token_ids) + list(c.token_ids)
    got = token_logprobs(hf(models["dense"]), torch.tensor([seq]), temperature=0.7)[0, -len(c.token_ids) :]
    want = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)], dtype=torch.float32)
    assert torch.equal(got, want)
    raw = alone(base(models, "dense"), "greedy")  # raw logprobs differ from processed ones at t = 0.7
    assert not torch.equal(want.double(), raw["logprobs"][: len(want)])
    for step in filtered.outputs[0].logprobs:  # top-3 kept: three finite logprobs summing to one, the rest -inf
        values = sorted((lp.logprob for lp in step.values()), reverse=True)
        assert all(v == float("-inf") for v in values[3:])
        assert abs(sum(math.exp(v) for v in values[:3]) - 1.0) < 1e-5
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineConfig.from_kwargs(str(models["dense"]), logprobs_mode="sampled")


@pytest.mark.unit
def test_exact_gives_the_reference_gradient_to_the_inputs_that_need_one():
    """`ops.exact`: the kernel's bits forward; backward, the torch formula's gradient, for the inputs that require
    one only (here rotary with q trainable and k not: k's rotated output has no gradient path)."""
    from hotswap.kernels import ops
    from hotswap.kernels.policy import _torch_rotary

    torch.manual_seed(0)
    q, k = torch.randn(5, 2, 16, requires_grad=True), torch.randn(5, 1, 16)
    positions, cos, sin = torch.arange(5), torch.randn(8, 16), torch.randn(8, 16)
    ops.require_native()
    rq, rk = ops.rotary(q, k, positions, cos, sin, deterministic=True)
    with torch.no_grad():
        kernel_q, _ = ops.rotary(q, k, positions, cos, sin)
    assert torch.equal(rq, kernel_q)
    ((rq * torch.arange(16.0)).sum() + rk.sum()).backward()  # rk's reference has no gradient path
    q2 = q.detach().requires_grad_(True)
    (_torch_rotary(q2, k, positions, cos, sin)[0] * torch.arange(16.0)).sum().backward()
    assert q.grad is not None and torch.allclose(q.grad, q2.grad)
