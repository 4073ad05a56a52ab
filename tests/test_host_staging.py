"""Host tensors staged onto the device through two host slots (hotswap/weights/host_staging.py): the slot, chunk
and packing logic on the CPU (unpinned slots, synchronous copies), and the pinned, side-stream path on CUDA."""

from __future__ import annotations

import pytest
import torch

from hotswap.weights.host_staging import HostStaging, stage_pairs, stage_to_device
from hotswap.weights.update import Patch, WeightSource, pairs_source

pytestmark = pytest.mark.unit

SLOT = 256  # bytes: small, so that the cases below cross and fill slots


def assorted(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Tensors of many sizes around the slot size (empty, 0-d, one element, exactly a slot, many slots), dtypes
    and odd byte counts, with NaN and Inf bit patterns."""
    g = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    sizes = [0, 1, 3, 16, 63, 64, 65, 100, SLOT // 4, SLOT // 4 + 1, 2 * SLOT, 5 * SLOT + 7, 1, 0, 700]
    for i, n in enumerate(sizes):
        out.append((f"f32.{i}", torch.randn(n, generator=g)))
    out.append(("scalar", torch.tensor(3.5)))
    out.append(("bf16", torch.randn(7, 9, generator=g).to(torch.bfloat16)))
    out.append(("f16.big", torch.randn(3, SLOT, generator=g).to(torch.float16)))
    out.append(("i64", torch.randint(-(2**40), 2**40, (33,), generator=g)))
    out.append(("u8", torch.randint(0, 256, (SLOT,), dtype=torch.uint8, generator=g)))
    out.append(("u8.odd", torch.randint(0, 256, (SLOT + 1,), dtype=torch.uint8, generator=g)))
    out.append(("bool", torch.rand(13, generator=g) > 0.5))
    out.append(("fp8", torch.randn(40, generator=g).to(torch.float8_e4m3fn)))
    out.append(("empty2d", torch.empty(0, 5)))
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45])
    out.append(("special", special))
    out.append(("strided", torch.randn(8, 6, generator=g).t()))  # not contiguous
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_values_and_order_are_kept_bit_for_bit_across_slots_chunks_and_packing():
    pairs = assorted()
    staging = HostStaging("cpu", slot_bytes=SLOT, pin=False)
    got = list(staging.stage(pairs))
    assert [n for n, _ in got] == [n for n, _ in pairs]
    for (name, want), (_, have) in zip(pairs, got, strict=True):
        assert same_bits(have, want), name
        assert have.data_ptr() != want.data_ptr() or want.numel() == 0, f"{name} was not copied"
    assert staging.stats.tensors == len(pairs)
    assert staging.stats.bytes == sum(t.numel() * t.element_size() for _, t in pairs)
    assert torch.equal(got[0][1], pairs[0][1]) and torch.equal(got[-1][1], pairs[-1][1])


@pytest.mark.parametrize("slot", [64, 128, 1024, 1 << 20])
def test_every_slot_size_gives_the_same_bits(slot):
    pairs = assorted(seed=slot)
    got = list(HostStaging("cpu", slot_bytes=slot, pin=False).stage(pairs))
    assert all(same_bits(h, w) for (_, w), (_, h) in zip(pairs, got, strict=True))


def test_the_two_slots_are_allocated_once_and_reused_by_every_stage():
    staging = HostStaging("cpu", slot_bytes=SLOT, pin=False)
    list(staging.stage(assorted(0)))
    slots = [s.data_ptr() for s in staging.slots()]
    for seed in (1, 2):
        got = list(staging.stage(assorted(seed)))
        assert all(same_bits(h, w) for (_, w), (_, h) in zip(assorted(seed), got, strict=True))
    assert [s.data_ptr() for s in staging.slots()] == slots
    assert staging.stats.slot_allocations == 2


def test_small_tensors_share_one_copy_and_allocation_per_slot():
    pairs = [(f"t{i}", torch.full((4,), float(i))) for i in range(64)]  # 16 bytes each, 64 per 4 KiB slot
    staging = HostStaging("cpu", slot_bytes=4096, pin=False)
    got = list(staging.stage(pairs))
    assert all(torch.equal(h, w) for (_, w), (_, h) in zip(pairs, got, strict=True))
    assert staging.stats.copies == 1 and staging.stats.device_allocations == 1


def test_a_tensor_larger_than_a_slot_is_copied_in_slot_sized_chunks_into_one_tensor():
    big = torch.randn(1000)  # 4000 bytes
    staging = HostStaging("cpu", slot_bytes=512, pin=False)
    [(name, out)] = list(staging.stage([("big", big)]))
    assert name == "big" and torch.equal(out, big)
    assert staging.stats.copies == 8 and staging.stats.device_allocations == 1


def test_inputs_from_a_reused_buffer_are_copied_before_the_next_is_requested():
    """A transport's tensors may be views of one buffer that it overwrites for the next tensor."""
    wanted = [torch.randn(n) for n in (5, 70, 3, 300, 0, 9)]
    buffer = torch.empty(400)

    def reusing():
        for i, w in enumerate(wanted):
            view = buffer[: w.numel()]
            view.copy_(w)
            yield f"t{i}", view
            buffer.fill_(float("nan"))  # the producer moves on

    got = list(HostStaging("cpu", slot_bytes=SLOT, pin=False).stage(reusing()))
    assert all(torch.equal(h, w) for w, (_, h) in zip(wanted, got, strict=True))


def test_outputs_stay_valid_after_later_pairs_are_staged():
    pairs = assorted()
    staging = HostStaging("cpu", slot_bytes=SLOT, pin=False)
    kept = list(staging.stage(pairs))
    list(staging.stage(assorted(7)))  # the slots are overwritten
    assert all(same_bits(h, w) for (_, w), (_, h) in zip(pairs, kept, strict=True))


def test_what_needs_no_staging_passes_through_in_its_place():
    patch = Patch(torch.tensor([0, 2]), torch.tensor([1.0, 2.0]))
    pairs = [("a", torch.randn(3)), ("p", patch), ("b", torch.randn(100)), ("meta", torch.empty(2, device="meta"))]
    staging = HostStaging("cpu", slot_bytes=SLOT, pin=False)
    got = list(staging.stage(pairs))
    assert [n for n, _ in got] == ["a", "p", "b", "meta"]
    assert got[1][1] is patch and got[3][1] is pairs[3][1]
    assert torch.equal(got[0][1], pairs[0][1]) and torch.equal(got[2][1], pairs[2][1])
    assert staging.stats.passed_through == 2


def test_skipped_entries_pass_through_unstaged():
    pairs = [("a", torch.randn(3)), ("b", torch.randn(4)), ("c", torch.randn(5))]
    got = list(HostStaging("cpu", slot_bytes=SLOT, pin=False).stage(pairs, skip=[False, True, False]))
    assert got[1][1] is pairs[1][1]
    assert got[0][1] is not pairs[0][1] and torch.equal(got[2][1], pairs[2][1])


def test_one_stage_at_a_time():
    staging = HostStaging("cpu", slot_bytes=SLOT, pin=False)
    first = staging.stage(assorted())
    next(first)
    with pytest.raises(RuntimeError, match="already staging"):
        next(staging.stage(assorted()))
    first.close()
    assert len(list(staging.stage(assorted()))) == len(assorted())


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="slot_bytes"):
        HostStaging("cpu", slot_bytes=8)
    with pytest.raises(ValueError, match="stages onto"):
        HostStaging("meta")


def test_on_the_cpu_sources_and_pairs_pass_through_unchanged():
    pairs = assorted()
    assert stage_pairs(pairs, "cpu") is pairs
    source = pairs_source(pairs)
    assert stage_to_device(source, "cpu") is source


def test_a_staged_source_keeps_its_declaration_and_streams():
    pairs = assorted()
    verified: list[bool] = []
    source = WeightSource(
        declared=[(n, t.dtype, tuple(t.shape)) for n, t in pairs],
        tensors=lambda: iter(pairs),
        in_memory=True,
        verify=lambda: verified.append(True),
        description="shm update",
    )
    staging = HostStaging("cpu", slot_bytes=SLOT, pin=False)
    staged = stage_to_device(source, staging=staging)
    assert staged.declared == source.declared and staged.description == source.description
    assert not staged.in_memory  # streamed: no whole second copy of the update on the device
    assert stage_to_device(source, staging=staging, in_memory=True).in_memory
    assert staged.verify is not None
    staged.verify()
    assert verified == [True]
    for _ in range(2):  # each call of tensors() is a new stream
        got = list(staged.tensors())
        assert all(same_bits(h, w) for (_, w), (_, h) in zip(pairs, got, strict=True))


# ---- CUDA -----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_staging_is_bit_exact_with_pinned_slots_and_reads_on_the_consumer_stream(device):
    pairs = [*assorted(), ("large", torch.randn(3_000_000))]  # 12 MB: chunks through 1 MiB slots
    staging = HostStaging(device, slot_bytes=1 << 20)
    assert all(s.is_pinned() for s in staging.slots())
    consumer = torch.cuda.Stream(torch.device(device))
    with torch.cuda.stream(consumer):
        out = []
        for name, tensor in staging.stage(pairs):
            assert tensor.device.type == "cuda"
            out.append((name, tensor.clone()))  # read on the consumer stream, before the next pair
        consumer.synchronize()
    for (name, want), (_, have) in zip(pairs, out, strict=True):
        assert same_bits(have.cpu(), want), name
    assert staging.stats.slot_allocations == 2


@pytest.mark.cuda
def test_cuda_staged_source_loads_a_checkpoint_sized_stream(device):
    g = torch.Generator().manual_seed(0)
    pairs = [(f"w{i}", torch.randn(512, 1024, generator=g).to(torch.bfloat16)) for i in range(40)]
    source = stage_to_device(pairs_source(pairs), device)
    target = {n: torch.empty(t.shape, dtype=t.dtype, device=device) for n, t in pairs}
    for name, tensor in source.tensors():
        target[name].copy_(tensor)
        assert bool(torch.isfinite(tensor.float()).all())  # a host wait per tensor, as a finiteness check does
    torch.cuda.synchronize(device)
    assert all(torch.equal(target[n].cpu(), t) for n, t in pairs)


# ---- the host transports' sources ------------------------------------------------------------------------------


def test_host_transports_stage_only_onto_a_cuda_device():
    from hotswap.config import WeightTransferConfig
    from hotswap.transfer.disk import DiskEngine
    from hotswap.transfer.shm import ShmEngine
    from hotswap.weights.host_staging import staging_for

    assert staging_for({}) is None  # no engine scope: the CPU
    assert staging_for({"device": "cpu"}) is None
    with pytest.raises(ValueError, match="device must be"):
        staging_for({"device": "gpu"})
    for engine_class in (ShmEngine, DiskEngine):
        assert engine_class({"backend": "x"}, WeightTransferConfig()).staging is None


def test_an_shm_update_streams_through_the_staging_slots():
    from hotswap.config import WeightTransferConfig
    from hotswap.transfer.shm import ShmEngine, ShmSender

    pairs = [(n, t) for n, t in assorted() if t.is_contiguous()]
    sender = ShmSender()
    engine = ShmEngine({"backend": "shm"}, WeightTransferConfig(timeout_s=5))
    try:
        info = sender.write(pairs)
        engine.staging = HostStaging("cpu", slot_bytes=SLOT, pin=False)  # what a CUDA engine gets, on the CPU
        source = engine.source(info)
        assert not source.in_memory and source.verify is not None
        got = list(source.tensors())
        source.verify()
        assert [n for n, _ in got] == [n for n, _ in pairs]
        assert all(same_bits(h, w) for (_, w), (_, h) in zip(pairs, got, strict=True))
        assert engine.staging.stats.tensors == len(pairs)
    finally:
        engine.shutdown()
        sender.close()


def test_a_disk_update_streams_through_the_staging_slots(tmp_path):
    from safetensors.torch import save_file

    from hotswap.config import WeightTransferConfig
    from hotswap.transfer.disk import DiskEngine

    pairs = {n: t.contiguous() for n, t in assorted() if t.numel() and t.dtype != torch.float8_e4m3fn}
    save_file(pairs, str(tmp_path / "model.safetensors"))
    engine = DiskEngine({"backend": "disk"}, WeightTransferConfig())
    engine.staging = HostStaging("cpu", slot_bytes=SLOT, pin=False)
    source = engine.source({"path": str(tmp_path)})
    got = dict(source.tensors())
    assert got.keys() == pairs.keys() and all(same_bits(got[n], t) for n, t in pairs.items())
    assert engine.staging.stats.tensors == len(pairs)
