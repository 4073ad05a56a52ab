"""A fleet on a local Ray: aggregate throughput at N=1 and N=2 replicas, and the time of a fleet-wide weight
update against a single replica's (N=1) for the same bytes.

Throughput: fp32 greedy, fixed output length, the same prompts for fleets of 1 and 2 replicas (each replica an
actor with one worker, one CPU), the better of two runs. Updates: a full session (start -> update -> finish) of
checkpoint B then A, alternating, through shm (written once, read by every replica) and torch_dist (one group
spanning the trainer and every replica: each bucket broadcast once), median of `--reps`. On a machine with
fewer cores than replicas, the replicas share cores: the figures are as measured.

    python -m benchmarks.fleet [--preset 9m] [--prompts 64] [--max-tokens 64] [--reps 5] [--replicas 1,2]

Prints human-readable lines and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from safetensors.torch import load_file

from benchmarks.throughput import kernel_build, make_prompts
from benchmarks.weight_update import free_port
from hotswap import SamplingParams
from hotswap.testing import make_tiny_model
from hotswap.transfer.shm import ShmSender
from hotswap.transfer.torch_dist import TorchDistSender


def tokens_per_second(engine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    engine.generate(batch[:4], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = engine.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def session_seconds(engine, backend: str, checkpoints: list[list], reps: int, workers: int) -> float:
    """Median time of one full update session, alternating checkpoints, the sender in this process."""
    times = []
    if backend == "shm":
        shm = ShmSender()
        engine.init_weight_transfer_engine({"backend": "shm"})
        for i in range(reps):
            named = checkpoints[i % 2]
            start = time.perf_counter()
            engine.start_weight_update()
            engine.update_weights(shm.write(named))
            engine.finish_weight_update()
            times.append(time.perf_counter() - start)
        shm.close()
    else:
        port, box = free_port(), {}
        joiner = threading.Thread(
            target=lambda: box.setdefault("s", TorchDistSender("127.0.0.1", port, num_workers=workers))
        )
        joiner.start()
        engine.init_weight_transfer_engine(
            {"backend": "torch_dist", "master_address": "127.0.0.1", "master_port": port}
        )
        joiner.join()
        sender = box["s"]
        for i in range(reps):
            named = checkpoints[i % 2]
            start = time.perf_counter()
            engine.start_weight_update()
            info = sender.update_info(named)
            send = threading.Thread(target=sender.send, args=(named,))
            send.start()
            engine.update_weights(info)
            send.join()
            engine.finish_weight_update()
            times.append(time.perf_counter() - start)
        sender.close()
    engine.shutdown_weight_transfer_engine()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="9m")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--replicas", default="1,2")
    args = parser.parse_args()
    import ray

    from hotswap.fleet import Fleet

    build = kernel_build()
    print(f"CPU: {build['cpu']}; kernels: {build['build']}")
    figures: dict = {"cpu": build["cpu"], "build": build["build"], "preset": args.preset}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [
            str(make_tiny_model(Path(tmp) / k, arch="llama", preset=args.preset, seed=s))
            for k, s in (("A", 0), ("B", 1))
        ]
        checkpoints = [list(load_file(f"{p}/model.safetensors").items()) for p in reversed(paths)]  # B, then A
        megabytes = sum(t.numel() * t.element_size() for _, t in checkpoints[0]) / 1e6
        figures["update_megabytes"] = round(megabytes, 1)
        ray.init(include_dashboard=False)
        base: dict = {}
        for n in (int(x) for x in args.replicas.split(",")):
            start = time.perf_counter()
            fleet = Fleet(paths[0], num_replicas=n)
            ready = time.perf_counter() - start
            prompts = make_prompts(fleet.get_tokenizer(), args.prompts)
            tps = max(tokens_per_second(fleet, prompts, args.max_tokens) for _ in range(2))
            ups = {
                b: session_seconds(fleet, b, checkpoints, args.reps, fleet.get_world_size())
                for b in ("shm", "torch_dist")
            }
            fleet.shutdown()
            base = base or {"tokens_per_s": tps, **ups}
            print(
                f"fleet N={n}: ready in {ready:.1f} s; {tps:.0f} tok/s ({tps / base['tokens_per_s']:.2f}x N=1); "
                f"update of {megabytes:.0f} MB: shm {ups['shm'] * 1e3:.1f} ms ({ups['shm'] / base['shm']:.2f}x N=1), "
                f"torch_dist {ups['torch_dist'] * 1e3:.1f} ms "
                f"({ups['torch_dist'] / base['torch_dist']:.2f}x)"
            )
            figures[f"fleet_{n}"] = {
                "ready_s": round(ready, 2),
                "tokens_per_s": round(tps, 1),
                "tokens_vs_1": round(tps / base["tokens_per_s"], 3),
                **{f"update_{b}_ms": round(s * 1e3, 2) for b, s in ups.items()},
                **{f"update_{b}_vs_1": round(s / base[b], 3) for b, s in ups.items()},
            }
        ray.shutdown()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
