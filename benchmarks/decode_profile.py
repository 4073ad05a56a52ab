"""Where a generation step of hotswap goes, on the throughput benchmark's workloads.

Runs one workload (default: the 125M llama, 64 prompts x 64 tokens, fp32, greedy, fixed length) twice, the first
as a warm-up, and times the second by kind of call: the native decoder stack (`layers`: every layer and the final
norm in one `decoder_layers` call, which decode steps take), linear layers (the LM head included), attention
(RoPE, KV write and attention: `Attention.forward`), norms, sampling, and the rest (embedding, SwiGLU gate outside
the fused kernel, Python and dispatch). `--modules` turns the native stack off, so that decode steps go through the
modules and their layers split into linear, attention and norms. With `--attention-in-cache` (and `--modules`),
every decode attention call is also repeated at once, with its KV now in cache, to split attention into compute
and waiting for memory (the repeat is not counted in the step times, but it is in the run's total).

    python -m benchmarks.decode_profile [--workload 125m] [--modules] [--attention-in-cache]
                                        [--isa native|avx2-kernels|avx2] [--dtype float32|bfloat16]
                                        [--kv-cache-dtype auto|bfloat16] [--seqs N]

`--isa avx2` runs as an AVX2-only host would (`hotswap.kernels.emulation`).

Prints human-readable lines and ends with one JSON line of figures (milliseconds).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from hotswap import LLM, SamplingParams
from hotswap.kernels import emulation
from hotswap.model.layers import attention, embedding, linear, norm
from hotswap.testing import make_tiny_model
from hotswap.worker import decoder_stack, model_runner

WORKLOADS = {"9m": (64, 128), "125m": (64, 64)}


class StepTimer:
    """Wraps the engine's layer methods to accumulate wall time per kind of call within each engine step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[tuple[int, float, dict[str, float]]] = []  # (new tokens, step seconds, per kind)
        self.in_cache: list[float] = []  # per decode step: attention repeated with its KV in cache
        self.current_in_cache = 0.0

    def wrap(self, owner: object, name: str, kind: str) -> None:
        """Replaces `owner.name` (a class's method or a module's function) by a version timed as `kind`."""
        original: Callable = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[kind] += time.perf_counter() - start

        setattr(owner, name, timed)

    def wrap_step(self) -> None:
        original = model_runner.ModelRunner.execute

        def timed(runner, model_input):
            self.current = defaultdict(float)
            self.current_in_cache = 0.0
            start = time.perf_counter()
            out = original(runner, model_input)
            seconds = time.perf_counter() - start - self.current_in_cache  # the repeats are not part of the step
            self.steps.append((len(model_input.input_ids), seconds, dict(self.current)))
            if self.current_in_cache:
                self.in_cache.append(self.current_in_cache)
            return out

        model_runner.ModelRunner.execute = timed

    def repeat_attention_in_cache(self) -> None:
        """Calls each decode-step attention a second time, untimed in the step, timing that repeat apart (its
        writes put the same keys and values in the same slots again)."""
        original = attention.Attention.forward

        def twice(layer, *args, **kwargs):
            out = original(layer, *args, **kwargs)
            meta = args[3] if len(args) > 3 else kwargs["meta"]
            if meta.max_query_len == 1:
                pause = time.perf_counter()
                original(layer, *args, **kwargs)
                repeat = time.perf_counter() - pause
                self.current_in_cache += repeat
                self.current["attention"] -= repeat  # the wrapper around `twice` counts both calls
            return out

        attention.Attention.forward = twice


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    return {"min": round(min(ms), 2), "median": round(statistics.median(ms), 2), "max": round(max(ms), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="125m", choices=sorted(WORKLOADS))
    parser.add_argument("--modules", action="store_true", help="run decode steps through the modules")
    parser.add_argument("--attention-in-cache", action="store_true", help="with --modules: time attention again")
    parser.add_argument("--isa", choices=emulation.ISAS, default="native", help="emulate a narrower host")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--seqs", type=int, default=None, help="sequences decoding at once (default: the workload's)")
    args = parser.parse_args()
    emulation.reexec_under(args.isa)
    if args.attention_in_cache and not args.modules:
        parser.error("--attention-in-cache times the modules' attention calls: add --modules")
    count, max_tokens = WORKLOADS[args.workload]
    count = args.seqs or count
    timer = StepTimer()
    if args.attention_in_cache:
        timer.repeat_attention_in_cache()
    if args.modules:
        decoder_stack.NativeDecoderStack.applies = lambda *_: False  # type: ignore[method-assign]
    timer.wrap(decoder_stack.NativeDecoderStack, "run", "layers")
    timer.wrap(attention.Attention, "forward", "attention")
    timer.wrap(linear.Linear, "forward", "linear")
    timer.wrap(linear.MergedLinear, "forward_silu_and_mul", "linear")
    timer.wrap(embedding.VocabEmbedding, "logits", "linear")
    timer.wrap(norm.RMSNorm, "forward", "norm")
    timer.wrap(norm.RMSNorm, "add_and_norm", "norm")
    timer.wrap(model_runner, "sample", "sampling")  # looked up in model_runner's globals at each step
    timer.wrap_step()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model(Path(tmp) / args.workload, arch="llama", preset=args.workload))
        llm = LLM(path, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max(256, count))
        rng = random.Random(0)
        vocab = len(llm.get_tokenizer())
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(count)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for _ in range(2):  # the first run warms up; only the second is reported
            timer.steps.clear()
            timer.in_cache.clear()
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            total = time.perf_counter() - start
    decode = [(seconds, kinds) for tokens, seconds, kinds in timer.steps if tokens <= count]
    prefill = [(tokens, seconds, kinds) for tokens, seconds, kinds in timer.steps if tokens > count]
    figures: dict = {
        "workload": args.workload,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "seqs": count,
        "total_s": round(total, 3),
        "tok_s": round(count * max_tokens / total),
    }
    print(f"[{args.workload}] {count} prompts x {max_tokens} tokens: {total:.2f} s ({figures['tok_s']} tok/s)")
    for tokens, seconds, kinds in prefill:
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(kinds.items()))
        print(f"prefill step of {tokens} tokens: {seconds * 1e3:.1f} ms ({parts})")
    figures["prefill_ms"] = [round(s * 1e3, 1) for _, s, _ in prefill]
    steps = [s for s, _ in decode]
    figures["decode_step_ms"] = summary(steps)
    figures["decode_steps_ms"] = [round(s * 1e3, 1) for s in steps]
    print(
        f"{len(steps)} decode steps (ms): min {figures['decode_step_ms']['min']}, median "
        f"{figures['decode_step_ms']['median']}, max {figures['decode_step_ms']['max']}"
    )
    kinds = ["layers", "linear", "attention", "norm", "sampling"]
    per_kind = {k: [kinds_.get(k, 0.0) for _, kinds_ in decode] for k in kinds}
    per_kind["rest"] = [s - sum(k.get(x, 0.0) for x in kinds) for s, k in decode]
    for kind, values in per_kind.items():
        figures[f"decode_{kind}_ms"] = summary(values)
        print(f"  {kind:<10} median {figures[f'decode_{kind}_ms']['median']:7.2f} ms per step")
    if timer.in_cache:
        figures["decode_attention_in_cache_ms"] = summary(timer.in_cache)
        median = figures["decode_attention_in_cache_ms"]["median"]
        print(f"  attention repeated with its KV in cache: median {median} ms per step")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
