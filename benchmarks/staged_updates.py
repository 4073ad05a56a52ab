"""The pause a weight update puts into running streams, staged (`update_staging="shadow"`) against in place.

Two serving engines (`AsyncLLMEngine`) of the same checkpoint, one per mode, take turns: while `--streams` greedy
requests stream, one update lands. In place: pause("keep"), the update, resume (what a trainer does today).
Staged: the update alone (received in slices between steps, committed between two). Per update:

    pause      the longest gap between two tokens of a stream that overlaps the update, minus the stream's
               median gap before it (the worst stream)
    commit gap the gap that spans the end of the update call (the commit), minus that median; with streams that
               asked to recompute their KV ("shadow, recompute"), it holds the refill
    control    the same measure with no update, over a window as long as the staged update took: the host's
               own jitter, which the pause includes
    wall       how long the update call took (staged: the staging time, spread over the steps)
    tok/s      the streams' tokens per second while the update ran, against before it

Updates: a full reload from a checkpoint folder (alternately B and A), a sparse delta changing 2 % of every
tensor (there and back), and a LoRA adapter's new version (streams running through it; never paused in either
mode). Modes and kinds are interleaved, `--reps` times.

    python -m benchmarks.staged_updates [--shape 125m|0.5b] [--kinds full,delta,lora] [--streams 4] [--reps 3]
        [--slice-ms 3]

Prints a table and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from benchmarks.weight_update import changed, cpu_description, scatter_floor
from hotswap import SamplingParams
from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.lora.request import LoRARequest
from hotswap.testing import make_tiny_lora, make_tiny_model
from hotswap.transfer.delta import sparse_delta
from hotswap.weights.delta import INDICES, VALUES

MODES = ("in_place", "shadow")
# model shapes: hotswap.testing's "125m" preset, and a Qwen2.5-0.5B shape on top of it (fp32, about 2 GB)
SHAPES: dict[str, dict[str, Any]] = {
    "125m": {},
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 4096,
    },
}


def sparse(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [pair for n in new for pair in zip((n + INDICES, n + VALUES), sparse_delta(old[n], new[n]), strict=True)]


async def trial(
    engine: AsyncLLMEngine,
    mode: str,
    update: dict[str, Any],
    streams: int,
    seed: int,
    lora: LoRARequest | None = None,
    policy: str = "keep",
) -> dict[str, float]:
    """Streams `streams` greedy requests (with `lora`, through that adapter), lands `update` (reload_weights
    keywords) once each stream has 12 tokens, and measures the streams around it. In place, the update is wrapped
    in pause("keep") / resume, except an adapter's (never paused)."""
    times: list[list[float]] = [[] for _ in range(streams)]
    gen = torch.Generator().manual_seed(seed)
    # long enough to outlast a staged update of a large model (the streams are cancelled once measured)
    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True, on_weight_update=policy)

    async def stream(i: int) -> None:
        prompt = {"prompt_token_ids": torch.randint(10, 500, (24,), generator=gen).tolist()}
        async for _ in engine.generate(prompt, params, f"t{seed}-{i}", lora_request=lora):
            times[i].append(time.perf_counter())

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    while min(len(t) for t in times) < 12:
        await asyncio.sleep(0.002)
    t0 = time.perf_counter()
    if mode == "control":  # no update: the same measure over a window as long as `update["seconds"]`
        await asyncio.sleep(update["seconds"])
    elif mode == "in_place" and lora is None:
        await engine.pause_generation("keep")
        await engine.reload_weights(**update)
        await engine.resume_generation()
    elif mode != "control":
        await engine.reload_weights(**update)
    t1 = time.perf_counter()
    counts = [len(t) for t in times]
    while any(len(t) < c + 8 and not task.done() for t, c, task in zip(times, counts, tasks, strict=True)):
        await asyncio.sleep(0.002)
    if any(task.done() for task in tasks):
        raise RuntimeError("a stream ended before the update landed: raise max_tokens")
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    pauses, commits, during, before = [], [], 0, []
    for t in times:
        gaps = list(itertools.pairwise(t))
        base = statistics.median(b - a for a, b in gaps if b < t0)
        over = [b - a for a, b in gaps if b > t0 and a < t1]
        pauses.append(max(over, default=0.0) - base)
        commits.append(max((b - a for a, b in gaps if a < t1 < b), default=0.0) - base)
        during += sum(t0 < x <= t1 for x in t)
        before.append(1 / base)
    wall = t1 - t0
    return {
        "pause_ms": max(pauses) * 1e3,
        "commit_gap_ms": max(commits) * 1e3,
        "wall_ms": wall * 1e3,
        "tok_s_during": during / wall if wall > 0 else 0.0,
        "tok_s_before": sum(before),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="staged-") as tmp:  # two checkpoints: 4 GB at the 0.5B shape
        return await run_in(args, Path(tmp))


async def run_in(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    a = make_tiny_model(root / "A", preset="125m", seed=0, **SHAPES[args.shape])
    b = make_tiny_model(root / "B", preset="125m", seed=1, **SHAPES[args.shape])
    state_a = load_file(str(a / "model.safetensors"))
    other = changed(state_a, 0.02, seed=2)
    there, back = sparse(state_a, other), sparse(other, state_a)
    adapters = [make_tiny_lora(a, root / f"lora{i}", seed=i) for i in range(2)]
    lora = LoRARequest("a", 1, str(adapters[0]))
    lora_tensors = [list(load_file(str(f / "adapter_model.safetensors")).items()) for f in adapters]
    updates: list[tuple[str, dict[str, Any]]] = [
        ("full", {"weights_path": str(b)}),
        ("full", {"weights_path": str(a)}),
        ("2% delta", {"weights_iterator": there, "encoding": "sparse"}),
        ("2% delta", {"weights_iterator": back, "encoding": "sparse"}),
        ("LoRA", {"weights_iterator": lora_tensors[1], "target": "lora:a"}),
        ("LoRA", {"weights_iterator": lora_tensors[0], "target": "lora:a"}),
    ]
    kinds = {"full": "full", "delta": "2% delta", "lora": "LoRA"}
    chosen = {kinds[k] for k in args.kinds.split(",")}
    updates = [(kind, update) for kind, update in updates if kind in chosen]
    engines = {
        m: AsyncLLMEngine.from_kwargs(
            str(a),
            update_staging=m,
            staging_slice_ms=args.slice_ms,
            max_num_seqs=max(8, args.streams),
            enable_lora=True,
            max_lora_rank=8,
            max_cpu_loras=4,
        )
        for m in MODES
    }
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    seed = 0
    for _ in range(args.reps):
        for kind, update in updates:
            for mode in MODES:
                seed += 1
                figures = await trial(engines[mode], mode, update, args.streams, seed, lora if kind == "LoRA" else None)
                results.setdefault((kind, mode), []).append(figures)
                if mode == "shadow":  # the host's own jitter over a window as long as the staging took
                    seed += 1
                    window = {"seconds": figures["wall_ms"] / 1e3}
                    control = await trial(
                        engines[mode], "control", window, args.streams, seed, lora if kind == "LoRA" else None
                    )
                    results.setdefault((kind, "no update (control)"), []).append(control)
            if kind == "full":  # the same staged reload, the streams asking to recompute their KV at the commit
                seed += 1
                figures = await trial(engines["shadow"], "shadow", update, args.streams, seed, policy="recompute")
                results.setdefault(("full", "shadow, recompute"), []).append(figures)
    for engine in engines.values():
        await engine.shutdown()
    table: dict[str, Any] = {}
    if "2% delta" in chosen:  # the floor under a 2 % delta's pause: its elements written alone
        print("\nthe 2 % delta's elements written by themselves (nothing else; 'of the full reload' is of 1 s):")
        table["floor"] = scatter_floor(state_a, other, 1.0, args.reps)
    print(
        f"\n{'update':<10} {'mode':<18} {'pause ms':>9} {'commit gap':>11} {'wall ms':>9} {'tok/s during':>13} "
        f"{'tok/s before':>13}"
    )
    for (kind, mode), rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        worst = max(r["pause_ms"] for r in rows)
        print(
            f"{kind:<10} {mode:<18} {med['pause_ms']:9.1f} {med['commit_gap_ms']:11.1f} {med['wall_ms']:9.1f} "
            f"{med['tok_s_during']:13.1f} {med['tok_s_before']:13.1f}   (worst pause {worst:.1f} ms)"
        )
        table[f"{kind} {mode}"] = {k: round(v, 1) for k, v in med.items()} | {"worst_pause_ms": round(worst, 1)}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="125m", choices=sorted(SHAPES))
    parser.add_argument("--kinds", default="full,delta,lora", help="updates to time: full, delta, lora")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--slice-ms", type=float, default=3.0)
    args = parser.parse_args()
    print(
        f"CPU: {cpu_description()}, {torch.get_num_threads()} threads; shape {args.shape}, fp32, "
        f"{args.streams} streams, slices of {args.slice_ms} ms"
    )
    table = asyncio.run(run(args))
    print(
        json.dumps(
            {
                "benchmark": "staged_updates",
                "shape": args.shape,
                "streams": args.streams,
                "slice_ms": args.slice_ms,
                "cpu": cpu_description(),
                "figures": table,
            }
        )
    )


if __name__ == "__main__":
    main()
