"""Speculative decoding: decode tokens/s with and without speculation on the 125M model, with acceptance beside.

Engines, each its own `LLM` on the same random-weight 125M checkpoint (fp32, greedy, fixed length), run in turns:
- `plain`: no speculation (the baseline of every ratio);
- `draft=target`: the target as its own draft, k=3: every proposal is accepted (acceptance 1.0), so this is the
  mechanism's best case for a draft that costs as much as the target, and shows its overhead;
- `draft=9m`: a random 9M-shaped draft with the target's tokenizer, k=3: it is rarely right (the worst case: the
  cost of proposing and verifying for almost nothing);
- `ngram`: prompt lookup, k=4, on a repetitive workload (RL outputs repeat; so do a random model's greedy ones).

Batch sizes 1 and 8 (speculation pays where a step is bound by reading the weights, not by compute).

A random-weight target's greedy output is unpredictable (a bigram table fitted on 20k of its own tokens predicts
0.1 % of the next ones), so no small draft can be trained to agree with it here, and its outputs do not repeat.
The benchmark therefore also measures the step costs speculation is made of (a target step of B tokens, a
verification of B x (k+1), a 9M draft pass) and prints the speed-up they imply for a draft of that cost at a
given acceptance rate: E[tokens per step] = (1 - a^(k+1)) / (1 - a), time per step = k draft passes + one
verification. Those lines are a projection from measured costs, labelled as such.

    python -m benchmarks.speculative [--reps 2] [--tokens 96] [--batches 1,8]

Prints human-readable lines and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from benchmarks.throughput import kernel_build
from hotswap import LLM, SamplingParams
from hotswap.testing import make_tiny_model

PHRASES = [
    "the model reads the weights and the model writes the tokens and ",
    "step one add the numbers step two check the sum step three ",
    "alpha beta gamma delta alpha beta gamma delta ",
    "if x then y else z if x then y else z ",
]


def run(llm: LLM, prompts: list[str], tokens: int) -> tuple[float, float, float]:
    """(tokens/s, acceptance rate, mean tokens per step) of one generate over `prompts`."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = [o.outputs[0].spec_stats for o in outs]
    if stats[0] is None:
        return len(prompts) * tokens / elapsed, 0.0, 1.0
    proposed = sum(s.num_draft_tokens for s in stats if s is not None)
    accepted = sum(s.num_accepted_tokens for s in stats if s is not None)
    steps = sum(s.num_steps for s in stats if s is not None)
    return len(prompts) * tokens / elapsed, accepted / max(proposed, 1), (accepted + steps) / max(steps, 1)


def step_costs(llm: LLM, batch: int, k: int, context: int = 64, reps: int = 5) -> dict[str, float]:
    """Seconds of one target pass over `batch` tokens, of one verification pass over batch x (k+1), and of one
    draft pass over `batch` tokens, measured on the engine's own runners and caches."""
    worker = llm.llm_engine.executor.worker
    blocks = -(-(context + k + 1) // llm.config.cache_config.block_size)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]

    def timed(runner, n: int) -> float:
        ids = [5] * (batch * n)
        pos = [p for _ in range(batch) for p in range(context - 1, context - 1 + n)]
        args = (ids, pos, [n] * batch, [context - 1 + n] * batch, tables, list(range(batch * n)))
        runner.forward(*args)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            runner.forward(*args)
            best = min(best, time.perf_counter() - start)
        return best

    costs = {"target": timed(worker.runner, 1), "verify": timed(worker.runner, k + 1)}
    with worker._draft_scope():
        costs["draft"] = timed(worker.draft_runner, 1)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    build = kernel_build()
    print(f"CPU: {build['cpu']}; kernels: {build['build']}; torch threads: {torch.get_num_threads()}")
    results: dict[str, object] = {"cpu": build["cpu"], "build": build["build"], "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as tmp:
        target = str(make_tiny_model(f"{tmp}/125m", "llama", preset="125m"))
        draft = str(make_tiny_model(f"{tmp}/9m", "llama", preset="9m", vocab_size=16384))
        engines = {
            "plain": LLM(target, dtype="float32"),
            "draft=target": LLM(
                target,
                dtype="float32",
                speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3},
            ),
            "draft=9m": LLM(
                target,
                dtype="float32",
                speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
            ),
            "ngram": LLM(
                target,
                dtype="float32",
                speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
            ),
        }
        for batch in batches:
            prompts = [PHRASES[i % len(PHRASES)] * 2 for i in range(batch)]
            for llm in engines.values():
                run(llm, prompts[:1], 8)  # warm-up
            best: dict[str, tuple[float, float, float]] = {}
            for rep in range(args.reps):
                order = list(engines) if rep % 2 == 0 else list(reversed(engines))
                for name in order:
                    figures = run(engines[name], prompts, args.tokens)
                    if name not in best or figures[0] > best[name][0]:
                        best[name] = figures
            base = best["plain"][0]
            for name, (tok_s, rate, length) in best.items():
                extra = "" if name == "plain" else f"  acceptance {rate:.2f}, {length:.2f} tokens/step"
                print(f"batch {batch:>2} {name:<13} {tok_s:7.1f} tok/s  {tok_s / base:5.2f}x{extra}")
                results[f"b{batch}_{name}"] = {
                    "tok_s": round(tok_s, 1),
                    "ratio": round(tok_s / base, 2),
                    "acceptance": round(rate, 3),
                    "tokens_per_step": round(length, 2),
                }
            k = 3
            costs = step_costs(engines["draft=9m"], batch, k)
            print(
                f"batch {batch:>2} step costs: target {costs['target'] * 1e3:.1f} ms, verification of {k + 1} "
                f"tokens each {costs['verify'] * 1e3:.1f} ms ({costs['verify'] / costs['target']:.2f}x), 9M draft "
                f"pass {costs['draft'] * 1e3:.2f} ms"
            )
            projected = {}
            for a in (0.5, 0.7, 0.9):
                tokens = (1 - a ** (k + 1)) / (1 - a)
                projected[a] = tokens * costs["target"] / (k * costs["draft"] + costs["verify"])
            print(
                f"batch {batch:>2} projection for a 9M-cost draft, k={k}: "
                + ", ".join(f"acceptance {a}: {r:.2f}x" for a, r in projected.items())
            )
            results[f"b{batch}_step_ms"] = {n: round(v * 1e3, 2) for n, v in costs.items()}
            results[f"b{batch}_projected"] = {str(a): round(r, 2) for a, r in projected.items()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
