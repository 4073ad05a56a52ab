"""Throughput at tensor_parallel_size 1 and 2 on the same model and prompts, in one run.

    python -m benchmarks.tensor_parallel [--preset 125m] [--prompts 64] [--tokens 64]

Prints human-readable lines and ends with one JSON line of figures. On a machine with few cores the two ranks
share them, so this measures the overhead of the split (all-reduces, process hops) more than a speed-up.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from hotswap import LLM, SamplingParams
from hotswap.testing import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(rng.randint(16, 48))]} for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    figures: dict = {}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model(Path(tmp) / "m", preset=args.preset))
        for tp in (1, 2):
            start = time.perf_counter()
            llm = LLM(path, tensor_parallel_size=tp, kv_cache_memory_bytes=1 << 30)
            ready = time.perf_counter() - start
            llm.generate(prompts[:4], params, use_tqdm=False)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            outputs[tp] = [o.outputs[0].token_ids for o in outs]
            tps = len(prompts) * args.tokens / elapsed
            print(f"TP={tp}: {tps:.0f} tok/s ({len(prompts)} prompts x {args.tokens} tokens), ready in {ready:.1f} s")
            figures[f"tp{tp}"] = {"tok_s": round(tps, 1), "ready_s": round(ready, 2)}
            llm.shutdown()
    figures["tp2_over_tp1"] = round(figures["tp2"]["tok_s"] / figures["tp1"]["tok_s"], 2)
    figures["same_tokens"] = outputs[1] == outputs[2]
    print(f"TP=2 / TP=1: {figures['tp2_over_tp1']:.2f}x; identical greedy tokens: {figures['same_tokens']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
