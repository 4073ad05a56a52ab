"""The one way request data is unpickled: shared-tensor handles, read without running anything they name.

A trainer hands over tensors that stay in its own memory as pickles of torch's reductions
(`torch.multiprocessing.reductions.reduce_tensor` through a `ForkingPickler`: SGLang's `MultiprocessingSerializer`,
vLLM's `ipc_handles_pickled`, hotswap's `CudaIpcSender`). `pickle.loads` would call whatever global such bytes name.
`loads` resolves a global only from the allowlist (`ALLOWED`), and each to an inert stand-in: torch's rebuild
functions become builders that validate their arguments and return a `CudaHandle` / `CpuHandle` (nothing is opened,
mapped or allocated while loading; `hotswap.transfer.cuda_ipc` opens a handle later), torch's tensor and storage
classes become markers, `torch.Size` a checked tuple, dtypes themselves, and SGLang's two dataclasses plain records.
Anything else raises `RefusedGlobal` (a ValueError) naming the global and the allowlist; a malformed pickle or
handle raises ValueError.

CPU handles name torch's `file_system` shared-memory segments. The `file_descriptor` strategy's handles
(`rebuild_storage_fd`) are refused: opening one connects to a socket the pickle names.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

_REDUCTIONS = "torch.multiprocessing.reductions"
MAX_PAYLOAD_BYTES = 64 << 20  # a pickle of handles is small: ~0.5 KB per tensor
_MAX_DIMS = 64
_MAX_INT = 1 << 62
_SEGMENT_NAME = re.compile(rb"^/torch_\d+_\d+_\d+$")  # the names torch gives its file_system segments
_MANAGER_SOCKET = re.compile(rb"^/[^\x00]*/torch-shm-dir-[A-Za-z0-9_]+/manager\.sock$")


class RefusedGlobal(pickle.UnpicklingError, ValueError):
    """A pickle named a global outside the allowlist (nothing it names was imported or called)."""


class BadHandle(ValueError):
    """A pickle called an allowlisted rebuild function with arguments no real handle has."""


class _Marker:
    """What a pickle gets for a class it may only name, never call (a tensor or storage class)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


TENSOR_CLASS = _Marker("torch.Tensor")
STORAGE_CLASS = _Marker("torch.storage")


@dataclass(frozen=True, slots=True)
class SharedFile:
    """A CPU storage in one of torch's `file_system` segments: `manager` (the exporter's torch_shm_manager socket),
    `name` (the segment, "/torch_<pid>_<n>_<n>") and its size in bytes."""

    manager: bytes
    name: bytes
    nbytes: int


@dataclass(frozen=True, slots=True)
class CpuHandle:
    """A CPU tensor over a shared segment (`storage` None: an empty storage), in elements of `dtype`."""

    storage: SharedFile | None
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True, slots=True)
class CudaHandle:
    """`rebuild_cuda_tensor`'s arguments, checked. `device`: the exporter's device index, or its GPU UUID (SGLang's
    patched reductions)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: int | str
    handle: bytes | None
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes | None
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


TensorHandle = CpuHandle | CudaHandle


@dataclass(frozen=True, slots=True)
class _TypedFile:
    storage: SharedFile | None
    dtype: torch.dtype


class SglangRecord:
    """Stand-in for one of SGLang's dataclasses: a pickle can only set its attributes (read them with `field`)."""

    def field(self, name: str) -> Any:
        if name not in self.__dict__:
            raise ValueError(f"SGLang's {type(self).__name__} lacks its field {name!r}")
        return self.__dict__[name]


class FlattenedTensorMetadata(SglangRecord):
    """SGLang's per-tensor entry of a flattened bucket: name, shape, dtype, start_idx, end_idx, numel."""


class LocalSerializedTensor(SglangRecord):
    """SGLang's tensor serialized once per tensor-parallel rank: `values[rank]`, itself a pickle of a handle."""


# ---- argument checks ---------------------------------------------------------------------------------------


def _int(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value < _MAX_INT:
        raise BadHandle(f"shared tensor handle: {what} must be a non-negative integer, got {type(value).__name__}")
    return value


def _bool(value: object, what: str) -> bool:
    if type(value) is not bool:
        raise BadHandle(f"shared tensor handle: {what} must be a bool, got {type(value).__name__}")
    return value


def _dims(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > _MAX_DIMS:
        raise BadHandle(f"shared tensor handle: {what} must be a tuple of at most {_MAX_DIMS} integers")
    return tuple(_int(v, what) for v in value)


def _bytes(value: object, what: str, optional: bool = False) -> bytes | None:
    if value is None and optional:
        return None
    if not isinstance(value, bytes) or len(value) > 4096:
        raise BadHandle(f"shared tensor handle: {what} must be bytes, got {type(value).__name__}")
    return value


def _dtype(value: object) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise BadHandle(f"shared tensor handle: dtype must be a torch dtype, got {type(value).__name__}")
    return value


def _class(value: object, marker: _Marker) -> None:
    if value is not marker:
        raise BadHandle(f"shared tensor handle: expected the class {marker.name}, got {value!r}"[:200])


def extent(size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """Elements of storage a tensor of `size` / `stride` at `offset` reaches (0 for an empty tensor)."""
    if len(size) != len(stride):
        raise BadHandle(f"shared tensor handle: size {size} and stride {stride} differ in length")
    if math.prod(size) == 0:
        return 0
    return offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))


def _fits(size: tuple[int, ...], stride: tuple[int, ...], offset: int, dtype: torch.dtype, nbytes: int) -> None:
    need = extent(size, stride, offset) * dtype.itemsize
    if need > nbytes:
        raise BadHandle(
            f"shared tensor handle: a {tuple(size)} tensor at offset {offset} reaches {need} bytes, past "
            f"its storage's {nbytes}"
        )


# ---- the builders the allowlisted rebuild functions resolve to ---------------------------------------------


def _size(dims: object) -> tuple[int, ...]:
    return _dims(dims, "a torch.Size")


def _rebuild_storage_filename(
    cls: object, manager: object, name: object, size: object, dtype: object = None
) -> SharedFile | _TypedFile:
    _class(cls, STORAGE_CLASS)
    manager, name = _bytes(manager, "the manager socket"), _bytes(name, "the segment name")
    assert manager is not None and name is not None
    if not _MANAGER_SOCKET.match(manager):
        raise BadHandle(f"shared tensor handle: {manager[:120]!r} is not a torch_shm_manager socket")
    if not _SEGMENT_NAME.match(name):
        raise BadHandle(f"shared tensor handle: {name[:120]!r} is not a torch shared-memory segment")
    count = _int(size, "the storage size")
    if dtype is None:
        return SharedFile(manager, name, count)
    dtype = _dtype(dtype)
    return _TypedFile(SharedFile(manager, name, count * dtype.itemsize), dtype)


def _rebuild_storage_empty(cls: object) -> None:
    _class(cls, STORAGE_CLASS)
    return None


def _rebuild_typed_storage(storage: object, dtype: object) -> _TypedFile:
    if storage is not None and not isinstance(storage, SharedFile):
        raise BadHandle(f"shared tensor handle: a typed storage over {type(storage).__name__}, not a shared segment")
    return _TypedFile(storage, _dtype(dtype))


def _rebuild_tensor(cls: object, storage: object, metadata: object) -> CpuHandle:
    _class(cls, TENSOR_CLASS)
    if not isinstance(storage, _TypedFile):
        raise BadHandle(f"shared tensor handle: a CPU tensor over {type(storage).__name__}, not a shared storage")
    if not isinstance(metadata, tuple) or len(metadata) != 4:
        raise BadHandle("shared tensor handle: a CPU tensor's metadata must be (offset, size, stride, requires_grad)")
    offset, size, stride = _int(metadata[0], "the offset"), _dims(metadata[1], "size"), _dims(metadata[2], "stride")
    _bool(metadata[3], "requires_grad")
    _fits(size, stride, offset, storage.dtype, 0 if storage.storage is None else storage.storage.nbytes)
    return CpuHandle(storage.storage, storage.dtype, size, stride, offset)


def _cuda_handle(args: tuple[object, ...], device: int | str) -> CudaHandle:
    if len(args) != 15:
        raise BadHandle(f"shared tensor handle: rebuild_cuda_tensor takes 15 arguments, got {len(args)}")
    _class(args[0], TENSOR_CLASS)
    _class(args[4], STORAGE_CLASS)
    handle = CudaHandle(
        size=_dims(args[1], "size"),
        stride=_dims(args[2], "stride"),
        offset=_int(args[3], "the offset"),
        dtype=_dtype(args[5]),
        device=device,
        handle=_bytes(args[7], "the memory handle", optional=True),
        storage_bytes=_int(args[8], "the storage size"),
        storage_offset_bytes=_int(args[9], "the storage offset"),
        ref_counter_handle=_bytes(args[11], "the ref counter handle", optional=True),
        ref_counter_offset=_int(args[12], "the ref counter offset"),
        event_handle=_bytes(args[13], "the event handle", optional=True),
        event_sync_required=_bool(args[14], "event_sync_required"),
    )
    _bool(args[10], "requires_grad")
    _fits(handle.size, handle.stride, handle.offset, handle.dtype, handle.storage_bytes)
    if handle.handle is None and handle.storage_bytes:
        raise BadHandle("shared tensor handle: a CUDA storage of nonzero size without a memory handle")
    return handle


def _rebuild_cuda_tensor(*args: object) -> CudaHandle:
    return _cuda_handle(args, _int(args[6], "the device index") if len(args) > 6 else -1)


def _rebuild_cuda_tensor_by_uuid(*args: object) -> CudaHandle:
    """SGLang's patched reductions put the GPU's UUID (or still an index) where torch puts the device index."""
    device = args[6] if len(args) > 6 else None
    if not isinstance(device, str | int) or isinstance(device, bool) or (isinstance(device, str) and len(device) > 64):
        raise BadHandle("shared tensor handle: the device must be a GPU UUID or an index")
    return _cuda_handle(args, device if isinstance(device, str) else _int(device, "the device index"))


_REFUSED_HINTS = {
    (_REDUCTIONS, "rebuild_storage_fd"): "CPU tensors shared with the file_descriptor strategy are refused (opening "
    "one connects to a socket the pickle names); share them with the file_system strategy "
    "(torch.multiprocessing.set_sharing_strategy('file_system')) or send them through CudaIpcSender",
    ("multiprocessing.resource_sharer", "DupFd"): "file descriptors passed through the sender's resource sharer are "
    "refused; share CPU tensors with the file_system strategy",
    ("torch.storage", "_load_from_bytes"): "this is a tensor pickled by value (plain pickle / torch.save), not a "
    "shared handle; export it with torch's reductions through a ForkingPickler (CudaIpcSender does)",
    ("torch._utils", "_rebuild_tensor_v2"): "this is a tensor pickled by value, not a shared handle; export it with "
    "torch's reductions through a ForkingPickler (CudaIpcSender does)",
}

ALLOWED: dict[tuple[str, str], object] = {
    (_REDUCTIONS, "rebuild_tensor"): _rebuild_tensor,
    (_REDUCTIONS, "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    (_REDUCTIONS, "rebuild_typed_storage"): _rebuild_typed_storage,
    (_REDUCTIONS, "rebuild_storage_filename"): _rebuild_storage_filename,
    (_REDUCTIONS, "rebuild_storage_empty"): _rebuild_storage_empty,
    ("torch", "Tensor"): TENSOR_CLASS,
    ("torch._tensor", "Tensor"): TENSOR_CLASS,
    ("torch.nn.parameter", "Parameter"): TENSOR_CLASS,
    ("torch", "UntypedStorage"): STORAGE_CLASS,
    ("torch", "TypedStorage"): STORAGE_CLASS,
    ("torch.storage", "UntypedStorage"): STORAGE_CLASS,
    ("torch.storage", "TypedStorage"): STORAGE_CLASS,
    ("torch", "Size"): _size,
}
"""(module, name) -> what the global resolves to. Besides these: torch's dtypes ("torch", "float32", ...), and
from any `sglang.*` module `_rebuild_cuda_tensor_modified` (its patched reductions), `FlattenedTensorMetadata` and
`LocalSerializedTensor`."""

_SGLANG: dict[str, object] = {
    "_rebuild_cuda_tensor_modified": _rebuild_cuda_tensor_by_uuid,
    "FlattenedTensorMetadata": FlattenedTensorMetadata,
    "LocalSerializedTensor": LocalSerializedTensor,
}

_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}  # no lazy imports

_BUILDERS: tuple[Callable[..., TensorHandle], ...] = (
    _rebuild_tensor,
    _rebuild_cuda_tensor,
    _rebuild_cuda_tensor_by_uuid,
)


def as_handle(value: object, what: str = "a handle") -> TensorHandle:
    """`value` as a tensor handle: one already built while loading, torch's (rebuild function, arguments) pair as
    `reduce_tensor` returns it (the function an allowlisted one), or `rebuild_cuda_tensor`'s 15 arguments alone
    (vLLM's form). Raises ValueError for anything else."""
    if isinstance(value, CpuHandle | CudaHandle):
        return value
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], tuple):
        builder = next((b for b in _BUILDERS if value[0] is b), None)
        if builder is not None:
            built = builder(*value[1])
            assert isinstance(built, CpuHandle | CudaHandle)
            return built
    if isinstance(value, tuple) and len(value) == 15:
        return _rebuild_cuda_tensor(*value)
    raise ValueError(
        f"{what} is not a shared tensor handle (got {type(value).__name__}); expected a tensor exported "
        "with torch.multiprocessing.reductions.reduce_tensor"
    )


def allowlist() -> str:
    """The allowlist in words, for error messages."""
    names = sorted(f"{m}.{n}" for m, n in ALLOWED)
    return ", ".join([*names, "torch.<dtype>", *(f"sglang.*.{n}" for n in sorted(_SGLANG))])


def resolve(module: str, name: str) -> object:
    """What the global `module.name` resolves to in a request pickle. Raises RefusedGlobal outside the allowlist."""
    found = ALLOWED.get((module, name))
    if found is not None:
        return found
    if module == "torch" and name in _DTYPES:
        return _DTYPES[name]
    if (module == "sglang" or module.startswith("sglang.")) and name in _SGLANG:
        return _SGLANG[name]
    hint = _REFUSED_HINTS.get((module, name))
    raise RefusedGlobal(
        f"refused to unpickle the global {module}.{name}"[:200]
        + (f": {hint}" if hint else "")
        + ". Request pickles may only name what rebuilding a shared tensor needs (the allowlist: "
        + f"{allowlist()})"
    )


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        return resolve(module, name)

    def persistent_load(self, pid: object) -> NoReturn:
        raise ValueError("request pickles may not carry persistent ids")


def decode_base64(payload: object, what: str = "payload") -> bytes:
    """The bytes of a base64 string (bytes pass through). Raises ValueError for anything else."""
    if isinstance(payload, bytes):
        return payload
    if not isinstance(payload, str):
        raise ValueError(f"{what} must be a base64 string, got {type(payload).__name__}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{what} is not valid base64 ({err})") from None


def loads(payload: object, what: str = "payload") -> Any:
    """The object a request pickle (bytes, or their base64) describes, with handles as `CudaHandle` / `CpuHandle`.
    Raises RefusedGlobal for a global outside the allowlist, ValueError for anything malformed; nothing is opened."""
    raw = decode_base64(payload, what)
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"{what} holds {len(raw)} bytes; a pickle of handles is at most {MAX_PAYLOAD_BYTES}")
    try:
        return _Unpickler(io.BytesIO(raw)).load()
    except (RefusedGlobal, BadHandle):
        raise
    except Exception as err:  # whatever malformed bytes make the unpickler raise
        raise ValueError(
            f"{what} is not a readable pickle of shared tensors ({type(err).__name__}: {str(err)[:200]})"
        ) from None
