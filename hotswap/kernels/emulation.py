"""Running this process as a host with a narrower vector ISA would, for benchmarks and calibration reports.

An AVX2 build of hotswap's kernels (`HOTSWAP_KERNEL_MARCH=x86-64-v3`) on an AVX-512 machine narrows only
hotswap's own kernels: torch's ATen kernels, MKL and oneDNN (torch's paths, and transformers') still pick their
AVX-512 code at run time, so such a run compares AVX2 hand kernels against AVX-512 libraries, which an AVX2-only
host never sees. Each library reads a cap on its ISA from the environment once, when torch loads it, so the
variables below must be set before torch is imported: `reexec_under` starts the process again with them set.
Processes it spawns inherit them.

- `avx2`: the whole process as on an AVX2-only host: hotswap's AVX2 build, and ATen, MKL and oneDNN capped at
  AVX2 (the caps work on this torch: `torch.backends.cpu.get_cpu_capability()` says AVX2, MKL_VERBOSE and
  ONEDNN_VERBOSE name AVX2 code, and a one-thread sgemm runs at half its AVX-512 rate);
- `avx2-kernels`: hotswap's AVX2 build only, torch's libraries as the CPU allows (the partial stand-in; the
  three caps are removed if set);
- `native`: nothing changed.
"""

from __future__ import annotations

import os
import sys

TORCH_AVX2 = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
ISA_ENV: dict[str, dict[str, str]] = {
    "native": {},
    "avx2-kernels": {"HOTSWAP_KERNEL_MARCH": "x86-64-v3"},
    "avx2": {"HOTSWAP_KERNEL_MARCH": "x86-64-v3", **TORCH_AVX2},
}
ISAS = tuple(ISA_ENV)


def reexec_under(isa: str) -> None:
    """Makes the environment `ISA_ENV[isa]` hold for this process: returns at once if it already does, else
    replaces the process with the same command line under it (torch's libraries read their caps only at load)."""
    if isa not in ISA_ENV:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
    wanted = ISA_ENV[isa]
    unset = [name for name in TORCH_AVX2 if name in os.environ] if isa == "avx2-kernels" else []
    if not unset and all(os.environ.get(name) == value for name, value in wanted.items()):
        return
    env = {name: value for name, value in os.environ.items() if name not in unset}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**env, **wanted})


def torch_isa() -> str:
    """What torch's own kernels run here: ATen's CPU capability, and the MKL and oneDNN caps if set."""
    import torch

    caps = [f"ATen {torch.backends.cpu.get_cpu_capability()}"]
    for label, name in (("MKL", "MKL_ENABLE_INSTRUCTIONS"), ("oneDNN", "ONEDNN_MAX_CPU_ISA")):
        caps.append(f"{label} {os.environ.get(name) or 'unrestricted'}")
    return ", ".join(caps)
