"""Bad updates get clear errors, leave the weights bit-identical and the engine serving."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import PROMPTS, serves
from hotswap import LLM, SamplingParams
from hotswap.testing import make_tiny_model
from hotswap.transfer.shm import ShmSender
from transfer_helpers import (
    BACKENDS,
    Pusher,
    free_port,
    shm_segments,
    start_shm_trainer,
    torch_dist_trainer_dies_mid_stream,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def bad_cases(b: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[list, str]]:
    """name -> (tensors to send, expected message). Each starts with valid tensors so some data moves first."""
    good = b[:6]
    norm = dict(b)["model.norm.weight"]
    nan = dict(b)["model.layers.1.mlp.down_proj.weight"].clone()
    nan[3, 5] = float("nan")
    return {
        "unknown_name": ([*good, ("model.layers.0.mlp.nope.weight", norm)], r"unknown tensors.*mlp\.nope"),
        "wrong_shape": ([*good, ("model.norm.weight", norm[:7])], r"model\.norm\.weight: expected shape \(64,\)"),
        "uncastable_dtype": ([*good, ("model.norm.weight", norm.to(torch.int32))], r"cannot be cast.*int32"),
        "duplicate_name": ([*good, ("model.norm.weight", norm), ("model.norm.weight", norm)], "duplicate.*norm"),
        "nan": (
            [(n, nan if n == "model.layers.1.mlp.down_proj.weight" else t) for n, t in b],
            r"NaN or Inf.*down_proj",
        ),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_update_matrix(ckpts, b_tensors, backend):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, weight_transfer_config={"timeout_s": 5})
    before = llm.weight_checksums()
    for case, (tensors, message) in bad_cases(b_tensors).items():
        pusher = Pusher(llm, backend, bucket_size_bytes=1 << 14, sender_timeout_s=2)
        llm.start_weight_update()
        with pytest.raises(ValueError, match=message):
            pusher.update(tensors)
        assert llm.weight_checksums() == before, f"{backend}/{case}: weights changed"
        assert llm.get_weight_version() == 0
        assert serves(llm, ckpts["A"]), f"{backend}/{case}: engine no longer serves A"
        pusher.close()
    pusher = Pusher(llm, backend)  # the engine still takes a good update
    pusher.push(b_tensors)
    assert serves(llm, ckpts["B"])
    pusher.close()


def test_out_of_order_calls_name_the_expected_call(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine"):
        llm.start_weight_update()
    for backend in ("carrier_pigeon", [], {"x": 1}, None):  # not even a name: still a clear ValueError
        with pytest.raises(ValueError, match=r"unknown weight transfer backend.*shm"):
            llm.init_weight_transfer_engine({"backend": backend})
    llm.init_weight_transfer_engine({"backend": "tensors"})
    with pytest.raises(RuntimeError, match="start_weight_update"):
        llm.update_weights({"named_tensors": b_tensors})
    with pytest.raises(RuntimeError, match="start_weight_update"):
        llm.finish_weight_update()
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match=r"update_weights.*finish_weight_update.*abort_weight_update"):
        llm.start_weight_update()
    with pytest.raises(RuntimeError, match="in progress"):
        llm.reload_weights()
    llm.abort_weight_update()
    assert serves(llm, ckpts["A"])


def test_abort_rolls_back_every_update_of_the_session(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, quantization="fp8")
    before = llm.weight_checksums()
    pusher = Pusher(llm, "tensors")
    llm.start_weight_update()
    pusher.update(b_tensors[:10])
    pusher.update(b_tensors[10:])
    assert llm.weight_checksums() != before
    llm.abort_weight_update()
    assert llm.weight_checksums() == before and llm.get_weight_version() == 0
    pusher.close()


def test_non_atomic_failure_stops_serving_until_reload(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, weight_transfer_config={"atomic": False})
    tensors, _ = bad_cases(b_tensors)["nan"]
    pusher = Pusher(llm, "disk")  # a streamed source: the NaN is found after earlier tensors were written
    llm.start_weight_update()
    with pytest.raises(ValueError, match="atomic mode is off"):
        pusher.update(tensors)
    with pytest.raises(RuntimeError, match="inconsistent"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.reload_weights()
    assert serves(llm, ckpts["A"])
    pusher.close()


def test_in_memory_sources_are_value_checked_before_any_write(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, weight_transfer_config={"atomic": False})
    before = llm.weight_checksums()
    tensors, _ = bad_cases(b_tensors)["nan"]
    for backend in ("tensors", "shm"):
        pusher = Pusher(llm, backend)
        llm.start_weight_update()
        with pytest.raises(ValueError, match="no weight had been changed"):
            pusher.update(tensors)
        pusher.close()
    with pytest.raises(ValueError, match="NaN or Inf"):
        llm.reload_weights(weights_iterator=tensors)
    assert llm.weight_checksums() == before and serves(llm, ckpts["A"])


def test_an_update_run_at_once_checks_every_value_in_one_pass_before_any_write(ckpts, b_tensors, monkeypatch):
    """An in-memory source's values are all checked, in one pass, before the first write (an update received in
    slices checks them in groups: tests/test_staged_updates.py): bad tensors first and last are both named and
    nothing was written although atomic mode (the rollback copies) is off."""
    import hotswap.weights.update as update_module

    passes: list[int] = []
    check = update_module.non_finite_names

    def counted(pairs, limit):
        passes.append(len(pairs))
        return check(pairs, limit)

    monkeypatch.setattr(update_module, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(update_module, "non_finite_names", counted)
    first, last = b_tensors[0][0], b_tensors[-1][0]
    tensors = [(n, t.clone()) for n, t in b_tensors]
    for name, tensor in tensors:
        if name in (first, last):
            tensor.view(-1)[-1] = float("nan")

    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, weight_transfer_config={"atomic": False})
    before = llm.weight_checksums()
    with pytest.raises(ValueError, match="NaN or Inf") as caught:
        llm.reload_weights(weights_iterator=tensors)
    assert first in str(caught.value) and last in str(caught.value)
    assert passes == [len(tensors)], "an update run at once checks its values in one pass"
    assert llm.weight_checksums() == before and serves(llm, ckpts["A"])


def test_values_the_weight_dtype_cannot_hold_are_rejected(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, dtype="float16")
    norm = dict(b_tensors)["model.norm.weight"].clone()
    norm[0] = 1e6  # finite in fp32, inf in fp16
    with pytest.raises(ValueError, match=r"NaN or Inf.*model\.norm\.weight"):
        llm.reload_weights(weights_iterator=[("model.norm.weight", norm)])


def test_tied_weight_sent_twice_is_rejected(tmp_path, b_tensors):
    tied = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    llm = LLM(str(tied), kv_cache_memory_bytes=1 << 22)
    emb = dict(b_tensors)["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="same \\(tied\\) weight"):
        llm.reload_weights(weights_iterator=[("model.embed_tokens.weight", emb), ("lm_head.weight", emb * 2)])


def test_shm_timeout_rolls_back(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, weight_transfer_config={"timeout_s": 1.0})
    before = llm.weight_checksums()
    sender = ShmSender()
    llm.init_weight_transfer_engine({"backend": "shm"})
    llm.start_weight_update()
    llm.update_weights(sender.write(b_tensors[:10]))
    info, _ = sender.prepare(b_tensors[10:])  # never published
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="previous weights were restored"):
        llm.update_weights(info)
    assert time.monotonic() - start < 3
    assert llm.weight_checksums() == before and serves(llm, ckpts["A"])
    llm.shutdown_weight_transfer_engine()
    sender.close()


def test_torch_dist_timeout_rolls_back(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, weight_transfer_config={"timeout_s": 2.0})
    before = llm.weight_checksums()
    pusher = Pusher(llm, "torch_dist", sender_timeout_s=10)
    llm.start_weight_update()
    pusher.update(b_tensors[:10])  # a first update of the session lands...
    assert llm.weight_checksums() != before
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="previous weights were restored"):
        llm.update_weights(pusher.dist.update_info(b_tensors[10:]))  # ...then the trainer never sends
    assert time.monotonic() - start < 8
    assert llm.weight_checksums() == before and serves(llm, ckpts["A"])
    llm.shutdown_weight_transfer_engine()


@pytest.mark.slow
def test_shm_trainer_killed_mid_update_is_rolled_back(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, weight_transfer_config={"timeout_s": 30})
    before = llm.weight_checksums()
    trainer = start_shm_trainer(str(ckpts["B"] / "model.safetensors"))
    llm.init_weight_transfer_engine({"backend": "shm"})
    llm.start_weight_update()
    llm.update_weights(json.loads(trainer.stdout.readline()))
    assert llm.weight_checksums() != before
    segments = shm_segments(creators={trainer.pid})
    assert segments  # its segment is found by its name (checked gone at the end)
    trainer.stdin.write("next\n")  # a sender reuses its buffer only after the engine has taken the previous update
    trainer.stdin.flush()
    info = json.loads(trainer.stdout.readline())
    threading.Timer(0.5, lambda: os.kill(trainer.pid, 9)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited before publishing"):
        llm.update_weights(info)
    assert time.monotonic() - start < 10
    with open("/proc/self/maps") as maps:  # unmapped as the update failed, with the transport still open
        assert not [line for line in maps if any(name in line for name in segments)]
    assert llm.weight_checksums() == before and serves(llm, ckpts["A"])
    llm.shutdown_weight_transfer_engine()
    trainer.wait()
    deadline = time.monotonic() + 10
    while shm_segments(creators={trainer.pid}) and time.monotonic() < deadline:
        time.sleep(0.1)  # the dead trainer's resource tracker unlinks its segment
    assert not shm_segments(creators={trainer.pid})


@pytest.mark.slow
def test_torch_dist_trainer_killed_mid_stream_is_rolled_back(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, weight_transfer_config={"timeout_s": 30})
    before = llm.weight_checksums()
    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Queue()
    port = free_port()
    bucket = 1 << 14
    trainer = ctx.Process(target=torch_dist_trainer_dies_mid_stream, args=(queue, go, port, b_tensors, bucket, 2))
    trainer.start()
    llm.init_weight_transfer_engine(
        {"backend": "torch_dist", "master_address": "127.0.0.1", "master_port": port, "dist_backend": "gloo"}
    )
    llm.start_weight_update()
    info = queue.get(timeout=60)
    threading.Timer(0.2, lambda: go.put("send")).start()  # the trainer sends two buckets, then exits
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="previous weights were restored"):
        llm.update_weights(info)
    assert time.monotonic() - start < 25
    assert llm.weight_checksums() == before and serves(llm, ckpts["A"])
    llm.shutdown_weight_transfer_engine()
    trainer.join()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensors", "shm", "torch_dist"])
def test_fifty_updates_keep_memory_and_shm_flat(ckpts, b_tensors, backend):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    a_tensors = list(load_file(str(ckpts["A"] / "model.safetensors")).items())
    pusher = Pusher(llm, backend)
    for i in range(5):  # warm-up: buffers and allocator pools reach their steady size
        pusher.push(b_tensors if i % 2 else a_tensors)
    rss, segments = rss_bytes(), shm_segments(creators={os.getpid()})
    for i in range(50):
        pusher.push(b_tensors if i % 2 else a_tensors)
    growth = rss_bytes() - rss
    assert growth < 16 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 50 updates"
    assert shm_segments(creators={os.getpid()}) == segments
    assert llm.get_weight_version() == 55
    pusher.close()
    assert not {
        s for s in shm_segments() if s in (pusher.shm.segment.name if pusher.shm and pusher.shm.segment else "")
    }


def test_truncated_checkpoint_is_rejected_before_any_data_moves(ckpts, tmp_path):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    before = llm.weight_checksums()
    broken = tmp_path / "truncated"
    shutil.copytree(ckpts["B"], broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match="truncated"):
        llm.reload_weights(weights_path=str(broken))
    llm.init_weight_transfer_engine({"backend": "disk"})
    llm.start_weight_update()
    with pytest.raises(ValueError, match="truncated"):
        llm.update_weights({"path": str(broken)})
    assert llm.weight_checksums() == before and serves(llm, ckpts["A"])
    assert llm.config.model_config.model == str(ckpts["A"])


def test_torch_dist_channel_is_closed_after_a_failed_update(ckpts, b_tensors):
    """A failed collective stream may be out of step with the trainer: the engine closes it rather than risk
    reading a later update's bytes as this one's."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    pusher = Pusher(llm, "torch_dist", sender_timeout_s=2)
    llm.start_weight_update()
    tensors, _ = bad_cases(b_tensors)["unknown_name"]
    with pytest.raises(ValueError, match="init_weight_transfer_engine"):
        pusher.update(tensors)
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine"):
        llm.start_weight_update()
    pusher = Pusher(llm, "torch_dist")
    pusher.push(b_tensors)
    assert serves(llm, ckpts["B"])
    pusher.close()


def backup_bytes(llm: LLM) -> int:
    (pool,) = llm.collective_rpc(lambda w: sum(t.numel() * t.element_size() for t in w.session.backups.values()))
    return pool


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_one_shot_in_memory_reload_needs_no_rollback_copy(ckpts, b_tensors, quantization):
    """reload_weights(weights_iterator=...) checks every declaration and value before its first write, so it keeps
    no rollback copy of the model; with fp8 layers, whose post-processing writes their weights mid-stream, it
    keeps them. A bad value leaves the weights bit-identical either way. A session, which may go on, keeps its
    copies."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, quantization=quantization)
    weights = sum(llm.apply_model(lambda m: [p.numel() * p.element_size() for p in m.parameters()])[0])
    llm.reload_weights(weights_iterator=iter(b_tensors))
    assert backup_bytes(llm) == (0 if quantization is None else weights)
    if quantization is None:
        assert serves(llm, ckpts["B"])
    before = llm.weight_checksums()
    tensors, message = bad_cases(b_tensors)["nan"]
    with pytest.raises(ValueError, match=message):
        llm.reload_weights(weights_iterator=tensors)
    assert llm.weight_checksums() == before
    llm.llm_engine.executor.collective_rpc(lambda w: w.session.release_backups())
    pusher = Pusher(llm, "tensors")
    pusher.push(b_tensors)
    assert backup_bytes(llm) >= 0.9 * weights  # the session copied what it overwrote
    pusher.close()


def test_torn_shm_write_is_rejected_and_rolled_back(ckpts, b_tensors, monkeypatch):
    """A trainer that starts rewriting its segment while the engine copies from it: the generation re-check after
    the copy catches it, and the update is rolled back."""
    from hotswap.transfer import shm

    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    before = llm.weight_checksums()
    sender = ShmSender()
    llm.init_weight_transfer_engine({"backend": "shm"})
    info = sender.write(b_tensors)
    original = shm.ShmEngine.source

    def torn_source(self, update_info):
        source = original(self, update_info)
        tensors = source.tensors

        def tearing():
            for i, item in enumerate(tensors()):
                if i == len(source.declared) // 2:  # the trainer prepares its next update mid-read
                    sender.prepare(b_tensors)
                yield item

        source.tensors = tearing
        return source

    monkeypatch.setattr(shm.ShmEngine, "source", torn_source)
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match=r"overwrote the shared buffer.*previous weights were restored"):
        llm.update_weights(info)
    assert llm.weight_checksums() == before and serves(llm, ckpts["A"])
    monkeypatch.setattr(shm.ShmEngine, "source", original)
    llm.start_weight_update()
    llm.update_weights(sender.write(b_tensors))
    llm.finish_weight_update()
    assert serves(llm, ckpts["B"])
    sender.close()


def test_shm_mapping_is_read_only_and_outlives_its_views(tmp_path):
    """The engine maps a trainer's segment read-only, and shutting the transport down while a tensor view still
    exists leaves the view readable (the mapping goes with the last view, never under it)."""
    import subprocess
    import sys

    script = """
import torch
from hotswap.config import WeightTransferConfig
from hotswap.transfer.shm import ShmEngine, ShmSender
sender = ShmSender()
info = sender.write([("w", torch.arange(1000, dtype=torch.float32))])
engine = ShmEngine({"backend": "shm"}, WeightTransferConfig())
(name, view), = list(engine.source(info).tensors())
assert engine.segments[info["shm_name"]].buf.readonly
engine.shutdown()
import gc; gc.collect()
print(float(view.sum()))
sender.close()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) == sum(range(1000))


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return f"/dev/shm/{name}" in f.read()


def test_a_foreign_shared_memory_segment_is_refused_before_it_is_mapped(ckpts):
    """An shm update naming another process's segment (any name but a ShmSender's), or a segment with a sender's
    name that holds no hotswap header, is refused before the engine maps it: afterwards this process holds no
    mapping of it, and the weights are unchanged."""
    import _posixshmem
    import uuid

    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    llm.init_weight_transfer_engine({"backend": "shm"})
    sender = ShmSender()
    info, _ = sender.prepare([("model.norm.weight", torch.ones(64))])  # a real declaration and layout
    before = llm.weight_checksums()
    tag = uuid.uuid4().hex[:12]
    names = {f"app_{tag}": "must name a segment of a hotswap ShmSender", f"hotswap_{tag}": "not a hotswap weight"}
    for name in names:  # made without mapping them here, as another process would
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        os.ftruncate(fd, 1 << 16)
        os.pwrite(fd, os.urandom(1 << 16), 0)
        os.close(fd)
    try:
        for name, problem in names.items():
            llm.start_weight_update()
            with pytest.raises(ValueError, match=problem):
                llm.update_weights({**info, "shm_name": name})
            assert not _mapped(name)
        assert llm.weight_checksums() == before and serves(llm, ckpts["A"])
    finally:
        for name in names:
            _posixshmem.shm_unlink("/" + name)
        sender.close()
