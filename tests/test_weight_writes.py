"""How weights are written into place (docs/weight-sync.md, "Writing the weights"): the streaming-store copy, the
prefetching scatter and the one-pass value check (hotswap/kernels/stream_copy.cpp, scatter.cpp, magnitudes.cpp)
against torch's `copy_`, `index_copy_` and `all_finite`, exactly; the facade's fallbacks; their gates measured once
and cached; and every weight path through them (full reloads, atomic sessions and their rollback, sparse deltas and
theirs) equal to the same update through torch's."""

from __future__ import annotations

import pytest
import torch

from hotswap import LLM
from hotswap.kernels import measurements, ops, policy
from hotswap.transfer.delta import sparse_delta
from hotswap.transfer.tensors import tensors_update_info
from hotswap.weights.checksum import tensor_sha256
from hotswap.weights.delta import INDICES, VALUES
from hotswap.weights.update import all_finite, device_max_magnitude_bits, magnitude_bound
from test_delta import perturbed, sums, tensors_of

KV = 1 << 22


@pytest.fixture(scope="module")
def kernels(native_kernels):
    return native_kernels


@pytest.fixture
def every_copy_native(monkeypatch):
    """Native mode, and every weight copy, however small, through the streaming kernel (the tiny test models'
    weights are below the size the facade streams from)."""
    monkeypatch.setattr(ops, "STREAM_COPY_MIN_BYTES", 0)
    taken: dict[str, int] = {"stream_copy": 0, "scatter": 0, "finite_check": 0}
    real_gate = ops._gate

    def gate(name, faster):
        kernels = real_gate(name, faster)
        taken[name] += kernels is not None
        return kernels

    monkeypatch.setattr(ops, "_gate", gate)
    with policy.use_mode("native"):
        yield taken


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float64])
@pytest.mark.parametrize("numel", [1, 63, 4096 + 17, 300_001])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_stream_copy_is_a_byte_copy(kernels, dtype, numel, offset):
    """Any length, any alignment of either side (the unaligned head and tail go through memcpy)."""
    gen = torch.Generator().manual_seed(numel + offset)
    src = torch.randint(
        0, 256, ((numel + 8) * torch.empty(0, dtype=dtype).element_size(),), generator=gen, dtype=torch.uint8
    ).view(dtype)[offset : offset + numel]
    dst = torch.zeros(numel + 3, dtype=dtype)[3 - offset % 3 :][:numel]
    kernels.stream_copy_(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.unit
def test_stream_copy_refuses_what_it_cannot_copy(kernels):
    a, b = torch.zeros(64), torch.zeros(64)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernels.stream_copy_(a, b.double())
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.stream_copy_(torch.zeros(64, 2)[:, 0], b)
    with pytest.raises(RuntimeError, match="sizes differ"):
        kernels.stream_copy_(a, b[:10])
    with pytest.raises(RuntimeError, match="overlap"):
        kernels.stream_copy_(a[:32], a[16:48])


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_scatter_equals_index_copy(kernels, dtype):
    gen = torch.Generator().manual_seed(0)
    for numel, count in ((10, 3), (100_000, 2_000), (1_000_003, 40_000)):
        flat = torch.randn(numel, generator=gen).to(dtype)
        expected = flat.clone()
        indices = torch.randperm(numel, generator=gen)[:count].sort().values
        values = torch.randn(count, generator=gen).to(dtype)
        kernels.scatter_(flat, indices, values)
        expected.index_copy_(0, indices, values)
        assert torch.equal(flat, expected)
    unsorted = torch.tensor([7, 2, 9]), torch.tensor([1.0, 2.0, 3.0], dtype=dtype)
    kernels.scatter_(flat[:10], *unsorted)
    assert flat[[7, 2, 9]].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.unit
def test_scatter_never_writes_outside_and_says_so(kernels):
    flat = torch.zeros(100)
    guard = torch.zeros(200)
    inner = guard[50:150]
    with pytest.raises(RuntimeError, match="1 indices outside"):
        kernels.scatter_(inner, torch.tensor([3, 100]), torch.tensor([1.0, 2.0]))
    assert guard[50 + 3] == 1.0 and int(guard.count_nonzero()) == 1  # the index in range was written, nothing else
    with pytest.raises(RuntimeError, match="destination's dtype"):
        kernels.scatter_(flat, torch.tensor([1]), torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(RuntimeError, match="int64 indices"):
        kernels.scatter_(flat, torch.tensor([1], dtype=torch.int32), torch.tensor([1.0]))


@pytest.mark.unit
def test_max_magnitude_bits_is_the_largest_magnitude_of_each_tensor(kernels):
    """Any mix of lengths and of 4- and 2-byte floats, the extreme at any position (the threads split the tensors,
    laid end to end, anywhere); NaN and Inf above every finite value."""
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 15, 16, 63, 64, 65, 1000, 70_001, 300_001, 2]
    tensors = [torch.randn(n, generator=gen).to(dt) for n in sizes for dt in (torch.float32, torch.bfloat16)]
    tensors.append(torch.randn(999, generator=gen).half())
    for t in tensors[::3]:
        t[int(torch.randint(0, t.numel(), (1,), generator=gen))] = -1e4  # the extreme, negative, anywhere

    def bits(t: torch.Tensor) -> int:
        return int(t.abs().max().view(torch.int32 if t.element_size() == 4 else torch.int16))

    assert kernels.max_magnitude_bits(tensors).tolist() == [bits(t) for t in tensors]
    for special in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(100_003, generator=gen)
        t[-1] = special
        top = kernels.max_magnitude_bits([torch.zeros(5), t]).tolist()
        assert top[0] == 0 and top[1] > magnitude_bound(torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="2 or 4 bytes"):
        kernels.max_magnitude_bits([torch.zeros(4, dtype=torch.float64)])


@pytest.mark.unit
@pytest.mark.parametrize(
    "dtype, limit",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_the_bit_bound_decides_as_all_finite(kernels, dtype, limit):
    """The one-pass check accepts exactly what `all_finite` (torch's check of one tensor) accepts."""
    edges = [
        0.0,
        -0.0,
        1.0,
        65504.0,
        -65504.0,
        65505.0,
        65520.0,
        3.3895e38,
        -3.39e38,
        torch.finfo(dtype).max,
        float("inf"),
        float("-inf"),
        float("nan"),
    ]
    bound = magnitude_bound(dtype, limit)
    assert bound is not None
    for value in edges:
        t = torch.tensor([0.5, value]).to(dtype)
        top = kernels.max_magnitude_bits([t]).tolist()[0]
        assert (top <= bound) == all_finite(t, limit), (dtype, limit, value)
    assert magnitude_bound(torch.bfloat16, torch.float16) is None  # left to all_finite
    assert magnitude_bound(torch.float64, torch.float32) is None


@pytest.mark.unit
def test_the_facade_falls_back_where_the_kernels_do_not_apply(kernels, every_copy_native):
    """A cast, a broadcast or a strided side goes to torch's copy; a strided scatter target to index_copy_; the
    results are torch's."""
    dst = torch.zeros(4, 8)
    assert not ops.stream_copy_applies(dst, torch.ones(4, 8, dtype=torch.float64))
    ops.copy_(dst, torch.ones(4, 8, dtype=torch.float64))
    assert torch.equal(dst, torch.ones(4, 8))
    ops.copy_(dst, torch.full((8,), 2.0))  # broadcast
    assert torch.equal(dst, torch.full((4, 8), 2.0))
    strided = torch.zeros(8, 4).t()
    assert not ops.stream_copy_applies(strided, torch.ones(4, 8))
    ops.copy_(strided, torch.ones(4, 8))
    assert torch.equal(strided, torch.ones(4, 8))
    assert ops.stream_copy_applies(dst, torch.ones(4, 8))
    column = torch.zeros(6, 2)[:, 0]
    ops.scatter_(column, torch.tensor([1, 4]), torch.tensor([5.0, 6.0]))
    assert column.tolist() == [0.0, 5.0, 0.0, 0.0, 6.0, 0.0]
    with policy.use_mode("torch"):
        assert not ops.stream_copy_applies(dst, torch.ones(4, 8))


@pytest.mark.unit
@pytest.mark.parametrize(
    "gate, op, key",
    [
        ("stream_copy_faster", "stream_copy", "bytes"),
        ("scatter_faster", "sparse_scatter", "float32"),
        ("finite_check_faster", "finite_check", "float32"),
    ],
)
def test_the_gates_are_measured_once_and_cached(kernels, monkeypatch, tmp_path, gate, op, key):
    """Each gate times its kernel against torch's path once per machine and stores the ratio with the calibration;
    a later process reads it (and decides by it) without timing anything."""
    monkeypatch.setattr(measurements, "cache_file", lambda: tmp_path / "calibration.json")
    monkeypatch.setattr(policy, "STREAM_COPY_BYTES", 1 << 20)  # the rule, not the size, under test: keep it quick
    first = getattr(policy, gate)()
    key += policy.threads_and_isa()
    ratio = policy._cached(key, op, (1,))
    assert ratio is not None and first == (ratio[1] < policy.WIN_RATIO)
    policy._store(key, op, {1: 2.0})  # as if it had lost
    timed = []
    monkeypatch.setattr(policy, "paired_seconds", lambda *a: timed.append(1) or (1.0, 1.0))
    assert getattr(policy, gate)() is False and timed == []


def _generate(llm: LLM) -> list[list[int]]:
    from hotswap import SamplingParams

    outs = llm.generate(
        ["the quick brown fox", "hello world"],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


def test_every_weight_path_through_the_kernels_equals_torch(ckpts, every_copy_native):
    """With every copy streamed and every patch scattered natively: a one-shot reload, an atomic session, a NaN that
    rolls a session back, a sparse delta and a streamed sparse delta rolled back all leave exactly the weights the
    torch paths leave (checksums of every tensor), and the engine generates as a fresh engine of the new weights."""
    a, b = tensors_of(ckpts["A"]), tensors_of(ckpts["B"])
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    sums_a = sums(llm)
    llm.reload_weights(weights_iterator=list(b.items()))
    sums_b = sums(llm)
    assert sums_b == {n: tensor_sha256(b[n]) for n in sums_b}
    poisoned = dict(a)
    middle = sorted(poisoned)[len(poisoned) // 2]
    poisoned[middle] = poisoned[middle].clone()
    poisoned[middle].view(-1)[-1] = float("inf")
    with pytest.raises(ValueError, match=f"NaN or Inf.*{middle}"):
        llm.reload_weights(weights_iterator=list(poisoned.items()))  # checked in one pass, before any write
    assert sums(llm) == sums_b
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(list(a.items())))
    llm.finish_weight_update()
    assert sums(llm) == sums_a
    bad = dict(b)
    last = sorted(bad)[-1]
    bad[last] = bad[last].clone()
    bad[last].view(-1)[0] = float("nan")
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(sorted(bad.items())[:-1]))  # written, with rollback copies
    with pytest.raises(ValueError, match="NaN"):
        llm.update_weights(tensors_update_info(sorted(bad.items())[-1:]))
    assert sums(llm) == sums_a  # restored through the streaming copy
    near = perturbed(a, 0.05, seed=3)
    delta = [
        pair
        for n in sorted(a)
        for pair in zip((n + INDICES, n + VALUES), sparse_delta(a[n], near[n]), strict=True)
        if not torch.equal(a[n], near[n])
    ]
    llm.reload_weights(weights_iterator=delta, encoding="sparse")
    assert sums(llm) == {n: tensor_sha256(near[n]) for n in sums_a}
    back = [
        pair
        for n in sorted(a)
        for pair in zip((n + INDICES, n + VALUES), sparse_delta(near[n], a[n]), strict=True)
        if not torch.equal(a[n], near[n])
    ]
    back[-1] = (back[-1][0], back[-1][1].clone())
    back[-1][1][0] = float("inf")
    llm.start_weight_update()
    llm.update_weights({**tensors_update_info(back[:-2]), "encoding": "sparse"})  # patched, old values kept
    with pytest.raises(ValueError, match="NaN or Inf"):
        llm.update_weights({**tensors_update_info(back[-2:]), "encoding": "sparse"})
    assert sums(llm) == {n: tensor_sha256(near[n]) for n in sums_a}  # the scattered elements restored
    llm.shutdown_weight_transfer_engine()
    llm.reload_weights(weights_iterator=list(b.items()))
    fresh = LLM(str(ckpts["B"]), kv_cache_memory_bytes=KV)
    assert sums(llm) == sums(fresh) and _generate(llm) == _generate(fresh)
    assert every_copy_native["stream_copy"] > 4 * len(a) and every_copy_native["scatter"] > len(delta) // 2
    assert every_copy_native["finite_check"] >= 3  # the one-shot reloads' checks


@pytest.mark.unit
def test_the_device_check_reads_as_the_native_one_and_decides_as_all_finite(device):
    """The value check a GPU update runs (`device_max_magnitude_bits`: torch ops where the tensors live, one read
    back for all): the same largest magnitudes as the native one-pass kernel's definition, NaN and Inf above every
    bound, and the same verdicts as `all_finite` at the edges, on `--device`."""
    gen = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(n, generator=gen).to(dt)
        for n in (1, 63, 70_001)
        for dt in (torch.float32, torch.bfloat16, torch.float16)
    ]
    tensors[4][17] = -3e4

    def bits(t: torch.Tensor) -> int:
        return int(t.abs().max().view(torch.int32 if t.element_size() == 4 else torch.int16))

    assert device_max_magnitude_bits([t.to(device) for t in tensors]) == [bits(t) for t in tensors]
    assert device_max_magnitude_bits([]) == []
    for dtype, limit in (
        (torch.float32, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ):
        bound = magnitude_bound(dtype, limit)
        assert bound is not None
        for value in (0.0, -0.0, 65504.0, 65520.0, torch.finfo(dtype).max, float("inf"), float("-inf"), float("nan")):
            t = torch.tensor([0.5, value]).to(dtype)
            [top] = device_max_magnitude_bits([t.to(device)])
            assert (top <= bound) == all_finite(t, limit), (dtype, limit, value)
