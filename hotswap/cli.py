"""The `hotswap` command: make-model, generate, serve, demo, parity."""

from __future__ import annotations

import argparse
import sys


def _make_model(args: argparse.Namespace) -> int:
    from hotswap.testing import make_tiny_model

    overrides = {}
    if args.tie_word_embeddings is not None:
        overrides["tie_word_embeddings"] = args.tie_word_embeddings
    path = make_tiny_model(args.dir, arch=args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype, **overrides)
    print(f"wrote a random-weight {args.arch} checkpoint ({args.preset}) to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from hotswap import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, deterministic=args.deterministic)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        n=args.n,
    )
    outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outputs:
        for completion in out.outputs:
            print(f"{out.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    return 0


def _parity(args: argparse.Namespace) -> int:
    import json
    import random
    from pathlib import Path

    from hotswap.train.parity import parity

    if args.sequences:
        sequences = json.loads(Path(args.sequences).read_text())
        if not isinstance(sequences, list) or not all(isinstance(s, list) for s in sequences):
            raise ValueError(f"{args.sequences}: expected a JSON list of token id lists")
    else:
        from hotswap.config import ModelConfig

        vocab = int(ModelConfig(model=args.model).hf_config["vocab_size"])
        rng = random.Random(args.seed)
        sequences = [[rng.randrange(3, vocab) for _ in range(args.length)] for _ in range(args.num_sequences)]
    reports = parity(args.model, sequences, modes=tuple(args.modes.split(",")))
    for r in reports:
        print(
            f"{r.mode:>13}: {r.positions} positions, max |d logprob| {r.max_abs_logprob_diff:.3g}, KL mean "
            f"{r.mean_kl:.3g} max {r.max_kl:.3g}, TV mean {r.mean_tv:.3g} max {r.max_tv:.3g}"
            f"{', bitwise equal' if r.bitwise_equal else ''}"
        )
    print(json.dumps([r.as_dict() for r in reports]))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from hotswap.entrypoints.server import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    from hotswap.testing import SUPPORTED_ARCHS

    parser = argparse.ArgumentParser(prog="hotswap", description="An LLM inference engine that takes new weights live.")
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="write a random-weight Hugging Face checkpoint with a local tokenizer")
    make.add_argument("dir")
    make.add_argument("--arch", default="llama", choices=list(SUPPORTED_ARCHS))
    make.add_argument("--preset", default="tiny", choices=["tiny", "9m", "125m"])
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    make.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    make.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="generate completions from a checkpoint folder")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--deterministic", action="store_true", help="the batch-invariant mode (docs/determinism.md)")
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server with the RL admin API")
    from hotswap.entrypoints.server import add_serve_arguments

    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)

    par = sub.add_parser("parity", help="how far the engine's logprobs are from the trainer forward's, per mode")
    par.add_argument("--model", required=True, help="a checkpoint folder (the trainer is transformers' model of it)")
    par.add_argument("--sequences", default=None, help="a JSON file: a list of token id lists (default: random ids)")
    par.add_argument("--num-sequences", type=int, default=4)
    par.add_argument("--length", type=int, default=48)
    par.add_argument("--seed", type=int, default=0)
    par.add_argument("--modes", default="default,deterministic")
    par.set_defaults(func=_parity)

    from hotswap.demo import add_demo_arguments, run_demo_from_args

    demo = sub.add_parser("demo", help="live RL: a trainer process pushes weights into the running engine every step")
    add_demo_arguments(demo)
    demo.set_defaults(func=run_demo_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
