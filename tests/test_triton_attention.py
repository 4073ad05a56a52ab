"""The Triton paged-attention kernels (hotswap/kernels/triton_attention*.py), run by Triton's interpreter on the CPU,
against attention in float64 torch ops: decode batches (split and unsplit) and extend batches over shuffled block
tables, GQA and explicit head maps, the fused rotary + cache write, the plain cache write, and rejected input that
leaves the cache as it was."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

# triton.jit reads TRITON_INTERPRET when it decorates, triton's own library (tl.zeros, tl.sum, ...) included, so a
# process runs kernels in the interpreter only where the variable was set before triton was first imported. Here it
# was: the tests run in this process. Elsewhere `test_interpreted` runs this file in a child process that sets it.
INTERPRETED = isinstance(triton.language.zeros, InterpretedFunction)
interpreted = pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1 by test_interpreted")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
MAX_POSITION = 64  # rows of the cos/sin table


@pytest.mark.skipif(INTERPRETED, reason="the tests run in this process")
def test_interpreted(request):
    """This file's tests in a child process whose triton runs every kernel in its interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [
        sys.executable,
        "-m",
        "pytest",
        __file__,
        "-q",
        "-p",
        "no:cacheprovider",
        "--noconftest",
        "-o",
        "addopts=",
        "-rfE",
        "--tb=short",
    ]
    run = subprocess.run(command, env=env, cwd=request.config.rootpath, capture_output=True, text=True, timeout=270)
    assert run.returncode == 0, f"interpreted tests failed:\n{(run.stdout + run.stderr)[-8000:]}"


def _fix_interpreter_index(mp: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter turns a scalar tensor (a one-element array) into a loop bound with int(array),
    which numpy >= 2.4 refuses; later releases take the element (triton-lang/triton#9172). Same fix, for this
    module's tests only."""
    try:
        int(np.array([1]))
    except TypeError:
        from triton.runtime import interpreter

        original = interpreter._patch_lang_tensor

        def patch(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

        mp.setattr(interpreter, "_patch_lang_tensor", patch)


@pytest.fixture(scope="module")
def ta():
    """The kernels' entry points (triton_attention.py), loaded from their file under a private name, so that a
    test's patches stay in this copy; its kernels (triton_attention_kernels.py, imported through hotswap's package)
    interpreted."""
    spec = importlib.util.find_spec("hotswap")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "kernels" / "triton_attention.py"
    name = "_interpreted_triton_attention"
    copy = importlib.util.spec_from_file_location(name, path)
    assert copy is not None and copy.loader is not None
    module = importlib.util.module_from_spec(copy)
    sys.modules[name] = module
    copy.loader.exec_module(module)
    assert isinstance(module._decode_kernel, InterpretedFunction)
    with pytest.MonkeyPatch.context() as mp:
        _fix_interpreter_index(mp)
        yield module
    del sys.modules[name]


def _problem(lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, seed):
    """Random caches whose sequences hold shuffled blocks (three spare blocks nobody lists; table entries past a
    sequence's blocks are -1, never read), and queries for the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.long)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tokens = len(lens) if query_lens is None else sum(query_lens)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


def _tensor(values):
    return None if values is None else torch.tensor(values, dtype=torch.long)


def reference(q, k_cache, v_cache, tables, lens, query_lens, kv_of_q, scale):
    """float64 softmax attention: each new token over its sequence's keys up to its own position."""
    tokens, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    mapping = kv_of_q if kv_of_q is not None else torch.arange(heads) // (heads // kv_heads)
    keys_all, values_all = k_cache.flatten(0, 1).double(), v_cache.flatten(0, 1).double()
    out, row = [], 0
    for b, n in enumerate(lens.tolist()):
        new = 1 if query_lens is None else int(query_lens[b])
        pos = torch.arange(n)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        keys, values = keys_all[slots][:, mapping], values_all[slots][:, mapping]  # [n, H, D]
        scores = torch.einsum("thd,nhd->thn", q[row : row + new].double(), keys) * scale
        seen = pos[None, :] <= (n - new + torch.arange(new))[:, None]  # [new, n]
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
        out.append(torch.einsum("thn,nhd->thd", scores.softmax(-1), values))
        row += new
    return torch.cat(out).reshape(tokens, heads * head_dim)


def _close(out, ref, dtype):
    torch.testing.assert_close(out.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (heads, kv_heads, head_dim, block_size, dtype, context_lens, query_lens (None: decode), kv_of_q, tuning)
CASES = {
    "decode-mha-f32": (2, 2, 16, 4, F32, [1, 4, 8, 3, 5, 9], None, None, {"block_n": 16}),
    "decode-gqa4-bf16-splits": (
        8,
        2,
        32,
        8,
        BF16,
        [1, 7, 8, 9, 16, 17, 40],
        None,
        None,
        {"block_n": 16, "split_keys": 16},
    ),
    "decode-gqa8-f32-splits": (
        8,
        1,
        64,
        16,
        F32,
        [15, 16, 17, 32, 33],
        None,
        None,
        {"block_n": 16, "split_keys": 20},
    ),  # rounded up to 32 keys a split
    "decode-gqa4-f16-defaults": (4, 1, 32, 8, F16, [1, 8, 24, 25], None, None, {}),
    "decode-ones-kv-map-f32": (
        5,
        2,
        16,
        4,
        F32,
        [3, 12, 1, 40],
        [1, 1, 1, 1],
        [1, 0, 1, 1, 0],
        {"block_n": 16, "split_keys": 8},
    ),  # rounded up to one tile a split
    "extend-mha-f32": (2, 2, 16, 4, F32, [5, 17, 1, 24, 9], [5, 3, 1, 24, 2], None, {"block_m": 16, "block_n": 16}),
    "extend-gqa4-bf16": (8, 2, 32, 8, BF16, [16, 17, 40, 8], [16, 1, 20, 7], None, {"block_m": 16, "block_n": 16}),
    "extend-gqa8-f32-defaults": (8, 1, 64, 16, F32, [33, 31, 2], [33, 1, 2], None, {}),
    "extend-kv-map-f16": (6, 3, 32, 8, F16, [9, 23], [4, 23], [2, 0, 2, 1, 0, 2], {"block_m": 16, "block_n": 16}),
}


@interpreted
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_paged_attention(ta, case):
    heads, kv_heads, head_dim, block_size, dtype, lens, query_lens, kv_of_q, tuning = case
    q, k_cache, v_cache, tables, context_lens = _problem(
        lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, seed=len(lens) * head_dim
    )
    ql, kv = _tensor(query_lens), _tensor(kv_of_q)
    scale = head_dim**-0.5
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = ta.paged_attention(q, k_cache, v_cache, tables, context_lens, ql, kv, scale, **tuning)
    assert out.shape == (q.shape[0], heads * head_dim) and out.dtype == dtype
    _close(out, reference(q, k_cache, v_cache, tables, context_lens, ql, kv, scale), dtype)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


class _Launches:
    """A kernel whose launches are recorded: each grid, then the launch itself."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@interpreted
def test_decode_splits_from_the_device(ta, monkeypatch):
    """Without split_keys, a decode batch splits its keys until the programs number twice the multiprocessors
    (here a device of 4, and splits of at least 16 keys): 3 sequences x 2 KV heads, 2 splits of 32 keys."""
    monkeypatch.setattr(ta, "_sm_count", lambda device: 4)
    monkeypatch.setattr(ta, "MIN_SPLIT_KEYS", 16)
    decode, merge = _Launches(ta._decode_kernel), _Launches(ta._merge_kernel)
    monkeypatch.setattr(ta, "_decode_kernel", decode)
    monkeypatch.setattr(ta, "_merge_kernel", merge)
    q, k_cache, v_cache, tables, context_lens = _problem([40, 3, 17], None, 8, 2, 32, 8, BF16, seed=8)
    out = ta.paged_attention(q, k_cache, v_cache, tables, context_lens, None, None, 0.2, block_n=16)
    assert decode.grids == [(3, 2, 2)] and merge.grids == [(3, 8)]
    _close(out, reference(q, k_cache, v_cache, tables, context_lens, None, None, 0.2), BF16)


def _rope_table(head_dim, same_halves=True):
    """cos/sin [MAX_POSITION, D] as rotary.py builds them (the two halves repeat), or with halves that differ (the
    kernels' contract reads each column: a kernel that mixes them up fails)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(MAX_POSITION, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs if same_halves else freqs + 0.5), dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x, cos, sin):
    """torch's rotary in x's dtype: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype)[:, None] + rotated * sin.to(x.dtype)[:, None]


def _rope_inputs(lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, seed):
    """A problem whose new tokens' q, k, v are views of one fused [T, (H + 2 KVH) D] row (a token stride past
    the heads), with the positions and cache slots of the new tokens."""
    q, k_cache, v_cache, tables, context_lens = _problem(
        lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, seed
    )
    tokens = q.shape[0]
    gen = torch.Generator().manual_seed(seed + 1)
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (x.unflatten(1, (-1, head_dim)) for x in (q, k, v))
    news = [1] * len(lens) if query_lens is None else query_lens
    positions = torch.cat([torch.arange(n - new, n) for n, new in zip(lens, news, strict=True)])
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(news))
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    return q, k, v, positions, slots, k_cache, v_cache, tables, context_lens


# (heads, kv_heads, head_dim, block_size, dtype, context_lens, query_lens, cos/sin halves the same, tuning)
ROPE_CASES = {
    "extend-gqa2-f32": (4, 2, 32, 8, F32, [6, 13, 1, 17], [6, 2, 1, 9], True, {"block_m": 16, "block_n": 16}),
    "extend-gqa4-bf16": (8, 2, 16, 4, BF16, [9, 20], [3, 20], True, {"block_m": 16, "block_n": 16}),
    "decode-mha-f16": (3, 3, 16, 4, F16, [5, 8, 12], None, False, {"block_n": 16, "split_keys": 8}),
    "extend-gqa2-f32-halves": (4, 2, 16, 4, F32, [6, 3], [4, 3], False, {"block_m": 16, "block_n": 16}),
}


@interpreted
@pytest.mark.parametrize("case", ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_rope_paged_attention(ta, case):
    heads, kv_heads, head_dim, block_size, dtype, lens, query_lens, same_halves, tuning = case
    q, k, v, positions, slots, k_cache, v_cache, tables, context_lens = _rope_inputs(
        lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim + len(lens)
    )
    cos, sin = _rope_table(head_dim, same_halves)
    ql = _tensor(query_lens)
    scale = head_dim**-0.5
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = ta.rope_paged_attention(
        q, k, v, positions, cos, sin, k_cache, v_cache, slots, tables, context_lens, ql, None, scale, **tuning
    )

    q_rot, k_rot = _rotate(q, cos[positions], sin[positions]), _rotate(k, cos[positions], sin[positions])
    k_ref, v_ref = k_before.clone(), v_before.clone()
    k_ref.flatten(0, 1).index_copy_(0, slots, k_rot)
    v_ref.flatten(0, 1).index_copy_(0, slots, v)
    ref = reference(q_rot, k_ref, v_ref, tables, context_lens, ql, None, scale)
    if dtype == torch.bfloat16:  # the interpreter truncates float32 to bfloat16 where torch rounds to nearest:
        # q and k rotate to values up to an ulp off, and scores add their differences
        torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)
    else:
        _close(out, ref, dtype)

    written = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool)
    written[slots] = True
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    assert torch.equal(flat_k[~written], k_before.flatten(0, 1)[~written])  # every other slot untouched
    assert torch.equal(flat_v[~written], v_before.flatten(0, 1)[~written])
    assert torch.equal(flat_v[slots], v)
    if dtype == torch.bfloat16:  # truncated products and sum: off by up to an ulp of the larger product each
        torch.testing.assert_close(flat_k[slots], k_rot, rtol=2**-6, atol=3e-2)
    else:
        assert torch.equal(flat_k[slots], k_rot)


@interpreted
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_write_kv_cache(ta, dtype):
    _, k_cache, v_cache, *_ = _problem([7, 12], None, 2, 2, 16, 4, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(5, 2, 2, 16, generator=gen).to(dtype)  # k and v as views with a token stride of 2 rows
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1], generator=gen)[:5]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref.flatten(0, 1).index_copy_(0, slots, k)
    v_ref.flatten(0, 1).index_copy_(0, slots, v)
    ta.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    ta.write_kv_cache(k[:0], v[:0], k_cache, v_cache, slots[:0])  # no tokens: nothing to do
    assert torch.equal(k_cache, k_ref)


def _bad(args, change):
    """rope_paged_attention's arguments (a dict) with one made invalid by `change`."""
    args = dict(args)
    change(args)
    return args


def _set(name, index, value):
    def change(args):
        args[name] = args[name].clone()
        args[name][index] = value

    return change


def _replace(name, make):
    def change(args):
        args[name] = make(args)

    return change


# each change, and the error it must raise
BAD = {
    "slot past the cache": (_set("slot_mapping", 1, 10_000), "slot out of range"),
    "negative slot": (_set("slot_mapping", 0, -1), "slot out of range"),
    "k dtype": (_replace("k", lambda a: a["k"].to(torch.bfloat16)), "dtype mismatch"),
    "q dtype": (_replace("q", lambda a: a["q"].double()), "q must be one of"),
    "position past the table": (_set("positions", 0, MAX_POSITION), "position out of range"),
    "block id past the cache": (_set("block_tables", (0, 0), 10_000), "block id out of range"),
    "int32 block tables": (_replace("block_tables", lambda a: a["block_tables"].int()), "block_tables must be"),
    "empty context": (_set("context_lens", 0, 0), "context_lens out of range"),
    "context past the table": (_set("context_lens", 0, 10_000), "context_lens out of range"),
    "query lens not summing to T": (_set("query_lens", 1, 3), "one row per new token"),
    "query len past its context": (_set("query_lens", 2, 2), "query_lens out of range"),
    "kv_of_q past the KV heads": (_replace("kv_of_q", lambda a: torch.tensor([0, 1, 2, 0])), "kv_of_q out of range"),
    "float64 cos": (_replace("cos", lambda a: a["cos"].double()), "cos/sin must be"),
    "q heads not contiguous": (
        _replace("q", lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
        "contiguous heads",
    ),
    "slot_mapping length": (_replace("slot_mapping", lambda a: a["slot_mapping"][:-1]), "slot_mapping must be"),
    "tile not a power of two": (lambda a: a.update(block_n=24), "block_n must be"),
}


@interpreted
@pytest.mark.parametrize(("change", "error"), BAD.values(), ids=BAD.keys())
def test_bad_input_leaves_the_cache(ta, change, error):
    q, k, v, positions, slots, k_cache, v_cache, tables, context_lens = _rope_inputs(
        [6, 13, 1], [6, 2, 1], 4, 2, 16, 4, torch.float32, seed=5
    )
    cos, sin = _rope_table(16)
    args = dict(
        q=q,
        k=k,
        v=v,
        positions=positions,
        cos=cos,
        sin=sin,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slots,
        block_tables=tables,
        context_lens=context_lens,
        query_lens=torch.tensor([6, 2, 1]),
        kv_of_q=torch.tensor([0, 1, 1, 0]),
        scale=0.25,
    )
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match=error):
        ta.rope_paged_attention(**_bad(args, change))
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    ta.rope_paged_attention(**args)  # the valid arguments pass
    assert not torch.equal(k_cache, k_before)


# (k, v, slots) -> the same made invalid, and the error it must raise
WRITE_BAD = {
    "slot past the cache": (
        lambda k, v, slots: (k, v, slots.index_fill(0, torch.tensor([2]), 10_000)),
        "slot out of range",
    ),
    "negative slot": (lambda k, v, slots: (k, v, slots.index_fill(0, torch.tensor([0]), -1)), "slot out of range"),
    "int32 slots": (lambda k, v, slots: (k, v, slots.int()), "slot_mapping must be"),
    "v dtype": (lambda k, v, slots: (k, v.half(), slots), "dtype mismatch"),
    "rows not contiguous": (
        lambda k, v, slots: (k.transpose(1, 2).contiguous().transpose(1, 2), v, slots),
        "contiguous rows",
    ),
    "KV heads": (lambda k, v, slots: (k[:, :1], v[:, :1], slots), "matching the cache"),
}


@interpreted
@pytest.mark.parametrize(("change", "error"), WRITE_BAD.values(), ids=WRITE_BAD.keys())
def test_write_kv_cache_rejects(ta, change, error):
    _, k_cache, v_cache, *_ = _problem([7, 12], None, 2, 2, 16, 4, F32, seed=7)
    k, v = torch.randn(2, 4, 2, 16).unbind(0)
    k, v, slots = change(k, v, torch.tensor([0, 5, 9, 30]))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match=error):
        ta.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


@interpreted
def test_paged_attention_rejects(ta):
    q, k_cache, v_cache, tables, context_lens = _problem([3, 5], None, 3, 2, 16, 4, F32, seed=6)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ta.paged_attention(q, k_cache, v_cache, tables, context_lens, None, None, 0.25)
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="contiguous"):
        ta.paged_attention(
            q.transpose(0, 1).contiguous().transpose(0, 1), k_cache, v_cache, tables, context_lens, None, None, 0.25
        )
    with pytest.raises(ValueError, match="one row per new token"):
        ta.paged_attention(q[:1], k_cache, v_cache, tables, context_lens, None, None, 0.25)
    with pytest.raises(ValueError, match="block_n"):
        ta.paged_attention(q, k_cache, v_cache, tables, context_lens, None, None, 0.25, block_n=24)
    with pytest.raises(ValueError, match="one row per new token"):
        ta.paged_attention(
            q, k_cache, v_cache, tables[:0], context_lens[:0], torch.zeros(0, dtype=torch.long), None, 0.25
        )
    empty = ta.paged_attention(q[:0], k_cache, v_cache, tables[:0], context_lens[:0], None, None, 0.25)
    assert empty.shape == (0, 64)


# ---- on a GPU (--device cuda): the compiled kernels, the same cases and longer contexts -------------------------


@pytest.fixture(scope="module")
def gpu_ta(request):
    """The kernels compiled for the GPU of `--device`, and that device."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a GPU and triton's compiler (not its interpreter)")
    from hotswap.kernels import triton_attention

    return triton_attention, torch.device(request.config.getoption("--device", default="cuda"))


def _on(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


GPU_CASES = {
    **CASES,
    "decode-gqa4-bf16-long": (32, 8, 128, 16, BF16, [1, 1000, 3001, 17], None, None, {}),
    "decode-gqa8-f32-long": (16, 2, 64, 16, F32, [2048, 7], None, None, {}),
    "extend-gqa4-bf16-long": (16, 4, 128, 16, BF16, [700, 300, 1], [200, 300, 1], None, {}),
}


@pytest.mark.cuda
@pytest.mark.parametrize("tuned", [True, False], ids=["tuned", "defaults"])
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_paged_attention_gpu(gpu_ta, case, tuned):
    ta, device = gpu_ta
    heads, kv_heads, head_dim, block_size, dtype, lens, query_lens, kv_of_q, tuning = case
    q, k_cache, v_cache, tables, context_lens = _problem(
        lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, seed=len(lens) * head_dim
    )
    ql, kv = _tensor(query_lens), _tensor(kv_of_q)
    out = ta.paged_attention(
        *_on(device, q, k_cache, v_cache, tables, context_lens, ql, kv), head_dim**-0.5, **(tuning if tuned else {})
    )
    _close(out.cpu(), reference(q, k_cache, v_cache, tables, context_lens, ql, kv, head_dim**-0.5), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_rope_paged_attention_gpu(gpu_ta, case):
    """As test_rope_paged_attention, the rotated keys bit for bit torch's in every dtype (rounded to nearest)."""
    ta, device = gpu_ta
    heads, kv_heads, head_dim, block_size, dtype, lens, query_lens, same_halves, tuning = case
    q, k, v, positions, slots, k_cache, v_cache, tables, context_lens = _rope_inputs(
        lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim + len(lens)
    )
    cos, sin = _rope_table(head_dim, same_halves)
    ql = _tensor(query_lens)
    k_gpu, v_gpu = _on(device, k_cache, v_cache)
    out = ta.rope_paged_attention(
        *_on(device, q, k, v, positions, cos, sin),
        k_gpu,
        v_gpu,
        *_on(device, slots, tables, context_lens, ql),
        None,
        head_dim**-0.5,
        **tuning,
    )
    q_rot, k_rot = _rotate(q, cos[positions], sin[positions]), _rotate(k, cos[positions], sin[positions])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref.flatten(0, 1).index_copy_(0, slots, k_rot)
    v_ref.flatten(0, 1).index_copy_(0, slots, v)
    assert torch.equal(k_gpu.cpu(), k_ref) and torch.equal(v_gpu.cpu(), v_ref)
    _close(out.cpu(), reference(q_rot, k_ref, v_ref, tables, context_lens, ql, None, head_dim**-0.5), dtype)
