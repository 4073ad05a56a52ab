"""Mixture-of-experts: decode throughput of hotswap against transformers on one random-weight Qwen3-MoE-shaped
model, in one run (TP=1, and TP=2 with expert parallelism), and the time of a full weight update against the
memcpy floor of the same bytes; and the cost of returning the routed experts (`return_routed_experts`, routing
replay), the same engine with routes on and off taking turns, with the payload per token in vLLM's and SGLang's
wire shapes.

The model (default): hidden 512, 12 layers, 48 experts of intermediate 256, top-8 routing, vocabulary 8192, about
0.25B parameters (1 GB in fp32). 32 prompts x 32 generated tokens, fp32 greedy, fixed length. Each engine runs
`--reps` times, taking turns; the best run of each is reported with the ratio.

    python -m benchmarks.moe [--reps 2] [--layers 12] [--experts 48] [--top-k 8] [--skip-ep] [--route-reps 4]

Prints human-readable lines and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from safetensors.torch import load_file

from benchmarks.throughput import HotswapRunner, TransformersRunner, kernel_build, make_prompts
from benchmarks.weight_update import median_seconds, memcpy_seconds
from hotswap import LLM
from hotswap.testing import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--skip-ep", action="store_true", help="skip the TP=2 expert-parallel run")
    parser.add_argument("--route-reps", type=int, default=4, help="turns of routes on / off")
    args = parser.parse_args()
    build = kernel_build()
    print(f"CPU: {build['cpu']}; kernels: {build['build']}; torch threads: {torch.get_num_threads()}")
    results: dict[str, object] = {"cpu": build["cpu"], "build": build["build"]}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(
            make_tiny_model(
                f"{tmp}/moe",
                "qwen3_moe",
                preset="9m",
                hidden_size=512,
                num_hidden_layers=args.layers,
                num_attention_heads=8,
                num_key_value_heads=4,
                num_experts=args.experts,
                num_experts_per_tok=args.top_k,
                moe_intermediate_size=256,
                vocab_size=8192,
            )
        )
        weights = load_file(f"{path}/model.safetensors")
        params = sum(t.numel() for t in weights.values())
        print(f"model: {params / 1e6:.0f}M parameters, {args.experts} experts, top-{args.top_k}, {args.layers} layers")
        results["parameters"] = params
        hotswap = HotswapRunner(path)
        prompts = make_prompts(hotswap.llm.get_tokenizer(), args.prompts)
        hf = TransformersRunner(path)
        runners: dict[str, HotswapRunner | TransformersRunner] = {"hotswap": hotswap, "transformers": hf}
        best = {name: 0.0 for name in runners}
        for runner in runners.values():
            runner.warm_up(prompts, args.tokens)
        for rep in range(args.reps):
            order = list(runners) if rep % 2 == 0 else list(reversed(runners))
            for name in order:
                best[name] = max(best[name], runners[name].run(prompts, args.tokens))
        ratio = best["hotswap"] / best["transformers"]
        print(
            f"decode, TP=1: hotswap {best['hotswap']:.0f} tok/s, transformers {best['transformers']:.0f} tok/s "
            f"({ratio:.2f}x)"
        )
        results.update(
            hotswap_tok_s=round(best["hotswap"], 1),
            transformers_tok_s=round(best["transformers"], 1),
            ratio=round(ratio, 2),
        )
        del hf, runners
        results.update(routes_cost(hotswap, prompts, args.tokens, args.route_reps))

        # a full update from in-memory tensors (checkpoint B of the same shape), against copying its bytes once
        other = make_tiny_model(
            f"{tmp}/moe_b",
            "qwen3_moe",
            preset="9m",
            seed=1,
            hidden_size=512,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=256,
            vocab_size=8192,
        )
        new = list(load_file(f"{other}/model.safetensors").items())
        nbytes = sum(t.numel() * t.element_size() for _, t in new)
        llm: LLM = hotswap.llm

        def update_once() -> None:
            llm.reload_weights(weights_iterator=new)

        update = median_seconds(update_once, 3)
        floor = memcpy_seconds(nbytes, 3)
        print(
            f"full update ({nbytes / 1e9:.2f} GB, reload_weights from tensors): {update:.3f} s; memcpy floor "
            f"{floor:.3f} s ({update / floor:.1f}x)"
        )
        results.update(update_s=round(update, 3), memcpy_s=round(floor, 3), update_over_memcpy=round(update / floor, 2))
        llm.llm_engine.shutdown()

        if not args.skip_ep:
            start = time.perf_counter()
            ep = LLM(path, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
            ready = time.perf_counter() - start
            runner = HotswapRunner.__new__(HotswapRunner)
            runner.llm, runner.ready = ep, ready
            runner.warm_up(prompts, args.tokens)
            ep_best = max(runner.run(prompts, args.tokens) for _ in range(args.reps))
            print(
                f"decode, TP=2 expert-parallel: {ep_best:.0f} tok/s ({ep_best / best['transformers']:.2f}x "
                "transformers; both ranks share this machine's cores)"
            )
            results.update(ep2_tok_s=round(ep_best, 1), ep2_ratio=round(ep_best / best["transformers"], 2))
            ep.llm_engine.shutdown()
    print(json.dumps(results))


def routes_cost(runner: HotswapRunner, prompts: list[list[int]], tokens: int, reps: int) -> dict[str, object]:
    """Decode throughput with routes returned against without (same engine, taking turns: on, off, off, on, ...;
    the median of each), and the routes' payload per token."""
    from hotswap.entrypoints.replay_wire import int32_base64, npy_base64

    speeds: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(2 * reps):
        on = rep % 4 in (0, 3)
        runner.extra = {"return_routed_experts": True} if on else {}
        speeds[on].append(runner.run(prompts, tokens))
    routes = [o.outputs[0].routed_experts for o in runner.last]
    runner.extra = {}
    rows = sum(len(r) for r in routes)
    npy = sum(len(npy_base64(r)) for r in routes) / rows
    sglang = sum(len(int32_base64(r)) for r in routes) / rows
    off, on_ = statistics.median(speeds[False]), statistics.median(speeds[True])
    print(
        f"routes returned: {on_:.0f} tok/s against {off:.0f} tok/s without ({on_ / off:.3f}x; runs on "
        f"{[round(v) for v in speeds[True]]}, off {[round(v) for v in speeds[False]]}); payload per token: "
        f"{routes[0].nbytes / len(routes[0]):.0f} B in memory ({routes[0].dtype}), {npy:.0f} B as vLLM's base64 "
        f".npy, {sglang:.0f} B as SGLang's base64 int32"
    )
    return {
        "routes_on_tok_s": round(on_, 1),
        "routes_off_tok_s": round(off, 1),
        "routes_ratio": round(on_ / off, 3),
        "routes_bytes_per_token": {
            "memory": routes[0].nbytes // len(routes[0]),
            "vllm_npy_base64": round(npy),
            "sglang_int32_base64": round(sglang),
        },
    }


if __name__ == "__main__":
    main()
