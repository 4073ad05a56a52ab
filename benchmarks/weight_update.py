"""Weight-update latency on the 125M model (fp32, ~540 MB), per path, against the memory-copy floor.

Serves checkpoint A, then repeatedly pushes checkpoint B: an in-process `reload_weights(weights_iterator=...)`
(one shot: every value checked before the first write, so no rollback copy is needed), full sessions (start ->
update -> finish) through each transport, with the trainer in its own process for shm and torch_dist, and disk
reloads. The floor is torch `copy_` of the same number of bytes, measured in the same run. Every path is atomic
unless its label says otherwise.

    python -m benchmarks.weight_update [--reps 5] [--preset 125m] [--isa native|avx2-kernels|avx2]

Prints human-readable lines and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from hotswap import LLM
from hotswap.testing import free_port, make_tiny_model
from hotswap.transfer.tensors import tensors_update_info


def trainer(backend: str, checkpoint: str, port: int, commands, replies) -> None:
    """A trainer process: on each command, writes (shm) or broadcasts (torch_dist) checkpoint B."""
    named = list(load_file(checkpoint).items())
    if backend == "shm":
        from hotswap.transfer.shm import ShmSender

        sender = ShmSender()
        while commands.get() == "push":
            replies.put(sender.write(named))
        sender.close()
    else:
        from hotswap.transfer.torch_dist import TorchDistSender

        sender = TorchDistSender("127.0.0.1", port)
        while commands.get() == "push":
            replies.put(sender.update_info(named))
            sender.send(named)
        sender.close()


def cpu_description() -> str:
    """The CPU model and its widest x86 vector ISA, from /proc/cpuinfo (Linux), for the report."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model} ({isa})"


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memcpy_seconds(nbytes: int, reps: int) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    return median_seconds(lambda: dst.copy_(src), reps)


def changed(base: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """`base` with `fraction` of every tensor's elements moved slightly (an RL step's footprint)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in base.items():
        new = t.clone()
        picked = torch.randperm(t.numel(), generator=gen)[: max(1, int(fraction * t.numel()))]
        new.view(-1)[picked] += 1e-3
        out[name] = new
    return out


def deltas(llm: LLM, start: dict[str, torch.Tensor], full_s: float, floor_s: float, reps: int) -> dict[str, object]:
    """In-process reloads of deltas with 1 %, 3 % and 10 % of the elements changed, sparse and xor, back and forth
    between two states (each delta applies on top of the other's result); each against the full reload."""
    from hotswap.transfer.delta import sparse_delta, xor_delta
    from hotswap.weights.delta import INDICES, VALUES

    out: dict[str, object] = {}
    for fraction in (0.01, 0.02, 0.03, 0.10):
        other = changed(start, fraction, seed=int(fraction * 1000))
        for encoding in ("sparse", "xor"):

            def encode(
                old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], encoding: str = encoding
            ) -> list[tuple[str, torch.Tensor]]:
                if encoding == "xor":
                    return [(n, xor_delta(old[n], new[n])) for n in new]
                return [
                    pair
                    for n in new
                    for pair in zip((n + INDICES, n + VALUES), sparse_delta(old[n], new[n]), strict=True)
                ]

            there, back = encode(start, other), encode(other, start)
            sent = sum(t.numel() * t.element_size() for _, t in there)
            times = []
            for rep in range(2 * reps):
                payload = there if rep % 2 == 0 else back
                t0 = time.perf_counter()
                llm.reload_weights(weights_iterator=payload, encoding=encoding)
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times)
            label = f"{encoding} delta, {fraction:.0%} changed"
            print(
                f"  {label:<28} {seconds * 1e3:8.1f} ms   {seconds / full_s:5.1%} of the full reload, "
                f"{seconds / floor_s:4.2f}x the floor; {sent / 1e6:.0f} MB sent"
            )
            out[label] = {
                "ms": round(seconds * 1e3, 1),
                "of_full": round(seconds / full_s, 3),
                "mb_sent": round(sent / 1e6, 1),
            }
        if fraction == 0.02:
            out.update(scatter_floor(start, other, full_s, reps))
    return out


def scatter_floor(
    start: dict[str, torch.Tensor], other: dict[str, torch.Tensor], full_s: float, reps: int
) -> dict[str, object]:
    """What writing a delta's elements costs by itself, outside the engine: the changed elements of `other` written
    into a scratch copy of `start` (as large as the weights, so it comes from memory as they do) by torch's
    `index_copy_` and by hotswap's native scatter; nothing else (no decoding, no checks)."""
    from hotswap.kernels import native

    scratch = {n: t.clone() for n, t in start.items()}
    writes = []
    for name, new in other.items():
        flat = new.reshape(-1)
        indices = (flat != start[name].reshape(-1)).nonzero().squeeze(1)
        writes.append((scratch[name].view(-1), indices, flat[indices]))
    paths = {"index_copy_": lambda: [d.index_copy_(0, i, v) for d, i, v in writes]}
    kernels = native.ops()
    if kernels is not None:
        paths["native scatter"] = lambda: [kernels.scatter_(d, i, v) for d, i, v in writes]
    out: dict[str, object] = {}
    for label, fn in paths.items():
        seconds = median_seconds(fn, 2 * reps)
        print(f"  2% elements alone, {label:<14} {seconds * 1e3:6.1f} ms   {seconds / full_s:5.1%} of the full reload")
        out[f"2% elements alone, {label}"] = {"ms": round(seconds * 1e3, 1), "of_full": round(seconds / full_s, 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--canary-tokens", type=int, default=16, help="tokens of the canary's one probe")
    parser.add_argument("--isa", default="native", help="native, avx2-kernels or avx2 (see benchmarks/throughput.py)")
    args = parser.parse_args()
    from benchmarks.throughput import kernel_build
    from hotswap.kernels import emulation, policy

    emulation.reexec_under(args.isa)
    build = kernel_build()
    with tempfile.TemporaryDirectory() as tmp:
        a = make_tiny_model(Path(tmp) / "A", preset=args.preset, seed=0)
        b = make_tiny_model(Path(tmp) / "B", preset=args.preset, seed=1)
        b_file = str(b / "model.safetensors")
        llm = LLM(str(a), kv_cache_memory_bytes=1 << 28)
        named = list(load_file(b_file).items())
        total = sum(t.numel() * t.element_size() for _, t in named)
        floor = memcpy_seconds(total, args.reps)
        writes = {
            "stream_copy": policy.stream_copy_faster(),
            "native_scatter": policy.scatter_faster(),
            "one_pass_check": policy.finite_check_faster(),
        }
        print(f"cpu: {cpu_description()}; kernels: {build['build']}; torch: {build['torch_isa']}")
        print(f"weight writes taken here (measured gates): {writes}")
        print(f"model: {args.preset}, {total / 1e6:.0f} MB of weights; memory-copy floor {floor * 1e3:.1f} ms")
        figures: dict = {
            "cpu": cpu_description(),
            "isa": args.isa,
            "build": build["build"],
            "writes": writes,
            "weights_mb": round(total / 1e6, 1),
            "memcpy_floor_ms": round(floor * 1e3, 1),
        }

        def report(label: str, seconds: float) -> None:
            print(f"  {label:<28} {seconds * 1e3:8.1f} ms   {seconds / floor:5.1f}x the floor")
            figures[label] = {"ms": round(seconds * 1e3, 1), "x_floor": round(seconds / floor, 2)}

        def session(info_fn) -> None:
            llm.start_weight_update()
            llm.update_weights(info_fn())
            llm.finish_weight_update()

        def tensors_session() -> None:
            session(lambda: tensors_update_info(named))

        def reload_iterator() -> None:
            llm.reload_weights(weights_iterator=named)

        report("reload_weights(iterator)", median_seconds(reload_iterator, args.reps))
        full = figures["reload_weights(iterator)"]["ms"] / 1e3
        figures["deltas"] = deltas(llm, dict(named), full, floor, args.reps)
        llm.init_weight_transfer_engine({"backend": "tensors"})
        report("tensors session", median_seconds(tensors_session, args.reps))
        probe = {"token_ids": [list(range(5, 5 + args.canary_tokens))], "max_nll": 1e9}

        def canary_session() -> None:
            llm.start_weight_update()
            llm.update_weights(tensors_update_info(named))
            llm.finish_weight_update(canary=probe)

        with_canary = median_seconds(canary_session, args.reps)
        plain = figures["tensors session"]["ms"] / 1e3
        report(f"tensors session + canary ({args.canary_tokens} tokens)", with_canary)
        cost = with_canary - plain
        print(f"    canary cost: {cost * 1e3:.1f} ms, {cost / plain:.1%} of the update")
        figures["canary_ms"] = round((with_canary - plain) * 1e3, 1)
        figures["canary_share"] = round((with_canary - plain) / plain, 4)
        llm.update_config({"weight_transfer_config": {"atomic": False}})
        report("tensors session (atomic off)", median_seconds(tensors_session, args.reps))
        llm.update_config({"weight_transfer_config": {"atomic": True}})

        llm.init_weight_transfer_engine({"backend": "disk"})
        report("disk transport", median_seconds(lambda: session(lambda: {"path": str(b)}), args.reps))
        llm.shutdown_weight_transfer_engine()
        report("reload_weights(path)", median_seconds(lambda: llm.reload_weights(weights_path=str(b)), args.reps))

        ctx = mp.get_context("spawn")
        for backend in ("shm", "torch_dist"):
            commands, replies = ctx.Queue(), ctx.Queue()
            port = free_port()
            proc = ctx.Process(target=trainer, args=(backend, b_file, port, commands, replies))
            proc.start()
            init = {"backend": backend}
            if backend == "torch_dist":
                init.update(master_address="127.0.0.1", master_port=port)
            llm.init_weight_transfer_engine(init)

            def push(commands=commands, replies=replies) -> None:
                commands.put("push")
                session(lambda: replies.get(timeout=120))

            push()  # warm-up: buffers allocated
            report(f"{backend} (trainer process)", median_seconds(push, args.reps))
            commands.put("stop")
            proc.join()
            llm.shutdown_weight_transfer_engine()
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
