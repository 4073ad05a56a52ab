"""The cuda_ipc transport over a trainer in a second process: handles made by torch's reductions (on the CPU,
`file_system` shared-memory segments; on a GPU, CUDA IPC), read only through the restricted unpickler, checked
against the declaration before anything is opened, every value checked before the first write, and nothing of the
trainer's memory kept once the update call returned. SGLang's /update_weights_from_tensor through a real server."""

from __future__ import annotations

import base64
import gc
import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from conftest import PROMPTS, hf_greedy, serves
from hotswap import LLM
from hotswap.transfer import safe_pickle
from hotswap.transfer.cuda_ipc import CudaIpcSender, dumps, open_update
from hotswap.weights.checksum import tensor_sha256
from server_helpers import post, running_server

TRAINER = r"""
import base64, gc, json, sys, traceback
import torch
from safetensors.torch import load_file
from torch.multiprocessing.reductions import reduce_tensor
from hotswap.transfer.base import declare
from hotswap.weights.checksum import tensor_sha256
from hotswap.transfer.cuda_ipc import CudaIpcSender, device_key, dumps, pack

device = torch.device(sys.argv[1])
key = device_key(device)
sender = CudaIpcSender()
b64 = lambda data: base64.b64encode(data).decode()

def export(file, form, nan=None, truncate=None, names=None, device_index=None):
    named = [(n, t.to(device)) for n, t in load_file(file).items() if names is None or n in names]
    if nan is not None:
        dict(named)[nan].view(-1)[3] = float("nan")
    if truncate is not None:
        named = [(n, t[:7] if n == truncate else t) for n, t in named]
    if device.type == "cuda":  # written on a side stream, unsynchronized: CudaIpcSender's export orders it
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            named = [(n, (t * 1).contiguous()) for n, t in named]
        if form.startswith("vllm"):  # vLLM's trainers synchronize themselves
            torch.cuda.synchronize(device)
    if form in ("tensors", "bucket"):
        info = sender.update_info(named, bucket=form == "bucket")
        return info, {n: tensor_sha256(t) for n, t in named}
    if form.startswith("sglang"):
        info = {"payload": sender.sglang_payload(named, flattened_bucket=form == "sglang_bucket")}
        return info, {n: tensor_sha256(t) for n, t in named}
    sums = {n: tensor_sha256(t) for n, t in named}
    if form == "vllm_packed":  # one buffer, tensors back to back, vLLM's packed ipc form
        flat, offsets = pack(named, align=1)
        sender.exported.append(flat)
        sizes = [t.numel() * t.element_size() for _, t in named]
        handle = b64(dumps({key: reduce_tensor(flat)}))
        return {**declare(named), "tensor_sizes": sizes, "ipc_handles_pickled": handle}, sums
    sender.exported.extend(t for _, t in named)
    handles = [reduce_tensor(t) for _, t in named]
    if device_index is not None:  # rebuild_cuda_tensor's arguments alone, another device index in slot 6
        handles = [tuple(args[:6]) + (device_index,) + tuple(args[7:]) for _, args in handles]
    decl = declare(named)
    return {"names": decl["names"], "dtype_names": decl["dtypes"], "shapes": decl["shapes"],
            "ipc_handles_pickled": b64(dumps([{key: h} for h in handles]))}, sums

def scribble():
    for t in sender.exported:
        t.fill_(255 if t.dtype == torch.uint8 else float("nan"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)

for line in sys.stdin:
    command = json.loads(line)
    op = command.pop("op")
    try:
        if op == "export":
            info, sums = export(**command)
            reply = {"info": info, "checksums": sums}
        elif op == "scribble":  # the trainer reuses its memory the moment update_weights returned
            scribble()
            reply = {"ok": True}
        elif op == "release":
            sender.release()
            gc.collect()
            reply = {"ok": True}
    except Exception:
        reply = {"error": traceback.format_exc()}
    print(json.dumps(reply), flush=True)
"""


class Trainer:
    """A trainer process that exports checkpoint tensors on request (JSON lines over its stdin / stdout)."""

    def __init__(self, device: str = "cpu") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, device], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def ask(self, op: str, **command) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **command}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the trainer process exited"
        reply = json.loads(line)
        assert "error" not in reply, reply["error"]
        return reply

    def export(self, path: Path, form: str, **options) -> tuple[dict, dict[str, str]]:
        reply = self.ask("export", file=str(path / "model.safetensors"), form=form, **options)
        return reply["info"], reply["checksums"]

    def segments(self) -> set[str]:
        """The shared-memory segments this trainer created that still exist."""
        return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{self.proc.pid}_")}

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def trainer():
    proc = Trainer()
    yield proc
    proc.close()


class Reduces:
    """Pickles as `function(*args)`: a payload made by hand."""

    def __init__(self, function, *args) -> None:
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def evil_payload(marker: Path) -> str:
    """What `pickle.loads` would turn into `os.system("touch <marker>")`."""
    return base64.b64encode(pickle.dumps([Reduces(os.system, f"touch {marker}")])).decode()


def holds(llm: LLM, sums: dict[str, str]) -> bool:
    """Whether the engine holds exactly the tensors these checksums were taken of."""
    held = llm.weight_checksums()
    return {name: held[name] for name in sums} == sums


def checkpoint_sums(path: Path) -> dict[str, str]:
    return {name: tensor_sha256(t) for name, t in load_file(str(path / "model.safetensors")).items()}


def push(llm: LLM, info: dict) -> None:
    llm.start_weight_update()
    llm.update_weights(info)
    llm.finish_weight_update()


# ---- the restricted unpickler ----------------------------------------------------------------------------------


def globals_of(data: bytes, monkeypatch) -> set[str]:
    """The globals a pickle names, as the restricted unpickler is asked for them while it loads `data`."""
    asked: set[str] = set()
    resolve = safe_pickle.resolve

    def recording(module: str, name: str):
        asked.add(f"{module}.{name}")
        return resolve(module, name)

    with monkeypatch.context() as patch:
        patch.setattr(safe_pickle, "resolve", recording)
        safe_pickle.loads(data)
    return asked


def test_the_unpickler_refuses_every_other_global_and_runs_nothing(tmp_path):
    from torch.multiprocessing.reductions import rebuild_storage_fd, rebuild_storage_filename, rebuild_tensor

    marker = tmp_path / "pwned"
    evil = Reduces(os.system, f"touch {marker}")
    cases = {
        "posix.system": pickle.dumps([evil]),
        "builtins.eval": pickle.dumps(Reduces(eval, "print(1)")),
        "subprocess.Popen": pickle.dumps(Reduces(subprocess.Popen, ["touch", str(marker)])),
        "torch.serialization.load": pickle.dumps(Reduces(torch.load, "x")),
        "posix.system ": dumps([torch.zeros(2), evil]),  # after a real handle, in the same pickle
    }
    for name, data in cases.items():
        with pytest.raises(safe_pickle.RefusedGlobal, match=rf"global {name.strip()}\..*allowlist: .*rebuild_cuda"):
            safe_pickle.loads(data)
    assert not marker.exists()
    with pytest.raises(ValueError, match="file_descriptor strategy"):  # torch's default strategy's handles
        safe_pickle.loads(pickle.dumps(Reduces(rebuild_storage_fd, torch.UntypedStorage, 3, 8)))
    with pytest.raises(ValueError, match="pickled by value"):  # plain pickle of a tensor: its bytes, not a handle
        safe_pickle.loads(pickle.dumps(torch.zeros(2)))
    for garbage in (b"", b"\x80\x04garbage", bytes(range(64)), "not base64!", pickle.dumps(Reduces(torch.Tensor, 5))):
        with pytest.raises(ValueError, match=r"not a readable pickle|not valid base64"):
            safe_pickle.loads(garbage)
    # allowlisted functions with arguments no real handle has: a segment that is not torch's, a tensor past its storage
    manager = b"/tmp/torch-shm-dir-x/manager.sock"
    with pytest.raises(ValueError, match="not a torch shared-memory segment"):
        safe_pickle.loads(
            pickle.dumps(Reduces(rebuild_storage_filename, torch.UntypedStorage, manager, b"/hotswap_1_x", 8))
        )
    storage = torch.zeros(6)._typed_storage()
    with pytest.raises(ValueError, match="reaches 400 bytes, past its storage's 24"):
        safe_pickle.loads(dumps(Reduces(rebuild_tensor, torch.Tensor, storage, (0, torch.Size([100]), (1,), False))))


def test_the_unpickler_reads_the_payloads_torch_vllm_and_sglang_make(monkeypatch):
    """The globals real payloads name are all on the allowlist: a ForkingPickler of CPU tensors (file_system
    segments), vLLM's plain pickle of rebuild_cuda_tensor's arguments (old: with the function; new: alone), SGLang's
    patched reductions (the GPU's UUID where torch puts the device index) and its flattened-bucket metadata."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    tensors = [torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)[1:], torch.empty(0)]
    data = dumps(tensors)
    assert globals_of(data, monkeypatch) == {
        "torch.multiprocessing.reductions.rebuild_tensor",
        "torch.multiprocessing.reductions.rebuild_typed_storage",
        "torch.multiprocessing.reductions.rebuild_storage_filename",
        "torch.multiprocessing.reductions.rebuild_storage_empty",
        "torch.Tensor",
        "torch.storage.UntypedStorage",
        "torch.float32",
        "torch.bfloat16",
        "torch.Size",
    }
    handles = safe_pickle.loads(data)
    assert [(h.dtype, h.size, h.stride, h.offset) for h in handles] == [
        (torch.float32, (2, 3), (3, 1), 0),
        (torch.bfloat16, (3,), (1,), 1),
        (torch.float32, (0,), (1,), 0),
    ]
    assert handles[2].storage is None and handles[0].storage.name.startswith(b"/torch_")
    # what reduce_tensor returns for a CUDA tensor: rebuild_cuda_tensor and its 15 arguments
    args = (
        torch.Tensor,
        torch.Size([2, 3]),
        (3, 1),
        0,
        torch.storage.TypedStorage,
        torch.float16,
        3,
        b"h" * 64,
        12,
        512,
        False,
        b"/torch_1_2_3",
        8,
        b"e" * 64,
        True,
    )
    for payload in ([{"GPU-a": (rebuild_cuda_tensor, args)}], [{"GPU-a": args}]):
        data = pickle.dumps(payload)
        assert globals_of(data, monkeypatch) <= {
            "torch.multiprocessing.reductions.rebuild_cuda_tensor",
            "torch.Tensor",
            "torch.Size",
            "torch.storage.TypedStorage",
            "torch.float16",
        }
        handle = safe_pickle.as_handle(safe_pickle.loads(data)[0]["GPU-a"])
        assert (handle.size, handle.dtype, handle.device, handle.storage_offset_bytes) == (
            (2, 3),
            torch.float16,
            3,
            512,
        )
    with pytest.raises(ValueError, match="reaches 14 bytes, past its storage's 12"):
        safe_pickle.as_handle(safe_pickle.loads(pickle.dumps((torch.Tensor, (2, 3), (3, 1), 1, *args[4:]))))
    # SGLang's reductions and dataclasses, from a module of theirs
    for package in ("sglang", "sglang.srt", "sglang.srt.utils"):
        monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
    module = types.ModuleType("sglang.srt.utils.patch_torch")

    def _rebuild_cuda_tensor_modified(*a):
        raise AssertionError("never called")

    class FlattenedTensorMetadata:
        def __init__(self, **fields):
            self.__dict__.update(fields)

    for obj in (_rebuild_cuda_tensor_modified, FlattenedTensorMetadata):
        obj.__module__, obj.__qualname__ = module.__name__, obj.__name__
        setattr(module, obj.__name__, obj)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    uuid_args = (*args[:6], "GPU-1234", *args[7:])
    meta = FlattenedTensorMetadata(
        name="w", shape=torch.Size([3]), dtype=torch.float32, start_idx=0, end_idx=12, numel=3
    )
    loaded = safe_pickle.loads(
        pickle.dumps({"flattened_tensor": (_rebuild_cuda_tensor_modified, uuid_args), "metadata": [meta]})
    )
    assert safe_pickle.as_handle(loaded["flattened_tensor"]).device == "GPU-1234"
    assert [loaded["metadata"][0].field(k) for k in ("name", "end_idx")] == ["w", 12]


# ---- updates of an engine from a trainer process ----------------------------------------------------------------


@pytest.mark.parametrize("form", ["tensors", "bucket"])
def test_update_serves_b_and_ignores_a_trainer_rewriting_right_after(ckpts, trainer, form):
    """Per-tensor handles and one flat bucket both update the engine to B; the trainer overwrites every byte it
    exported (NaN) as soon as update_weights returned, before finish: the engine holds what was sent, and once the
    trainer released, none of its segments is left."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    llm.init_weight_transfer_engine({"backend": "cuda_ipc"})
    info, sums = trainer.export(ckpts["B"], form)
    assert sums == checkpoint_sums(ckpts["B"])
    json.dumps(info)  # JSON-safe
    llm.start_weight_update()
    llm.update_weights(info)
    trainer.ask("scribble")
    llm.finish_weight_update()
    assert holds(llm, sums) and serves(llm, ckpts["B"])
    trainer.ask("release")
    assert not trainer.segments()
    llm.shutdown_weight_transfer_engine()


def test_the_declaration_is_checked_before_anything_is_opened(ckpts, trainer, tmp_path):
    """A wrong shape (declared honestly), a declaration its handle contradicts, handles for another GPU only, an evil
    pickle, a bucket too short: each a ValueError naming the problem, the weights bit-identical, still serving A."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    before = llm.weight_checksums()
    llm.init_weight_transfer_engine({"backend": "cuda_ipc"})
    marker = tmp_path / "pwned"
    good, _ = trainer.export(ckpts["B"], "tensors")
    bucket, _ = trainer.export(ckpts["B"], "bucket")
    truncated, _ = trainer.export(ckpts["B"], "tensors", truncate="model.norm.weight")
    norm = good["names"].index("model.norm.weight")
    cases = {
        r"model\.norm\.weight: expected shape \(64,\)": truncated,
        r"model\.norm\.weight: its handle holds a float32 tensor of shape \(64,\), but the update declares float32 "
        r"\(7,\)": {**good, "shapes": [[7] if i == norm else s for i, s in enumerate(good["shapes"])]},
        "no handles for this engine's device 'cpu'": {**good, "handles": {"GPU-0": good["handles"]["cpu"]}},
        r"global posix\.system.*allowlist": {**good, "handles": {"cpu": evil_payload(marker)}},
        r"model\.norm\.weight: bytes \d+\.\.\d+ lie past the bucket": {
            **bucket,
            "offsets": [*bucket["offsets"][:norm], 1 << 30, *bucket["offsets"][norm + 1 :]],
        },
        "one of 'handles' or 'bucket'": {**good, "bucket": bucket["bucket"]},
    }
    for message, info in cases.items():
        llm.start_weight_update()
        with pytest.raises(ValueError, match=message):
            llm.update_weights(info)
        assert llm.weight_checksums() == before, message
    assert not marker.exists()
    assert serves(llm, ckpts["A"])
    trainer.ask("release")
    assert not trainer.segments()
    push(llm, trainer.export(ckpts["B"], "bucket")[0])  # the transport still takes a good update
    assert serves(llm, ckpts["B"])
    trainer.ask("release")


def test_a_nan_rolls_the_whole_session_back_bit_exactly(ckpts, trainer):
    """The first update of a session writes half of B; the second carries a NaN: refused before its first write,
    the session rolled back, every byte as before."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    before = llm.weight_checksums()
    llm.init_weight_transfer_engine({"backend": "cuda_ipc"})
    names = sorted(checkpoint_sums(ckpts["B"]))
    first, _ = trainer.export(ckpts["B"], "tensors", names=names[:10])
    second, _ = trainer.export(ckpts["B"], "bucket", names=names[10:], nan="model.layers.1.mlp.down_proj.weight")
    llm.start_weight_update()
    llm.update_weights(first)
    assert llm.weight_checksums() != before
    with pytest.raises(ValueError, match=r"NaN or Inf.*down_proj"):
        llm.update_weights(second)
    assert llm.weight_checksums() == before and serves(llm, ckpts["A"])
    llm.shutdown_weight_transfer_engine()  # a failed update's tensors are let go at the next update, or here
    gc.collect()  # the refused update's traceback held its frames
    trainer.ask("release")
    assert not trainer.segments()


@pytest.mark.parametrize("form", ["vllm", "vllm_packed"])
def test_vllms_ipc_wire_form(ckpts, trainer, form):
    """vLLM's `ipc` backend name and fields: `dtype_names`, `ipc_handles_pickled` holding one {key: handle} per tensor
    (reduce_tensor's (function, arguments) pair), or one for a packed buffer with `tensor_sizes`."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    llm.init_weight_transfer_engine({"backend": "ipc"})
    info, sums = trainer.export(ckpts["B"], form)
    push(llm, info)
    assert holds(llm, sums)
    trainer.ask("release")
    assert not trainer.segments()


@pytest.mark.unit
def test_vllms_python_object_handles_take_the_same_checks():
    """`ipc_handles` passed as Python objects are pickled and read by the same restricted unpickler: a CPU tensor's
    storage inside them would travel by value (refused, saying so); CUDA handles need an engine on a GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    declared = [("w", torch.float32, (2,))]
    info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
    with pytest.raises(ValueError, match="pickled by value"):
        open_update({**info, "ipc_handles": [{"cpu": reduce_tensor(torch.zeros(2))}]}, declared, torch.device("cpu"))
    args = (
        torch.Tensor,
        torch.Size([2]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.float32,
        0,
        b"h" * 64,
        8,
        0,
        False,
        b"/torch_1_2_3",
        0,
        None,
        False,
    )
    with pytest.raises(ValueError, match="reached an engine on cpu"):
        open_update({**info, "ipc_handles": [{"cpu": (rebuild_cuda_tensor, args)}]}, declared, torch.device("cpu"))


@pytest.mark.unit
def test_a_cuda_handle_is_rebuilt_with_the_engines_device_index(monkeypatch):
    """What `rebuild_cuda_tensor` receives (recorded here; the GPU test opens real handles): the exporter's arguments
    in torch's order, the device index (slot 6) replaced by the engine's, a plain tensor that requires no grad."""
    import inspect

    from torch.multiprocessing import reductions

    from hotswap.transfer.cuda_ipc import open_handle

    parameters = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert len(parameters) == 15 and parameters[6] == "storage_device" and parameters[10] == "requires_grad"
    calls = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: calls.append(args) or "opened")
    args = (
        torch.nn.Parameter,
        torch.Size([2, 3]),
        (3, 1),
        4,
        torch.storage.TypedStorage,
        torch.bfloat16,
        5,
        b"h" * 64,
        64,
        512,
        True,
        b"/torch_1_2_3",
        8,
        b"e" * 64,
        True,
    )
    handle = safe_pickle.as_handle(safe_pickle.loads(pickle.dumps(args)))
    assert open_handle(handle, torch.device("cuda", 1)) == "opened"
    assert calls == [
        (
            torch.Tensor,
            torch.Size([2, 3]),
            (3, 1),
            4,
            torch.storage.TypedStorage,
            torch.bfloat16,
            1,
            b"h" * 64,
            64,
            512,
            False,
            b"/torch_1_2_3",
            8,
            b"e" * 64,
            True,
        )
    ]


def test_the_sender_keeps_exports_alive_until_release():
    """Exporting moves a CPU tensor into a shared segment in place; release() lets the segment go (here, in one
    process, the engine side is the test itself: it opens and drops the handle)."""
    tensor = torch.arange(8.0)
    sender = CudaIpcSender()
    info = sender.update_info([("t", tensor)])
    assert tensor.is_shared() and sender.exported
    opened = open_update(info, [("t", torch.float32, (8,))], torch.device("cpu"))
    assert torch.equal(opened[0][1], tensor)
    tensor.add_(1)  # the handle is the trainer's memory itself (the engine copies it into its weights)
    assert torch.equal(opened[0][1], tensor)
    del opened
    with sender:
        pass
    assert not sender.exported


# ---- SGLang's route ------------------------------------------------------------------------------------------


@pytest.mark.cpu_only
def test_sglang_update_weights_from_tensor_route(ckpts, trainer, tokenizer, tmp_path):
    """An evil pickle is a 400 that names the refused global (nothing runs, the weights are bit-identical, the server
    serves); a flattened bucket and then (name, tensor) pairs are 200s that version the update and hold what was
    sent; no segment of the trainer is left once it released. vLLM's /update_weights takes the same handles."""
    ids = tokenizer.encode(PROMPTS[0])
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    with running_server(str(ckpts["A"]), "--admin-auth", "none", "--kv-cache-memory-bytes", str(1 << 23)) as base:
        before = httpx.get(f"{base}/weight_checksums").json()["checksums"]
        marker = tmp_path / "pwned"
        r = post(base, "/update_weights_from_tensor", serialized_named_tensors=[evil_payload(marker)])
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        assert "refused to unpickle the global posix.system" in r.json()["message"]
        r = post(base, "/update_weights_from_tensor", serialized_named_tensors=["x"], load_format="direct")
        assert r.status_code == 400 and "load_format" in r.json()["message"]
        assert not marker.exists()
        assert httpx.get(f"{base}/weight_checksums").json()["checksums"] == before
        assert post(base, "/generate", **body).json()["output_ids"] == hf_greedy(str(ckpts["A"]), tuple(ids), 8)[0]
        for form, path, version in (("sglang_bucket", ckpts["B"], "7"), ("sglang_pairs", ckpts["A"], "8")):
            info, sums = trainer.export(path, form)
            fmt = "flattened_bucket" if form == "sglang_bucket" else None
            r = post(
                base,
                "/update_weights_from_tensor",
                serialized_named_tensors=[info["payload"]],
                load_format=fmt,
                weight_version=version,
                flush_cache=True,
            )
            assert r.status_code == 200 and r.json()["success"], r.text
            trainer.ask("scribble")
            held = httpx.get(f"{base}/weight_checksums").json()["checksums"]
            assert {name: held[name] for name in sums} == sums
            assert httpx.get(f"{base}/get_weight_version").json()["weight_version"] == version
            expected = hf_greedy(str(path), tuple(ids), 8)[0]
            assert post(base, "/generate", **body).json()["output_ids"] == expected
            trainer.ask("release")
            assert not trainer.segments()
        # vLLM's routes carry the same update_info as JSON: an evil pickle is a 400, then a good bucket is taken
        checksums = httpx.get(f"{base}/weight_checksums").json()["checksums"]
        assert post(base, "/init_weight_transfer_engine", init_info={"backend": "ipc"}).status_code == 200
        info, sums = trainer.export(ckpts["B"], "bucket")
        for update, status in (({**info, "bucket": {"cpu": evil_payload(marker)}}, 400), (info, 200)):
            assert post(base, "/start_weight_update").status_code == 200
            r = post(base, "/update_weights", update_info=update)
            assert r.status_code == status, r.text
            if status == 400:
                assert "posix.system" in r.text and not marker.exists()
                assert httpx.get(f"{base}/weight_checksums").json()["checksums"] == checksums
        assert post(base, "/finish_weight_update").status_code == 200
        held = httpx.get(f"{base}/weight_checksums").json()["checksums"]
        assert {name: held[name] for name in sums} == sums
        trainer.ask("release")
        assert not trainer.segments()


# ---- on a GPU (pytest --device cuda) ---------------------------------------------------------------------------


@pytest.fixture
def gpu_trainer(device):
    proc = Trainer(device)
    yield proc
    proc.close()


@pytest.mark.cuda
def test_cuda_handles_open_on_the_engines_gpu_whatever_index_the_trainer_gave(ckpts, device, gpu_trainer):
    """Handles keyed by the GPU's UUID; the device index in rebuild_cuda_tensor's arguments (slot 6) is the
    trainer's numbering, replaced by the engine's own: a bogus index still opens on the right GPU. Handles for
    another UUID only are refused."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, device=device)
    llm.init_weight_transfer_engine({"backend": "ipc"})
    info, sums = gpu_trainer.export(ckpts["B"], "vllm", device_index=7)
    push(llm, info)
    assert holds(llm, sums)
    gpu_trainer.ask("release")
    info, _ = gpu_trainer.export(ckpts["A"], "tensors")
    before = llm.weight_checksums()
    llm.start_weight_update()
    with pytest.raises(ValueError, match="no handles for this engine's device"):
        llm.update_weights({**info, "handles": {"GPU-00000000-0000-0000-0000-000000000000": "x"}})
    assert llm.weight_checksums() == before
    gpu_trainer.ask("release")


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["tensors", "bucket"])
def test_cuda_update_is_synchronized_before_update_weights_returns(ckpts, device, gpu_trainer, form):
    """The trainer writes its tensors on a side stream without waiting and exports them; the engine waits for those
    writes before reading, and for its reads before update_weights returns: the trainer overwriting every exported
    byte right after leaves the engine holding exactly what was sent."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, device=device)
    llm.init_weight_transfer_engine({"backend": "cuda_ipc"})
    for path in (ckpts["B"], ckpts["A"], ckpts["B"]):
        info, sums = gpu_trainer.export(path, form)
        llm.start_weight_update()
        llm.update_weights(info)
        gpu_trainer.ask("scribble")
        llm.finish_weight_update()
        assert holds(llm, sums)
        gpu_trainer.ask("release")
