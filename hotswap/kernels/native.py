"""Builds and loads hotswap's C++ kernels (`*.cpp` beside this file) as torch operators under `torch.ops.hotswap`.

The library is compiled once per machine with the system C++ compiler for `-march=$HOTSWAP_KERNEL_MARCH`
(default `native`; e.g. `x86-64-v3` builds for AVX2 hosts on an AVX-512 machine), cached in torch's extension
directory (`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`) under a name that records the vector ISA
of the target and hashes the sources, the flags, torch's version and the CPU's feature flags, so a changed source
or a different CPU gets its own build. `scripts/_venv.sh` builds it at install time (`python -m hotswap.kernels`).

`ops()` returns `torch.ops.hotswap`, or None when the kernels are disabled (`HOTSWAP_NATIVE_KERNELS=0`) or cannot
be built (no compiler). Nothing but the facade (`ops.py`) calls them: it takes each kernel where the policy
(`policy.py`, a calibration against the torch paths on this machine) chose it, and the torch path elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol, TypedDict, cast

import torch

logger = logging.getLogger(__name__)


class NativeOps(Protocol):
    """The operators the C++ sources register under `torch.ops.hotswap`, with their schemas' Python types (each
    `m.def(...)` in the `*.cpp` beside this file). Only the facade (`ops.py`) and the calibration call them."""

    def vector_bits(self) -> int: ...
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...
    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def small_batch_linear(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, split: int = 0
    ) -> torch.Tensor: ...
    def small_batch_gated_linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...
    def sigmoid(self, x: torch.Tensor) -> torch.Tensor: ...
    def greedy_sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def write_kv_cache(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...
    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_lens: torch.Tensor | None,
        kv_of_q: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor: ...
    def rope_paged_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_lens: torch.Tensor | None,
        kv_of_q: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor: ...
    def decoder_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        layers: Sequence[torch.Tensor | None],
        k_caches: Sequence[torch.Tensor | None],
        v_caches: Sequence[torch.Tensor | None],
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_lens: torch.Tensor | None,
        kv_of_q: torch.Tensor | None,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        eps: float,
        final_norm: torch.Tensor,
        native_linear: bool,
        native_gated: bool,
        native_silu: bool,
        o_split: int,
        down_split: int,
        lora: Sequence[torch.Tensor | None],
        lora_rows: Sequence[int],
        onednn: Sequence[bool],
    ) -> torch.Tensor: ...
    def stream_copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def scatter_(self, dst: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None: ...
    def max_magnitude_bits(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor: ...


SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
MARCH = os.environ.get("HOTSWAP_KERNEL_MARCH", "native")
CFLAGS = ["-O3", f"-march={MARCH}", "-fopenmp"]
if platform.machine() in ("x86_64", "AMD64"):
    CFLAGS.append("-mprefer-vector-width=512")  # use AVX-512 registers where the CPU has them
_lock = threading.Lock()


class _State(TypedDict, total=False):
    ops: NativeOps | None  # the one load's result, once tried
    vector_bits: int


_state: _State = {}


def enabled() -> bool:
    """False when `HOTSWAP_NATIVE_KERNELS` is set to 0, false, off, no or torch (any case)."""
    return os.environ.get("HOTSWAP_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "off", "no", "torch")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def target_isa() -> str:
    """The vector ISA the build targets, from the -march value and (for `native`) this CPU's flags: "avx512",
    "avx2" or "generic"."""
    flags = _cpu_flags().split() if MARCH == "native" else []
    if "avx512f" in flags or MARCH in ("x86-64-v4", "skylake-avx512", "icelake-server", "sapphirerapids"):
        return "avx512"
    if ("avx2" in flags and "fma" in flags) or MARCH in ("x86-64-v3", "haswell", "znver2", "znver3"):
        return "avx2"
    return "generic"


def build_name() -> str:
    """The build's folder name in the extension cache: names the target's vector ISA, and changes with the
    sources, flags, torch, Python and CPU (a `native` build may use any instruction of this CPU)."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    for part in (*CFLAGS, torch.__version__, sys.version, platform.machine(), _cpu_flags()):
        digest.update(part.encode())
    return f"hotswap_kernels_{target_isa()}_{digest.hexdigest()[:16]}"


def ops() -> NativeOps | None:
    """`torch.ops.hotswap` with the kernels registered, or None (see the module docstring). Thread-safe; builds
    at most once per process and remembers a failure."""
    if not enabled():
        return None
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load()
        return _state["ops"]


def vector_bits() -> int:
    """The vector width the loaded build was compiled for (512, 256 or 128), 0 without kernels."""
    kernels = ops()
    if kernels is None:
        return 0
    with _lock:
        if "vector_bits" not in _state:
            _state["vector_bits"] = int(kernels.vector_bits())
        return _state["vector_bits"]


def _load() -> NativeOps | None:
    from torch.utils import cpp_extension

    name = build_name()
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    try:
        with _build_lock(build_dir):
            library = build_dir / f"{name}.so"
            if library.is_file():  # the name hashes everything the build depends on: an existing library is it
                try:
                    torch.ops.load_library(str(library))
                    return _registered()
                except OSError:  # e.g. truncated by a killed build: build it again
                    logger.warning("rebuilding unreadable native kernel library %s", library)
            cpp_extension.load(
                name=name,
                sources=[str(p) for p in SOURCES],
                extra_cflags=CFLAGS,
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler, or a failed build: the torch fallback computes the same thing
        detail = str(exc).strip().splitlines()
        logger.warning(
            "hotswap native kernels unavailable (%s; build folder %s); using the pure-torch path",
            " / ".join(detail[-3:])[-500:],
            build_dir,
        )
        logger.debug("native kernel build output:\n%s", exc)
        return None
    return _registered()


def _registered() -> NativeOps:
    """`torch.ops.hotswap` once the library is loaded: an operator namespace torch types by no schema; its
    operators are those `NativeOps` lists."""
    return cast(NativeOps, torch.ops.hotswap)


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Serialises builds across processes with an flock, which the OS releases if its holder dies. Holding it,
    a `lock` file from torch's own file baton can only be a leftover of a killed build, and would make torch
    wait forever: it is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "hotswap.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
