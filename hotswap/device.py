"""The device an engine runs its model on: a build-time setting (`LLM(..., device="cuda")`) that flows through the
constructors of the worker, the model runner and the KV cache; never an ambient variable.

"cpu" (the default) is the reference path with the native kernels. "cuda" / "cuda:N" runs the same engine with
torch ops and the Triton paged-attention kernels (hotswap/kernels/triton_attention.py); what has no CUDA path yet
is refused at construction with the reason (`check_engine_on_device`)."""

from __future__ import annotations

import os
import re

import torch

ATTENTION_BACKENDS = ("auto", "native", "triton", "torch")

_NAME = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_device(name: str) -> str:
    """`name` normalised ("cpu", "cuda:N"; a bare "cuda" is the current CUDA device). Raises ValueError for a
    malformed name, and for CUDA where this torch build has no CUDA or no GPU is visible, saying which."""
    m = _NAME.match(str(name).strip()) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        if index is not None:
            raise ValueError(f"device {name!r}: the CPU takes no index; use 'cpu'")
        return "cpu"
    if not torch.backends.cuda.is_built():
        raise ValueError(
            f"device={name!r}, but this torch build ({torch.__version__}) has no CUDA support: install "
            "a CUDA build of torch, or use device='cpu'"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={name!r}, but no CUDA GPU is visible to this process (torch.cuda.is_available() is "
            "False; check CUDA_VISIBLE_DEVICES and the driver), or use device='cpu'"
        )
    count = torch.cuda.device_count()
    number = torch.cuda.current_device() if index is None else int(index)
    if number >= count:
        raise ValueError(f"device={name!r}, but only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})")
    return f"cuda:{number}"


def check_engine_on_device(device: str, deterministic: bool = False, tensor_parallel_size: int = 1) -> None:
    """Raises ValueError, naming the setting, for what has no path on `device` yet: on CUDA, deterministic mode
    (batch-invariant GPU kernels are a later step: the CPU stays its reference) and tensor parallelism above 1
    (untested on more than one GPU). LoRA adapters and speculative decoding run on any device: their tensors live
    on the model's device (adapters loaded from a folder are read on the host and moved once), and speculative
    sampling runs on the logits' device with only ids and asked logprobs read back."""
    if device == "cpu":
        return
    if deterministic:
        raise ValueError(
            f"deterministic=True runs on the CPU only for now (device={device!r}): its batch-invariant "
            "kernels, equal to the trainer's forward bit for bit, are CPU kernels; use device='cpu'"
        )
    if tensor_parallel_size > 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} is not supported on "
            f"{device!r} yet (one GPU per engine; NCCL groups are untested); use 1"
        )


def cuda_kv_budget(total: int, utilization: float, used_by_engine: int) -> int:
    """The bytes the KV cache may take on a GPU (vLLM's rule): `utilization` of the device's `total` memory, less
    what the engine already uses (weights, plus the peak of a profiling forward at the largest batch). Raises
    ValueError, with the figures, when nothing is left."""
    budget = int(total * utilization) - used_by_engine
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} of "
            f"{total / 2**30:.1f} GiB is {total * utilization / 2**30:.1f} GiB, and the model with a "
            f"profiling forward already takes {used_by_engine / 2**30:.1f} GiB; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget


def check_attention_backend(backend: str, device: str, deterministic: bool) -> None:
    """Raises ValueError, with the reason, for an attention backend the device or mode cannot run: "native" is the
    CPU's; deterministic mode runs "auto"/"native" only (its one attention path); "triton" on the CPU runs only
    under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests run the GPU kernels."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {backend!r}")
    if backend == "native" and device != "cpu":
        raise ValueError(f"attention_backend='native' runs on the CPU only, not {device!r}; use 'auto' or 'triton'")
    if deterministic and backend not in ("auto", "native"):
        raise ValueError(
            f"deterministic=True attends in its native kernel only; attention_backend={backend!r} "
            "cannot be combined with it"
        )
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend='triton' on the CPU runs only under Triton's interpreter "
            "(TRITON_INTERPRET=1, for tests); on the CPU use 'auto'"
        )


def upload(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (built on the host) on `device`: to a GPU through page-locked memory (torch's caching host
    allocator), so the copy is asynchronous on the current stream and the host goes on building the next step;
    elsewhere as it is (`.to`, a no-op on the CPU)."""
    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
