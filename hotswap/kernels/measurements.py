"""Measured decisions, cached per machine: the timing helpers the kernel policy and the packed-weight gates share,
and the calibration file their ratios (native or candidate time / torch time) are kept in, keyed by shapes, thread
count and torch's ISA caps."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hotswap.kernels import native

WIN_RATIO = 0.95  # a candidate must be at least 5 % faster: noise must not flip a decision between runs


def threads_and_isa() -> str:
    """ "@<threads>t@<torch's ISA and its caps>": what a torch path's time depends on besides the shapes."""
    caps = [os.environ.get(name, "") for name in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")]
    torch_isa = "/".join([torch.backends.cpu.get_cpu_capability(), *caps]).rstrip("/")
    return f"@{torch.get_num_threads()}t@{torch_isa}"


def cached(key: str, op: str, batches: tuple[int, ...]) -> dict[int, float] | None:
    """The cached ratios of `op` for shapes `key` at `batches`, or None."""
    try:
        entry = json.loads(cache_file().read_text())[key][op]
        return {b: float(entry[str(b)]) for b in batches}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measured(op: str, key: str, batches: tuple[int, ...], measure: Callable[[], dict[int, float]]) -> bool:
    """Whether a candidate path won against its baseline (time ratio below WIN_RATIO at every one of `batches`)
    for `key` (e.g. a weight's shape): the ratios cached with the calibration under `op`, else `measure()`d once and
    stored there (per machine, ISA cap and thread count)."""
    key = key + threads_and_isa()
    ratios = cached(key, op, batches)
    if ratios is None:
        ratios = measure()
        store(key, op, ratios)
    return all(ratio < WIN_RATIO for ratio in ratios.values())


def store(key: str, op: str, ratios: dict[int, float]) -> None:
    path = cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    cached.setdefault(key, {})[op] = {str(b): r for b, r in ratios.items()}
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: calibrate again next time


def cache_file() -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(native.build_name(), verbose=False)) / "calibration.json"


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """The median time of `reps` calls of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fastest_in_turn(fns: Sequence[Callable[[], object]], reps: int) -> list[float]:
    """The fastest of `reps` calls of each of `fns`, called in turn (after one warm-up call each), so all see the
    same minutes of a shared machine. The fastest, not the median: load from other processes only adds time, and
    on a busy machine most calls of a two-thread op can wait a scheduler tick for the second thread, which a
    median would take for the op's cost."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def paired_seconds(first: Callable[[], object], second: Callable[[], object], reps: int) -> tuple[float, float]:
    """`fastest_in_turn` of two calls."""
    a, b = fastest_in_turn((first, second), reps)
    return a, b
