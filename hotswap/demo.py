"""The demo: builds a small model locally, loads it into the engine and generates from it."""

from __future__ import annotations

import os
import time

from hotswap.entrypoints.llm import LLM
from hotswap.sampling_params import SamplingParams
from hotswap.testing import make_tiny_model


def run_demo(out_dir: str = "demo_out") -> int:
    """Writes a random-weight checkpoint under `out_dir`, loads it and prints greedy and sampled completions."""
    path = make_tiny_model(os.path.join(out_dir, "model"), arch="llama", preset="9m")
    print(f"built a random-weight llama checkpoint (9m preset) at {path}")
    start = time.perf_counter()
    llm = LLM(str(path))
    print(f"engine ready in {time.perf_counter() - start:.2f} s")
    prompts = ["the quick brown fox", "once upon a time", "numbers: 1 2 3", "hello"]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for out in outputs:
        print(f"  greedy  {out.prompt!r} -> {out.outputs[0].text!r}")
    sampled = llm.generate(prompts[0], SamplingParams(temperature=0.8, top_p=0.95, n=3, seed=0, max_tokens=24))
    for completion in sampled[0].outputs:
        print(f"  sampled {prompts[0]!r} -> {completion.text!r}")
    print(f"{tokens} greedy tokens in {elapsed:.2f} s ({tokens / elapsed:.0f} tokens/s)")
    return 0
