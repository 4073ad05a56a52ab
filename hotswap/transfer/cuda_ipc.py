"""CUDA IPC transport: the engine reads the tensors of a trainer on the same machine where they lie, through
handles the trainer exports with torch's reductions (on a GPU: CUDA IPC memory handles; on the CPU, which the tests
use: torch's `file_system` shared-memory segments).

Trainer side:

    llm.init_weight_transfer_engine({"backend": "cuda_ipc"})
    with CudaIpcSender() as sender:                 # keeps what it exported alive until released
        llm.start_weight_update()
        llm.update_weights(sender.update_info(model.named_parameters()))      # one handle per tensor
        llm.update_weights(sender.update_info(buffers, bucket=True))          # or one flat uint8 bucket
        llm.finish_weight_update()
    # leaving the block (release()) lets the trainer reuse or free that memory (torch.cuda.ipc_collect())

The update_info ({"backend": "cuda_ipc"} or its alias "ipc") is JSON-safe: the declaration (`names`, `dtypes`,
`shapes`) and either `handles` ({device key: base64 pickle of the list of tensors}) or `bucket` ({device key: base64
pickle of one flat uint8 tensor}) with `offsets` (each tensor's byte offset in it; its size follows from its dtype
and shape). The device key is the GPU's UUID (`torch.cuda.get_device_properties(i).uuid`: a receiver that numbers
the GPUs otherwise finds its own) or "cpu". vLLM's `ipc` form is read too: `ipc_handles` (Python objects, as Ray
passes them) or `ipc_handles_pickled` (their base64 pickle), a list with one {GPU UUID: handle} per tensor, or one
{GPU UUID: handle} for a packed buffer with `tensor_sizes` (bytes per tensor, back to back); a handle is
`rebuild_cuda_tensor`'s arguments, or the (function, arguments) pair `reduce_tensor` returns. SGLang's
`serialized_named_tensors` (one base64 `MultiprocessingSerializer` pickle per tensor-parallel rank: (name, tensor)
pairs, or with `load_format` "flattened_bucket" a flat tensor and per-tensor metadata) are read by `open_sglang`.

Every pickle is read by `hotswap.transfer.safe_pickle` (nothing it names runs); the handles are checked against the
declaration (dtype, shape, bounds) before one is opened. The engine opens them onto its own device (a CUDA handle
is rebuilt with the engine's device index in place of the exporter's) and returns an in-memory source, so every
value is checked before the first write. CUDA reads are synchronized twice: after opening (the trainer's writes are
done) and before the update call returns (the engine's reads are done), so a trainer may rewrite its memory as soon
as `update_weights` returned. The engine lets go of the trainer's memory when the update succeeds; after a failed one,
at the next update or `shutdown_weight_transfer_engine()`.

CPU segments: the sender's reduction takes no reference on the receiver's behalf (torch's own does, for the receiver
to drop), so a segment goes once the sender released it and every engine that opened it let go, however many ranks
opened it, or none. A sender that dies without releasing leaves its segments to torch's shared-memory manager, which
removes them when its last client process exits.
"""

from __future__ import annotations

import base64
import io
import math
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from hotswap.config import WeightTransferConfig
from hotswap.transfer.base import TransferEngine, declare, declared_from_info, dtype_name, parse_dtype
from hotswap.transfer.safe_pickle import (
    CpuHandle,
    CudaHandle,
    LocalSerializedTensor,
    SglangRecord,
    TensorHandle,
    as_handle,
    loads,
)
from hotswap.weights.update import Declared, WeightSource

_ALIGN = 64  # byte alignment of each tensor in a bucket the sender packs
_SEGMENT_HEADER = 64  # torch's refcounted shared-memory segments start with this header, then the storage's bytes
Pairs = list[tuple[str, torch.Tensor]]


def device_key(device: torch.device) -> str:
    """The key a sender files its handles under for `device`: the GPU's UUID, or "cpu"."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    if device.type == "cpu":
        return "cpu"
    raise ValueError(f"the cuda_ipc transport handles CUDA and CPU tensors, not {device.type}")


# ---- trainer side ---------------------------------------------------------------------------------------------


def _reduce_cpu_storage(storage: torch.UntypedStorage) -> tuple[Callable[..., object], tuple[object, ...]]:
    """A CPU storage as a `file_system` segment handle, whatever the process's sharing strategy (a file descriptor
    handle cannot cross to an unrelated process). The sender holds the storage until `release()`; unlike torch's
    own reduction this takes no extra reference for the receiver to drop, so the segment goes with the last of
    the sender's and the engine's mappings however often (or never) the handle was opened."""
    from torch.multiprocessing.reductions import rebuild_storage_empty, rebuild_storage_filename

    if storage.device.type != "cpu":
        raise ValueError(f"a {storage.device.type} storage reached the CPU storage reduction")
    if storage.nbytes() == 0:
        return rebuild_storage_empty, (type(storage),)
    manager, name, size = storage._share_filename_cpu_()
    return rebuild_storage_filename, (type(storage), manager, name, size)


def dumps(obj: object) -> bytes:
    """`obj` pickled with a ForkingPickler: tensors as torch's `reduce_tensor` exports them (CUDA IPC handles, CPU
    storages as `file_system` segments). The caller keeps the tensors alive while a receiver may open them."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # registers torch's reductions with ForkingPickler

    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage
    pickler.dump(obj)
    return buffer.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _shareable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached; a CPU tensor whose storage cannot move into shared memory in place is copied."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() and not tensor.is_shared():
        try:
            tensor.untyped_storage()._share_filename_cpu_()
        except RuntimeError:  # a storage torch cannot move: export a copy
            tensor = tensor.clone()
    return tensor


def _one_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"the tensors of one update must lie on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices), torch.device("cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the cuda_ipc transport exports CUDA and CPU tensors, not {device.type}")
    return device


def pack(pairs: Pairs, align: int = _ALIGN) -> tuple[torch.Tensor, list[int]]:
    """The tensors copied into one flat uint8 tensor on their device, each at an `align`-byte offset; (bucket,
    offsets)."""
    offsets, size = [], 0
    for _, tensor in pairs:
        offsets.append(size)
        size += (tensor.numel() * tensor.element_size() + align - 1) // align * align
    device = _one_device(t for _, t in pairs)
    bucket = torch.zeros(size, dtype=torch.uint8, device=device)
    for (_, tensor), offset in zip(pairs, offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            bucket[offset : offset + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return bucket, offsets


class CudaIpcSender:
    """Trainer side: exports tensors (CUDA tensors of one GPU, or CPU tensors, moved into shared memory in place)
    and keeps every exported tensor alive until `release()` (or the end of a `with` block), which the trainer calls
    once the engine's `update_weights` (or the HTTP call) returned. Not thread-safe."""

    def __init__(self) -> None:
        self.exported: list[torch.Tensor] = []

    def _export(self, tensors: list[torch.Tensor]) -> None:
        self.exported.extend(tensors)

    @staticmethod
    def _pairs(named_tensors: Iterable[tuple[str, torch.Tensor]], share: bool) -> Pairs:
        """The pairs detached; with `share`, CPU tensors moved into shared memory (they are exported themselves). On
        a GPU, first waits for the work queued on every stream: the engine waits only for the event an export records
        on the current stream (after a bucket's copies), so writes on other streams must be done before."""
        pairs = [(str(name), _shareable(t) if share else t.detach()) for name, t in named_tensors]
        for device in {t.device for _, t in pairs if t.device.type == "cuda"}:
            torch.cuda.synchronize(device)
        return pairs

    def update_info(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket: bool = False) -> dict[str, Any]:
        """The update_info of these tensors: one handle per tensor, or with `bucket` one flat uint8 bucket (a copy,
        each tensor at a 64-byte aligned offset). Both carry the declaration."""
        pairs = self._pairs(named_tensors, share=not bucket)
        key = device_key(_one_device(t for _, t in pairs))
        info: dict[str, Any] = {**declare(pairs)}
        if bucket:
            flat, offsets = pack(pairs)
            self._export([flat])
            info.update(bucket={key: _b64(dumps(flat))}, offsets=offsets)
        else:
            self._export([t for _, t in pairs])
            info["handles"] = {key: _b64(dumps([t for _, t in pairs]))}
        return info

    def sglang_payload(self, named_tensors: Iterable[tuple[str, torch.Tensor]], flattened_bucket: bool = True) -> str:
        """One entry of SGLang's `serialized_named_tensors` (send it once per tensor-parallel rank): a base64 pickle of
        the (name, tensor) pairs, or with `flattened_bucket` of {"flattened_tensor": uint8 bucket, "metadata": [{name,
        shape, dtype, start_idx, end_idx, numel}]} with byte ranges (load_format "flattened_bucket")."""
        pairs = self._pairs(named_tensors, share=not flattened_bucket)
        if not flattened_bucket:
            self._export([t for _, t in pairs])
            return _b64(dumps(pairs))
        flat, offsets = pack(pairs, align=1)
        self._export([flat])
        metadata = [
            {
                "name": name,
                "shape": tuple(t.shape),
                "dtype": t.dtype,
                "start_idx": offset,
                "end_idx": offset + t.numel() * t.element_size(),
                "numel": t.numel(),
            }
            for (name, t), offset in zip(pairs, offsets, strict=True)
        ]
        return _b64(dumps({"flattened_tensor": flat, "metadata": metadata}))

    def release(self) -> None:
        """Drops every exported tensor; on a GPU, frees what the engine has let go (`torch.cuda.ipc_collect()`).
        Call it once the engine's update call returned. Safe to call twice."""
        cuda = any(t.device.type == "cuda" for t in self.exported)
        self.exported.clear()
        if cuda:
            torch.cuda.ipc_collect()

    def __enter__(self) -> CudaIpcSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---- opening handles (engine side) ----------------------------------------------------------------------------


def _open_cpu(handle: CpuHandle) -> torch.Tensor:
    if handle.storage is None:
        return torch.empty(handle.size, dtype=handle.dtype)
    segment = handle.storage
    name = segment.name.decode()
    try:
        available = os.stat(f"/dev/shm{name}").st_size - _SEGMENT_HEADER
    except OSError:
        raise ValueError(
            f"shared memory segment {name!r} does not exist (the trainer released it, or is gone)"
        ) from None
    if segment.nbytes > available:  # mapping more would grow the trainer's segment
        raise ValueError(f"the handle claims {segment.nbytes} bytes of segment {name!r}, which holds {available}")
    try:
        storage = torch.UntypedStorage._new_shared_filename_cpu(segment.manager, segment.name, segment.nbytes)
    except RuntimeError as err:
        raise ValueError(f"cannot open shared memory segment {name!r} ({err}); is the trainer alive?") from None
    return torch.empty(0, dtype=handle.dtype).set_(storage, handle.offset, handle.size, handle.stride)


def _open_cuda(handle: CudaHandle, device: torch.device) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if device.type != "cuda":
        raise ValueError(f"a CUDA IPC handle reached an engine on {device}; send CPU shared tensors (key 'cpu') to it")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if isinstance(handle.device, str) and handle.device != device_key(torch.device("cuda", index)):
        raise ValueError(
            f"the handle was exported on GPU {handle.device}, but this engine runs on GPU "
            f"{device_key(torch.device('cuda', index))} (IPC shares memory of one GPU)"
        )
    try:
        tensor: torch.Tensor = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(handle.size),
            handle.stride,
            handle.offset,
            torch.storage.TypedStorage,
            handle.dtype,
            index,
            handle.handle,
            handle.storage_bytes,
            handle.storage_offset_bytes,
            False,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle,
            handle.event_sync_required,
        )
        return tensor
    except RuntimeError as err:
        raise ValueError(f"cannot open the CUDA IPC handle ({err}); is the trainer alive, on this machine?") from None


def open_handle(handle: TensorHandle, device: torch.device) -> torch.Tensor:
    """The tensor `handle` names, over the exporter's memory (CUDA handles onto `device`, whatever device index the
    exporter gave). Raises ValueError if it cannot be opened."""
    return _open_cpu(handle) if isinstance(handle, CpuHandle) else _open_cuda(handle, device)


def synchronize(device: torch.device) -> None:
    """Waits for `device`'s queued work (reads from a trainer's memory included); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _select(entries: object, key: str, what: str) -> object:
    """The entry of `entries` ({device key: handle(s)}) for the engine whose key is `key`, else a "cpu" one."""
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{what} must map a GPU UUID (or 'cpu') to handles, got {type(entries).__name__}")
    for candidate in (key, "cpu"):
        if candidate in entries:
            return entries[candidate]
    raise ValueError(
        f"{what} holds no handles for this engine's device {key!r}; it has some for "
        f"{sorted(map(str, entries))[:8]} (IPC needs the trainer on the engine's machine and GPU)"
    )


def _expect(handle: TensorHandle, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorHandle:
    if handle.dtype != dtype or tuple(handle.size) != tuple(shape):
        raise ValueError(
            f"{name}: its handle holds a {dtype_name(handle.dtype)} tensor of shape {tuple(handle.size)}, "
            f"but the update declares {dtype_name(dtype)} {tuple(shape)}"
        )
    return handle


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _int_list(value: object, count: int, what: str) -> list[int]:
    if not isinstance(value, list | tuple) or len(value) != count or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} must list {count} non-negative integers (one per declared tensor)")
    return list(value)


def _unpack(flat: TensorHandle, declared: Declared, offsets: list[int], device: torch.device) -> Pairs:
    """Views of a flat bucket, one per declared tensor at its byte offset (a misaligned one is copied out)."""
    if len(flat.size) != 1 or (flat.size[0] > 1 and flat.stride[0] != 1):
        raise ValueError(f"a bucket must be one flat contiguous tensor, got size {flat.size} stride {flat.stride}")
    total = flat.size[0] * flat.dtype.itemsize
    for (name, dtype, shape), offset in zip(declared, offsets, strict=True):
        if offset + _nbytes(dtype, shape) > total:
            raise ValueError(f"{name}: bytes {offset}..{offset + _nbytes(dtype, shape)} lie past the bucket's {total}")
    data = open_handle(flat, device).view(torch.uint8)
    pairs = []
    for (name, dtype, shape), offset in zip(declared, offsets, strict=True):
        count = _nbytes(dtype, shape)
        if count == 0:
            pairs.append((name, torch.empty(shape, dtype=dtype, device=data.device)))
            continue
        part = data[offset : offset + count]
        if part.storage_offset() % dtype.itemsize:
            part = part.clone()
        pairs.append((name, part.view(dtype).view(shape)))
    return pairs


def _vllm_handles(update_info: dict[str, Any]) -> object:
    """vLLM's handles: `ipc_handles_pickled` read by the restricted unpickler; `ipc_handles` given as Python objects
    are pickled and read the same way (one check for every path)."""
    if update_info.get("ipc_handles_pickled") is not None:
        return loads(update_info["ipc_handles_pickled"], "ipc_handles_pickled")
    try:
        raw = pickle.dumps(update_info["ipc_handles"], pickle.HIGHEST_PROTOCOL)
    except Exception as err:
        raise ValueError(f"ipc_handles cannot be read as handles ({type(err).__name__}: {err})") from None
    return loads(raw, "ipc_handles")


def open_update(update_info: dict[str, Any], declared: Declared, device: torch.device) -> Pairs:
    """The declared tensors of a cuda_ipc update, opened onto `device` (see the module doc for the forms). Each handle
    is checked against the declaration before any is opened. Raises ValueError for a malformed or refused update."""
    forms = [f for f in ("handles", "bucket", "ipc_handles", "ipc_handles_pickled") if update_info.get(f) is not None]
    if len(forms) != 1:
        raise ValueError(
            "a cuda_ipc update carries one of 'handles' or 'bucket' (+ 'offsets'), or vLLM's "
            f"'ipc_handles' / 'ipc_handles_pickled'; got {forms or 'none'}"
        )
    key = device_key(device)
    if forms[0] == "handles":
        handles = loads(_select(update_info["handles"], key, "handles"), "handles")
        if not isinstance(handles, list) or len(handles) != len(declared):
            raise ValueError(f"handles must hold a list of {len(declared)} tensors (one per declared name)")
        checked = [_expect(as_handle(h, name), name, d, s) for h, (name, d, s) in zip(handles, declared, strict=True)]
        return [(name, open_handle(h, device)) for h, (name, _, _) in zip(checked, declared, strict=True)]
    if forms[0] == "bucket":
        flat = as_handle(loads(_select(update_info["bucket"], key, "bucket"), "bucket"), "the bucket")
        offsets = _int_list(update_info.get("offsets"), len(declared), "offsets")
        return _unpack(flat, declared, offsets, device)
    handles = _vllm_handles(update_info)
    if isinstance(handles, dict):  # packed: one buffer, the tensors back to back
        sizes = _int_list(update_info.get("tensor_sizes"), len(declared), "tensor_sizes (packed ipc_handles)")
        for (name, dtype, shape), size in zip(declared, sizes, strict=True):
            if size != _nbytes(dtype, shape):
                raise ValueError(f"{name}: tensor_sizes gives {size} bytes, its declaration {_nbytes(dtype, shape)}")
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return _unpack(as_handle(_select(handles, key, "ipc_handles"), "the packed buffer"), declared, offsets, device)
    if not isinstance(handles, list) or len(handles) != len(declared):
        raise ValueError(f"ipc_handles must list {len(declared)} {{GPU UUID: handle}} entries (one per declared name)")
    checked = [
        _expect(as_handle(_select(entry, key, f"ipc_handles[{i}]"), name), name, d, s)
        for i, (entry, (name, d, s)) in enumerate(zip(handles, declared, strict=True))
    ]
    return [(name, open_handle(h, device)) for h, (name, _, _) in zip(checked, declared, strict=True)]


# ---- SGLang's serialized_named_tensors ----------------------------------------------------------------------


SGLANG_LOAD_FORMATS = (None, "flattened_bucket")


def _meta(entry: object) -> tuple[str, torch.dtype, tuple[int, ...], int, int]:
    """(name, dtype, shape, start, end) of one flattened-bucket metadata entry (SGLang's dataclass, or a dict)."""
    get = entry.field if isinstance(entry, SglangRecord) else entry.get if isinstance(entry, dict) else None
    if get is None:
        raise ValueError(
            f"flattened bucket metadata entries must be FlattenedTensorMetadata or dicts, got {type(entry).__name__}"
        )
    name, shape, dtype, start, end = (get(k) for k in ("name", "shape", "dtype", "start_idx", "end_idx"))
    if not isinstance(name, str):
        raise ValueError("flattened bucket metadata: name must be a string")
    dtype = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype)
    dims = tuple(shape) if isinstance(shape, tuple | list) else None
    if dims is None or not all(type(d) is int and d >= 0 for d in dims):
        raise ValueError(f"flattened bucket metadata: {name}'s shape must list non-negative integers")
    if type(start) is not int or type(end) is not int or not 0 <= start <= end:
        raise ValueError(f"flattened bucket metadata: {name}'s start_idx / end_idx must be integers, start <= end")
    return name, dtype, dims, start, end


def _sglang_tensor(value: object, rank: int) -> TensorHandle:
    if isinstance(value, LocalSerializedTensor):  # serialized once per rank, each a pickle of its own
        values = value.field("values")
        if not isinstance(values, list | tuple) or not values:
            raise ValueError("LocalSerializedTensor.values must list one serialized tensor per rank")
        value = loads(values[rank] if rank < len(values) else values[0], "LocalSerializedTensor value")
    return as_handle(value, "a serialized_named_tensors value")


def open_sglang(serialized: object, load_format: object, device: torch.device, rank: int = 0) -> Pairs:
    """The tensors of SGLang's `serialized_named_tensors` (this rank's entry, or the only one), opened onto `device`:
    (name, tensor) pairs, or with `load_format` "flattened_bucket" {"flattened_tensor", "metadata"} (byte ranges of
    a uint8 bucket, or element ranges of a bucket of the tensors' one dtype). Raises ValueError for anything
    malformed or refused, before any handle is opened."""
    if load_format not in SGLANG_LOAD_FORMATS:
        raise ValueError(
            f"load_format {load_format!r} is not supported here; use null ((name, tensor) pairs) or 'flattened_bucket'"
        )
    if not isinstance(serialized, list) or not serialized:
        raise ValueError("serialized_named_tensors must list one serialized entry per tensor-parallel rank")
    entry = serialized[rank] if rank < len(serialized) else serialized[0]
    obj = loads(entry, "serialized_named_tensors entry")
    if load_format is None:
        if not isinstance(obj, list | tuple) or not all(isinstance(p, list | tuple) and len(p) == 2 for p in obj):
            raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
        if not all(isinstance(name, str) for name, _ in obj):
            raise ValueError("serialized_named_tensors: every name must be a string")
        handles = [(name, _sglang_tensor(value, rank)) for name, value in obj]
        return [(name, open_handle(handle, device)) for name, handle in handles]
    if not isinstance(obj, dict) or "flattened_tensor" not in obj or not isinstance(obj.get("metadata"), list | tuple):
        raise ValueError("a flattened bucket must hold {'flattened_tensor': tensor, 'metadata': [...]}")
    flat = as_handle(obj["flattened_tensor"], "flattened_tensor")
    metas = [_meta(m) for m in obj["metadata"]]
    declared: Declared = [(name, dtype, shape) for name, dtype, shape, _, _ in metas]
    scale = 1 if flat.dtype == torch.uint8 else flat.dtype.itemsize
    for name, dtype, shape, start, end in metas:
        if scale != 1 and dtype != flat.dtype:
            raise ValueError(
                f"{name}: a {dtype_name(dtype)} tensor in a {dtype_name(flat.dtype)} bucket; SGLang's "
                "multi-dtype buckets are uint8 with byte ranges"
            )
        if (end - start) * scale != _nbytes(dtype, shape):
            raise ValueError(f"{name}: its range {start}..{end} does not hold a {dtype_name(dtype)} {shape} tensor")
    return _unpack(flat, declared, [start * scale for _, _, _, start, _ in metas], device)


# ---- the engine ---------------------------------------------------------------------------------------------


def engine_device(init_info: dict[str, Any]) -> torch.device:
    """The device an engine receives onto: init_info["device"], else the engine's own (its config scope), else the
    CPU."""
    from hotswap.config import current_config_or_none
    from hotswap.device import parse_device

    name = init_info.get("device")
    if name is None:
        config = current_config_or_none()
        name = config.model_config.device if config is not None else "cpu"
    return torch.device(parse_device(str(name)))


class CudaIpcEngine(TransferEngine):
    """Worker side (init_info: {"backend": "cuda_ipc" | "ipc"}, optionally "device"). Nothing to connect; each update
    opens its handles, and the engine lets go of them when the update ends (or at the next update, or shutdown)."""

    def __init__(self, init_info: dict[str, Any], config: WeightTransferConfig) -> None:
        super().__init__(init_info, config)
        self.device = engine_device(init_info)
        self.opened: Pairs = []  # the current update's tensors, over the trainer's memory

    def source(self, update_info: dict[str, Any]) -> WeightSource:
        """The update's tensors, opened: an in-memory source (every value checked before the first write) whose
        `verify` waits for the engine's reads and lets go of the trainer's memory. Raises ValueError for a
        malformed or refused update (nothing opened then)."""
        from hotswap.distributed import current_parallel

        self.shutdown()
        if not isinstance(update_info, dict):
            raise ValueError(f"update_info must be a dict, got {type(update_info).__name__}")
        if update_info.get("serialized_named_tensors") is not None:
            pairs = open_sglang(
                update_info["serialized_named_tensors"],
                update_info.get("load_format"),
                self.device,
                current_parallel().rank,
            )
            declared: Declared = [(name, t.dtype, tuple(t.shape)) for name, t in pairs]
        else:
            declared = declared_from_info(update_info)
            pairs = open_update(update_info, declared, self.device)
        synchronize(self.device)  # the trainer's writes to what was just opened are complete
        self.opened = held = pairs

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            return iter(list(held))

        def verify() -> None:
            synchronize(self.device)  # the engine's reads are done: the trainer may rewrite its memory
            held.clear()

        return WeightSource(declared, tensors, in_memory=True, verify=verify, description="cuda_ipc update")

    def shutdown(self) -> None:
        """Lets go of the tensors of an update that did not finish (after its reads completed)."""
        if self.opened:
            synchronize(self.device)
            self.opened.clear()
