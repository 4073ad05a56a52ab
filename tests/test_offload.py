"""Sleep and wake of the weights' memory (hotswap/worker/offload.py): on CPU tensors (their storages resize the
same way as a GPU's) and, marked cuda, on the device with pinned host copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotswap.worker.offload import distinct_storages, offload, restore

pytestmark = pytest.mark.unit


class Tiny(torch.nn.Module):
    """Tied embedding / head, a fused projection with views of its halves, a bf16 norm and an empty parameter."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(32, 8, generator=g).to(device))
        self.head = self.embed  # tied: one storage
        self.gate_up = torch.nn.Parameter(torch.randn(24, 8, generator=g).to(device))
        self.norm = torch.nn.Parameter(torch.randn(8, generator=g).to(torch.bfloat16).to(device))
        self.empty = torch.nn.Parameter(torch.empty(0, 8, device=device))
        self.register_buffer("steps", torch.arange(5, device=device))


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module.state_dict().items()}


def test_level_1_restores_every_weight_bit_for_bit_and_keeps_the_objects():
    model = Tiny()
    before = snapshot(model)
    params = list(model.parameters())
    storages = [p.untyped_storage() for p in params]
    offloaded = offload(model.parameters(), keep=True)
    assert offloaded.storages == 3  # embed (= head), gate_up, norm; the empty parameter has no memory
    assert offloaded.bytes_released == offloaded.bytes_to_host == (32 * 8 + 24 * 8) * 4 + 8 * 2
    restored = restore(offloaded)
    assert restored.storages == 3 and restored.bytes_to_device == restored.bytes_reallocated == offloaded.bytes_released
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert all(p.untyped_storage()._cdata == s._cdata for p, s in zip(params, storages, strict=True))
    assert offloaded.restored and offloaded.host is None


def test_memory_is_released_while_asleep():
    model = Tiny()
    offloaded = offload(list(model.parameters()), keep=True)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert model.steps.untyped_storage().nbytes() == 5 * 8  # only what was passed moves
    restore(offloaded)
    assert [p.untyped_storage().nbytes() for p in model.parameters()] == [32 * 8 * 4, 24 * 8 * 4, 8 * 2, 0]


def test_tied_weights_are_moved_once_and_stay_tied():
    model = Tiny()
    want = model.embed.detach().clone()
    offloaded = offload([model.embed, model.head, model.embed], keep=True)
    assert offloaded.storages == 1
    restore(offloaded)
    assert model.head is model.embed and torch.equal(model.head, want)
    assert model.head.untyped_storage().data_ptr() == model.embed.untyped_storage().data_ptr()


def test_views_made_before_the_sleep_read_the_restored_values():
    """A view shares its base's storage object, whose memory is swapped underneath: it stays valid after wake."""
    model = Tiny()
    gate, up = model.gate_up.data[:12], model.gate_up.data[12:]
    column = model.gate_up.data[:, 3]  # strided
    want_gate, want_up, want_column = gate.clone(), up.clone(), column.clone()
    restore(offload(model.parameters(), keep=True))
    assert torch.equal(gate, want_gate) and torch.equal(up, want_up) and torch.equal(column, want_column)
    with torch.no_grad():
        model.gate_up.mul_(2)  # writes through the parameter show in the old views too
    assert torch.equal(gate, want_gate * 2) and torch.equal(column, want_column * 2)


def test_level_2_keeps_no_copy_and_restores_zeros():
    model = Tiny()
    offloaded = offload(model.parameters(), keep=False)
    assert offloaded.host is None and offloaded.bytes_to_host == 0 and offloaded.bytes_released > 0
    restored = restore(offloaded)
    assert restored.bytes_to_device == 0 and restored.bytes_reallocated == offloaded.bytes_released
    assert all(not p.any() for p in model.parameters())
    with torch.no_grad():  # a reload writes into the same parameters
        model.norm.fill_(1.5)
    assert torch.equal(model.norm, torch.full((8,), 1.5, dtype=torch.bfloat16))


def test_sleep_wake_cycles_repeat():
    model = Tiny()
    before = snapshot(model)
    for keep in (True, False, True):
        if not keep:
            restore(offload(model.parameters(), keep=False))
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(before[name])
        else:
            restore(offload(model.parameters(), keep=True))
        assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


def test_restore_twice_is_refused_and_offloading_asleep_storages_moves_nothing():
    model = Tiny()
    offloaded = offload(model.parameters(), keep=True)
    assert offload(model.parameters(), keep=True).storages == 0  # already at 0 bytes
    restore(offloaded)
    with pytest.raises(RuntimeError, match="restored already"):
        restore(offloaded)


def test_a_storage_that_cannot_be_resized_is_refused_before_anything_moves():
    model = Tiny()
    foreign = torch.nn.Parameter(torch.from_numpy(np.arange(6, dtype=np.float32)))
    with pytest.raises(ValueError, match="cannot be resized"):
        offload([*model.parameters(), foreign], keep=True)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters() if p.numel())


def test_distinct_storages_dedupes_by_data_pointer_and_skips_empty_ones():
    model = Tiny()
    views = [model.gate_up[:3], model.gate_up[5:], model.embed, model.head, model.empty]
    assert len(distinct_storages(views)) == 2


# ---- CUDA -----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_sleep_frees_device_memory_and_wake_restores_bits_from_pinned_memory(device):
    torch.cuda.synchronize(device)
    big = torch.nn.Parameter(torch.randn(4096, 4096, device=device))  # 64 MiB
    tied = big
    view = big.data[100:200]
    want = big.detach().clone().cpu()
    torch.cuda.synchronize(device)
    used = torch.cuda.memory_allocated(device)
    offloaded = offload([big, tied], keep=True, pin=True)
    assert offloaded.pinned and offloaded.storages == 1
    assert torch.cuda.memory_allocated(device) <= used - 64 * 2**20
    restore(offloaded)
    assert torch.equal(big.cpu(), want) and torch.equal(view.cpu(), want[100:200])
    assert torch.cuda.memory_allocated(device) >= used


@pytest.mark.cuda
def test_cuda_level_2_restores_zeros(device):
    param = torch.nn.Parameter(torch.randn(1024, 1024, device=device))
    restore(offload([param], keep=False))
    assert not param.any()
