"""The native kernels (paged decode attention, KV write, small-batch linear, SwiGLU gate, fused norm and rotary)
against pure-torch references, and the engine with and without them."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS
from hotswap import LLM, SamplingParams
from hotswap.kernels import native
from hotswap.kernels.ops import NATIVE_ATTENTION
from hotswap.kernels.policy import use_mode


def reference(q, k_cache, v_cache, tables, lens, kv_of_q, scale):
    """Per sequence: gather its keys/values block by block and run softmax attention in float64."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    mapping = kv_of_q if kv_of_q is not None else torch.arange(num_heads) // (num_heads // kv_heads)
    out = []
    for b in range(q.shape[0]):
        keys = k_cache[tables[b]].flatten(0, 1)[: lens[b]].double()  # [L, KVH, D]
        values = v_cache[tables[b]].flatten(0, 1)[: lens[b]].double()
        keys, values = keys[:, mapping], values[:, mapping]  # one KV head per query head
        scores = torch.einsum("hd,lhd->hl", q[b].double() * scale, keys)
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values).reshape(num_heads * head_dim))
    return torch.stack(out)


@pytest.fixture
def native_mode():
    """The native kernels forced for one test (the path under test, whatever the calibration chose on this
    build); left when the test ends, failed or not."""
    with use_mode("native"):
        yield


@pytest.fixture(scope="module")
def ops():
    if not native.enabled():
        pytest.skip("native kernels disabled (HOTSWAP_NATIVE_KERNELS)")
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja: the engine uses its pure-torch path")
    result = native.ops()
    assert result is not None, "a C++ compiler is present but the native kernels failed to build (see the log)"
    return result


@pytest.mark.parametrize(
    ("dtype", "head_dim", "tol"),
    [
        (torch.float32, 64, 1e-5),  # vectorised path
        (torch.float32, 16, 1e-5),
        (torch.float32, 128, 1e-5),
        (torch.float32, 40, 1e-5),  # elementwise path
        (torch.bfloat16, 64, 2e-2),
        (torch.float16, 32, 3e-3),
    ],
)
# query heads per KV head: 3 (and an uneven map), 4, 7 (a group of 4 then 3), 1
@pytest.mark.parametrize("layout", ["6/2", "6/2-kv_of_q", "8/2", "14/2", "5/5"])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_attention_kernel_matches_reference(ops, dtype, head_dim, tol, layout, prefill):
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads = (int(n) for n in layout.split("-")[0].split("/"))
    num_blocks, block_size, width = 40, 4, 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    # lengths from a single key to a full table, with ragged last blocks; tables reuse blocks across sequences
    lens = torch.tensor([1, 4, 5, 13, 20, 7])
    tables = torch.randint(0, num_blocks, (len(lens), width), generator=gen)
    # prefill: whole prompts, prompts after a cached prefix, single tokens; decode: one new token each
    query_lens = torch.tensor([1, 4, 2, 13, 9, 1]) if prefill else None
    per_seq = query_lens if prefill else torch.ones_like(lens)
    # new token j of sequence b sees the keys up to its position: one reference "sequence" per token
    token_seq = torch.repeat_interleave(torch.arange(len(lens)), per_seq)
    pairs = zip(lens.tolist(), per_seq.tolist(), strict=True)
    token_keys = torch.cat([torch.arange(c - n + 1, c + 1) for c, n in pairs])
    q = torch.randn(len(token_seq), heads, head_dim, generator=gen).to(dtype)
    kv_of_q = torch.tensor([1, 0, 0, 1, 1, 0]) if layout.endswith("kv_of_q") else None
    out = ops.paged_attention(q, k_cache, v_cache, tables, lens, query_lens, kv_of_q, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == (len(token_seq), heads * head_dim)
    expected = reference(q, k_cache, v_cache, tables[token_seq], token_keys, kv_of_q, head_dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [16, 32, 5])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_attention_kernel_long_contexts_across_block_sizes(ops, block_size, prefill):
    """float32 path over many scattered blocks: sequences of up to 150 keys (prefetches one block ahead across
    many block boundaries), block sizes above, at and below 16, full and ragged last blocks, both threads busy."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, num_blocks = 9, 3, 64, 160
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    lens = torch.tensor([1, 16, 17, 33, 64, 97, 150, 40, 8, 120])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens])
    query_lens = torch.minimum(lens, torch.tensor([1, 16, 5, 33, 2, 20, 7, 40, 8, 3])) if prefill else None
    per_seq = query_lens if prefill else torch.ones_like(lens)
    token_seq = torch.repeat_interleave(torch.arange(len(lens)), per_seq)
    pairs = zip(lens.tolist(), per_seq.tolist(), strict=True)
    token_keys = torch.cat([torch.arange(c - n + 1, c + 1) for c, n in pairs])
    q = torch.randn(len(token_seq), heads, head_dim, generator=gen) * 3  # peaked softmaxes
    out = ops.paged_attention(q, k_cache, v_cache, tables, lens, query_lens, None, head_dim**-0.5)
    expected = reference(q, k_cache, v_cache, tables[token_seq], token_keys, None, head_dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_attention_kernel_rejects_bad_input(ops):
    q = torch.randn(2, 4, 16)
    cache = torch.randn(8, 4, 2, 16)
    tables = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="context_lens out of range"):
        ops.paged_attention(q, cache, cache, tables, torch.tensor([3, 9]), None, None, 0.25)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_attention(q, cache, cache, tables + 8, torch.tensor([3, 4]), None, None, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        ops.paged_attention(q, cache, cache, tables.int(), torch.tensor([3, 4]), None, None, 0.25)
    with pytest.raises(RuntimeError, match="query_lens out of range"):
        ops.paged_attention(q, cache, cache, tables, torch.tensor([3, 4]), torch.tensor([1, 5]), None, 0.25)
    with pytest.raises(RuntimeError, match="one row per new token"):
        ops.paged_attention(q, cache, cache, tables, torch.tensor([3, 4]), torch.tensor([2, 1]), None, 0.25)
    with pytest.raises(RuntimeError, match="dtype mismatch"):
        ops.paged_attention(q.double(), cache, cache, tables, torch.tensor([3, 4]), None, None, 0.25)


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # qwen3: q/k norms and head_dim != hidden / heads
def test_engine_same_outputs_with_and_without_kernel(ops, model_dirs, name, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    fast = LLM(str(model_dirs[name]), kv_cache_memory_bytes=1 << 24)
    assert fast.collective_rpc(lambda worker: worker.runner.attention_kernel is not None) == [True]
    with_kernel = fast.generate(PROMPTS, params, use_tqdm=False)
    fast.shutdown()
    monkeypatch.setenv("HOTSWAP_NATIVE_KERNELS", "0")
    slow = LLM(str(model_dirs[name]), kv_cache_memory_bytes=1 << 24)
    assert slow.collective_rpc(lambda worker: worker.runner.attention_kernel is None) == [True]
    without = slow.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(with_kernel, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            token = next(iter(step_a))
            assert step_a[token].logprob == pytest.approx(step_b[token].logprob, abs=1e-4)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [10, 3, 8], [4, 1, 2]], ids=["decode", "prompts", "after_prefix"])
def test_attention_fallback_matches_kernel(ops, query_lens):
    """The torch path in Attention (padding + SDPA) and the kernel agree on the same cache and step."""
    from hotswap.model.layers.attention import Attention, AttentionMetadata
    from hotswap.model.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=16, deterministic=False)
    tables = [[3, 5, 7], [2], [9, 1]]
    contexts = [10, 3, 8]
    # fill the cache with the history before this step, then run the step both ways on copies of it
    k_cache, v_cache = torch.zeros(16, 4, 2, 16), torch.zeros(16, 4, 2, 16)
    for table, length, new in zip(tables, contexts, query_lens, strict=True):
        for pos in range(length - new):
            slot = table[pos // 4] * 4 + pos % 4
            k_cache.view(-1, 2, 16)[slot] = torch.randn(2, 16, generator=gen)
            v_cache.view(-1, 2, 16)[slot] = torch.randn(2, 16, generator=gen)
    tokens = sum(query_lens)
    q = torch.randn(tokens, 4, 16, generator=gen)
    k, v = torch.randn(tokens, 2, 16, generator=gen), torch.randn(tokens, 2, 16, generator=gen)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(contexts, query_lens, strict=True)])
    # with a rotary embedding, the kernel path rotates inside rope_paged_attention; the torch path, with torch ops
    for rope in (None, RotaryEmbedding(16, 64, 10000.0, None, deterministic=False)):
        outs, caches = [], []
        for mode, kernel in (("torch", None), ("native", NATIVE_ATTENTION)):
            attn.k_cache, attn.v_cache = k_cache.clone(), v_cache.clone()
            meta = AttentionMetadata.build(query_lens, contexts, tables, 4, kernel)
            assert (meta.kernel is None) == (kernel is None)
            with use_mode(mode):
                outs.append(attn(q, k, v, meta, positions, rope))
            caches.append(attn.k_cache)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[0], caches[1], atol=0.0, rtol=0.0)  # torch rounds rotary as the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_ops_match_torch_paths(ops, dtype):
    """Fused norm, residual-add norm and rotary against the modules' own torch paths (same rounding steps)."""
    from hotswap.model.layers.norm import RMSNorm
    from hotswap.model.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(2)
    exact = {"atol": 0.0, "rtol": 0.0}  # same rounding steps as torch (no fused multiply-adds)
    tol = exact if dtype != torch.float32 else {"atol": 2e-6, "rtol": 2e-6}  # fp32 norms: summation order
    norm = RMSNorm(80, 1e-6, deterministic=False)
    norm.weight.data = (torch.rand(80, generator=gen) + 0.5).to(dtype)
    x, residual = torch.randn(37, 80, generator=gen).to(dtype), torch.randn(37, 80, generator=gen).to(dtype)
    with use_mode("torch"):  # the modules' torch paths as the reference
        want_norm, want_sum_norm = norm(x), norm(residual + x)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-6), want_norm, **tol)
    summed = residual.clone()
    out = ops.add_rms_norm(x, summed, norm.weight, 1e-6)
    torch.testing.assert_close(summed, residual + x, atol=0.0, rtol=0.0)
    torch.testing.assert_close(out, want_sum_norm, **tol)
    with use_mode("native"):
        torch.testing.assert_close(norm(x), ops.rms_norm(x, norm.weight, 1e-6), atol=0.0, rtol=0.0)

    rotary = RotaryEmbedding(16, 64, 10000.0, None, deterministic=False)
    qkv = torch.randn(9, 6 * 16 + 2 * 2 * 16, generator=gen).to(dtype)
    q, k, _ = qkv.split([96, 32, 32], dim=-1)  # row-strided views, as in the model
    q, k = q.view(9, 6, 16), k.view(9, 2, 16)
    positions = torch.randint(0, 64, (9,), generator=gen)
    got_q, got_k = ops.rotary(q, k, positions, rotary.cos, rotary.sin)
    with use_mode("torch"):
        want_q, want_k = rotary(positions, q, k)
    torch.testing.assert_close(got_q, want_q, **exact)
    torch.testing.assert_close(got_k, want_k, **exact)
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rotary(q, k, positions + 64, rotary.cos, rotary.sin)


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 64), (torch.float32, 40), (torch.bfloat16, 32)])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_rope_paged_attention_equals_the_separate_ops(ops, dtype, head_dim, prefill):
    """rotary + write_kv_cache + paged_attention in one call: the same output and cache bits as the three ops."""
    from hotswap.model.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, block_size, num_blocks = 6, 2, 4, 32
    lens = torch.tensor([3, 9, 1, 14])
    query_lens = torch.tensor([3, 2, 1, 5]) if prefill else None
    per_seq = query_lens if prefill else torch.ones_like(lens)
    tables = torch.randperm(num_blocks, generator=gen)[: 4 * len(lens)].view(len(lens), 4)  # no shared blocks
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(lens.tolist(), per_seq.tolist(), strict=True)])
    seq = torch.repeat_interleave(torch.arange(len(lens)), per_seq)
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, deterministic=False)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k1, v1, k2, v2 = cache[0].clone(), cache[1].clone(), cache[0].clone(), cache[1].clone()
    rq, rk = ops.rotary(q, k, positions, rotary.cos, rotary.sin)
    ops.write_kv_cache(rk, v, k1, v1, slots)
    expected = ops.paged_attention(rq, k1, v1, tables, lens, query_lens, None, 0.3)
    args = (positions, rotary.cos, rotary.sin, k2, v2, slots, tables, lens, query_lens, None, 0.3)
    got = ops.rope_paged_attention(q, k, v, *args)
    exact = {"atol": 0.0, "rtol": 0.0}
    torch.testing.assert_close(got, expected, **exact)
    torch.testing.assert_close(k2, k1, **exact)
    torch.testing.assert_close(v2, v1, **exact)
    # bad slots or positions raise before the cache is touched
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_paged_attention(q, k, v, positions, *args[1:5], slots + num_blocks * block_size, *args[6:])
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rope_paged_attention(q, k, v, positions + 64, *args[1:])
    torch.testing.assert_close(k2, k1, **exact)
    torch.testing.assert_close(v2, v1, **exact)


def test_write_kv_cache(ops):
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    kv = torch.randn(5, 2, 2, 8, generator=gen)
    k, v = kv[:, 0], kv[:, 1]  # token-strided views
    slots = torch.tensor([0, 7, 8, 23, 13])
    ops.write_kv_cache(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache.view(-1, 2, 8)[slots], k, atol=0.0, rtol=0.0)
    torch.testing.assert_close(v_cache.view(-1, 2, 8)[slots], v, atol=0.0, rtol=0.0)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert k_cache.view(-1, 2, 8)[untouched].abs().sum() == 0
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 24]))


@pytest.mark.parametrize("m", [1, 5, 16, 17, 37, 64, 65, 130])  # one to four vectors per block, several blocks
@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 3), (48, 16), (49, 17), (100, 64), (211, 150)])
def test_small_batch_linear_matches_reference(ops, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 5, generator=gen)[:, 2 : 2 + k]  # rows with a stride, not contiguous overall
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    expected = x.double() @ w.double().T
    torch.testing.assert_close(ops.small_batch_linear(x, w, None).double(), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ops.small_batch_linear(x, w, b).double(), expected + b.double(), atol=1e-4, rtol=1e-5)


def test_small_batch_linear_edges_and_bad_input(ops):
    w, b = torch.randn(5, 8), torch.randn(5)
    assert ops.small_batch_linear(torch.randn(0, 8), w, b).shape == (0, 5)
    torch.testing.assert_close(ops.small_batch_linear(torch.randn(3, 0), torch.randn(5, 0), b), b.expand(3, 5))
    with pytest.raises(RuntimeError, match="float32"):
        ops.small_batch_linear(torch.randn(2, 8).double(), w, None)
    with pytest.raises(RuntimeError, match="matching x's K"):
        ops.small_batch_linear(torch.randn(2, 9), w, None)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.small_batch_linear(torch.randn(2, 8), torch.randn(8, 5).T, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.small_batch_linear(torch.randn(2, 8), w, torch.randn(4))


@pytest.mark.parametrize(("n", "k"), [(50, 33), (97, 576), (300, 1536)])
def test_a_row_of_the_small_batch_kernels_is_the_same_bits_at_any_row_count(ops, n, k):
    """Deterministic mode's foundation: a row's product depends on that row alone, whether it runs with 0-3 others
    (the few-rows path), in one register block or many, in one L2 group or several; with the split at any point
    (also a column slice of a wider weight), and gated."""
    torch.manual_seed(n)
    w, b = torch.randn(2 * n, k + 5)[:, 2 : k + 2], torch.randn(2 * n)  # rows of stride k + 5
    x = torch.randn(700, k)
    split = k // 3
    for rows in (1, 2, 3, 4, 5, 17, 64, 65, 700):
        part = x[-rows:]
        for kwargs in ({}, {"split": split}):
            got = ops.small_batch_linear(part, w, b, **kwargs)[-1]
            assert torch.equal(got, ops.small_batch_linear(x[-1:], w, b, **kwargs)[0]), (rows, kwargs)
        assert torch.equal(
            ops.small_batch_gated_linear(part, w.contiguous(), b)[-1],
            ops.small_batch_gated_linear(x[-1:], w.contiguous(), b)[0],
        ), rows
    # the split sums two chains: the bits of two products over the halves, added
    halves = ops.small_batch_linear(x[:5, :split], w[:, :split], None) + ops.small_batch_linear(
        x[:5, split:], w[:, split:], None
    )
    assert torch.equal(ops.small_batch_linear(x[:5], w, None, split), halves)
    torch.testing.assert_close(ops.small_batch_linear(x[:5], w, b, split), x[:5] @ w.T + b, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("m", [4, 17, 40, 64])  # one to four vectors of rows
@pytest.mark.parametrize(("i", "k"), [(1, 1), (7, 3), (50, 33), (97, 64)])  # tile tails: 7 % 6, 50 % 8, 97 % 48
def test_small_batch_gated_linear_matches_reference(ops, m, i, k):
    gen = torch.Generator().manual_seed(m * 1000 + i + k)
    x = torch.randn(m, k + 3, generator=gen)[:, 1 : 1 + k]
    w, b = torch.randn(2 * i, k, generator=gen), torch.randn(2 * i, generator=gen)
    for bias in (None, b):
        full = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
        expected = torch.nn.functional.silu(full[:, :i]) * full[:, i:]
        got = ops.small_batch_gated_linear(x, w, bias)
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
        # the same bits as the projection followed by the separate gate kernel
        unfused = ops.silu_and_mul(ops.small_batch_linear(x, w, bias))
        torch.testing.assert_close(got, unfused, atol=0.0, rtol=0.0)


def test_small_batch_gated_linear_edges_and_bad_input(ops):
    w, b = torch.randn(6, 8), torch.randn(6)
    assert ops.small_batch_gated_linear(torch.randn(0, 8), w, b).shape == (0, 3)
    no_k = ops.small_batch_gated_linear(torch.randn(2, 0), torch.randn(6, 0), b)
    torch.testing.assert_close(no_k, (torch.nn.functional.silu(b[:3]) * b[3:]).expand(2, 3))
    with pytest.raises(RuntimeError, match="even number of rows"):
        ops.small_batch_gated_linear(torch.randn(2, 8), torch.randn(5, 8), None)
    with pytest.raises(RuntimeError, match="one entry per row of w"):
        ops.small_batch_gated_linear(torch.randn(2, 8), w, torch.randn(3))
    with pytest.raises(RuntimeError, match="float32"):
        ops.small_batch_gated_linear(torch.randn(2, 8).double(), w, None)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 17, 64])  # groups of x rows: whole, and with a short last one
@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 3), (48, 16), (49, 33), (100, 64), (211, 150), (97, 576)])
def test_bf16_small_batch_kernels_match_the_reference(ops, m, n, k):
    """bf16 x and w (rows with a stride: column slices): float32 sums over the exact products, one rounding to
    bf16; the gated form the bits of the product then `silu_and_mul`; each row the same bits whatever rows run
    beside it."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 5, generator=gen).bfloat16()[:, 2 : 2 + k]
    w = torch.randn(2 * n, k + 3, generator=gen).bfloat16()[:, 1 : 1 + k]
    b = torch.randn(2 * n, generator=gen).bfloat16()
    tol = {"rtol": 2**-8, "atol": 1e-5 * k + 1e-6}  # half a bf16 step of the result, and float32 sums
    for bias in (None, b):
        full = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = ops.small_batch_linear(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (m, 2 * n)
        torch.testing.assert_close(got.double(), full, **tol)
        gated = ops.small_batch_gated_linear(x, w.contiguous(), bias)
        assert torch.equal(gated, ops.silu_and_mul(got))  # the unfused calls' bits
        torch.testing.assert_close(
            gated.double(), torch.nn.functional.silu(full[:, :n]) * full[:, n:], rtol=2**-5, atol=tol["atol"]
        )  # four roundings to bf16 on the way
        for row in range(m):  # alone, the same bits
            assert torch.equal(ops.small_batch_linear(x[row : row + 1], w, bias)[0], got[row])
            assert torch.equal(ops.small_batch_gated_linear(x[row : row + 1], w.contiguous(), bias)[0], gated[row])


def test_bf16_small_batch_kernels_refuse_bad_input(ops):
    x, w = torch.randn(2, 8).bfloat16(), torch.randn(6, 8).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16 \\[N, K\\]"):
        ops.small_batch_linear(x, w.float(), None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous bfloat16"):
        ops.small_batch_linear(x, w, torch.randn(6))
    with pytest.raises(RuntimeError, match="no split"):
        ops.small_batch_linear(x, w, None, 4)
    with pytest.raises(RuntimeError, match="even number of rows"):
        ops.small_batch_gated_linear(x, w[:5], None)
    assert ops.small_batch_linear(x[:0], w, None).shape == (0, 6)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_mlp_fuses_the_gate_for_small_batches(ops, native_mode, monkeypatch, llama_dir, quantization):
    """LlamaMLP takes the gated kernel exactly where the small-batch kernel applies, with the same result as the
    projection followed by SiluAndMul; an fp8 weight is dequantized once per projection either way."""
    from hotswap.config import EngineConfig
    from hotswap.kernels import ops as facade
    from hotswap.model.layers import linear as linear_module
    from hotswap.model.llama import LlamaMLP
    from hotswap.model.settings import LayerSettings

    gen = torch.Generator().manual_seed(6)
    settings = LayerSettings.of(EngineConfig.from_kwargs(str(llama_dir), quantization=quantization))
    mlp = LlamaMLP(32, 25, settings, bias=True)  # 25: a tile tail
    assert mlp.gate_up_proj.fp8 == (quantization == "fp8")
    for layer, shards in ((mlp.gate_up_proj, [0, 1]), (mlp.down_proj, [None])):
        for shard in shards:
            rows = 25 if shard is not None else 32
            cols = layer.in_features
            layer.load_weight(layer.weight, torch.randn(rows, cols, generator=gen), shard)
            layer.load_weight(layer.bias, torch.randn(rows, generator=gen), shard)
        layer.process_weights_after_loading()

    class Spy:
        def __init__(self) -> None:
            self.gated = 0

        def __getattr__(self, name):
            return getattr(ops, name)

        def small_batch_gated_linear(self, *args):
            self.gated += 1
            return ops.small_batch_gated_linear(*args)

    dequantized = []
    real_dequantize = linear_module.dequantize
    monkeypatch.setattr(linear_module, "dequantize", lambda *a: dequantized.append(1) or real_dequantize(*a))
    spy = Spy()
    monkeypatch.setattr(facade, "_ops", lambda: spy)
    cases = [
        (4, torch.float32, True),
        (40, torch.float32, True),
        (64, torch.float32, True),
        (3, torch.float32, False),
        (65, torch.float32, False),
    ]
    if quantization is None:
        cases += [(8, torch.bfloat16, True), (1, torch.bfloat16, True), (65, torch.bfloat16, False)]
    for rows, dtype, fused in cases:
        x = torch.randn(rows, 32, generator=gen).to(dtype)
        if quantization is None:
            mlp.to(dtype)
        spy.gated, dequantized[:] = 0, []
        with torch.inference_mode():
            got = mlp(x)
        assert spy.gated == int(fused)
        assert len(dequantized) == (2 if quantization else 0)
        with torch.inference_mode():
            expected = mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x)))
        torch.testing.assert_close(got, expected, atol=0.0, rtol=0.0)


def test_linear_dispatch(ops, native_mode, monkeypatch):
    """`linear` takes the kernel for small float32 and bfloat16 batches only, and equals F.linear either way."""
    from hotswap.kernels import ops as linear_module

    monkeypatch.setattr(linear_module, "_ops", lambda: Spy())

    calls = []
    real = ops.small_batch_linear

    class Spy:
        def small_batch_linear(self, *args):
            calls.append(args[0].shape[0])
            return real(*args)

    w, b = torch.randn(24, 32), torch.randn(24)
    cases = [(64, torch.float32, True), (4, torch.float32, True), (65, torch.float32, False), (3, torch.float32, False)]
    bf16 = [(8, torch.bfloat16, True), (1, torch.bfloat16, True), (65, torch.bfloat16, False)]  # bf16 from one row
    for rows, dtype, used in [*cases, *bf16, (8, torch.float16, False)]:
        calls.clear()
        x = torch.randn(rows, 32).to(dtype)
        out = linear_module.linear(x, w.to(dtype), b.to(dtype))
        tol = {} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}  # both rounded to 16 bits
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w.to(dtype), b.to(dtype)), **tol)
        assert calls == ([rows] if used else [])
    calls.clear()
    out = linear_module.linear(torch.randn(8, 32), w.clone().requires_grad_(), None)
    assert calls == [] and out.requires_grad  # autograd stays on F.linear: the kernel has no backward
    assert (linear_module.SMALL_BATCH_MIN_ROWS, linear_module.SMALL_BATCH_ROWS) == (4, 64)


@pytest.mark.parametrize("vocab", [16384, 1000, 7])
def test_greedy_sample_matches_max_and_log_softmax(ops, vocab):
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(12, vocab + 5, generator=gen) * 4
    logits = wide[:, :vocab]  # strided rows
    logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first index wins
    logits[2, -1] = logits[2].max() + 1  # the maximum in the scalar tail
    tokens, logprobs = ops.greedy_sample(logits)
    assert torch.equal(tokens, logits.max(dim=-1).indices)
    expected = logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-6)


def test_greedy_sample_non_finite_rows_follow_torch(ops):
    nan, inf = float("nan"), float("inf")
    rows = [[1.0, 3.0, 3.0, nan, 2.0], [-inf] * 5, [0.0, inf, 1.0, inf, 0.0], [1.0, 2.0, nan, nan, 7.0]]
    logits = torch.tensor([*rows, [0, -inf, 2, 2, 1]])
    tokens, logprobs = ops.greedy_sample(logits)
    assert torch.equal(tokens, logits.max(dim=-1).indices)
    expected = logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, equal_nan=True)
    with pytest.raises(RuntimeError, match="float32"):
        ops.greedy_sample(logits.double())


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 3e-7), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
def test_silu_and_mul_matches_torch(ops, dtype, tol):
    from hotswap.model.layers.activation import SiluAndMul

    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(7, 2 * 37 + 6, generator=gen) * 6)[:, 3:-3]  # row-strided, halves of 37 (a vector tail)
    x[0, :8] = torch.tensor([-200.0, -90.0, -30.0, -1e-4, 0.0, 1e-4, 30.0, 95.0])  # saturating and tiny gates
    x = x.to(dtype)
    expected = torch.nn.functional.silu(x[:, :37]) * x[:, 37:]
    got = ops.silu_and_mul(x)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    layer = SiluAndMul(deterministic=False)
    with use_mode("native"):
        torch.testing.assert_close(layer(x), got, atol=0.0, rtol=0.0)
    with use_mode("torch"):
        torch.testing.assert_close(layer(x), expected, atol=0.0, rtol=0.0)
    with pytest.raises(RuntimeError, match=r"\[T, 2 \* I\]"):
        ops.silu_and_mul(torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.silu_and_mul(torch.randn(3, 4).double())
    wide = torch.randn(3, 4).double()  # float64 computes in float64 on the torch path
    with use_mode("native"):
        torch.testing.assert_close(layer(wide), torch.nn.functional.silu(wide[:, :2]) * wide[:, 2:], atol=0, rtol=0)


def test_failed_build_falls_back_with_a_warning(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no built library there: the build runs (and fails)

    def broken(**_kwargs):
        raise RuntimeError("c++: fatal error: no input files\nninja: build stopped: subcommand failed.")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(native, "_state", {})
    with caplog.at_level(logging.WARNING, logger="hotswap.kernels.native"):
        assert native.ops() is None
    assert "pure-torch path" in caplog.text and "subcommand failed" in caplog.text
    monkeypatch.setenv("HOTSWAP_NATIVE_KERNELS", "off")
    assert not native.enabled() and native.ops() is None


def test_stale_build_lock_does_not_hang(ops):
    """A `lock` file left by a build that was killed must not make the next process wait forever."""
    from torch.utils import cpp_extension

    lock = Path(cpp_extension._get_build_directory(native.build_name(), verbose=False)) / "lock"
    lock.touch()
    code = "from hotswap.kernels import native; print(native.ops() is not None)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr
    assert not lock.exists()


@pytest.mark.parametrize(
    ("march", "isa"),
    [
        ("x86-64-v3", "avx2"),
        ("haswell", "avx2"),
        ("x86-64-v4", "avx512"),
        ("x86-64", "generic"),
        ("armv8-a", "generic"),
    ],
)
def test_build_name_records_the_target_isa(monkeypatch, march, isa):
    monkeypatch.setattr(native, "MARCH", march)
    assert native.target_isa() == isa
    assert native.build_name().startswith(f"hotswap_kernels_{isa}_")
