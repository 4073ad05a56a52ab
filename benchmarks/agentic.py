"""Agentic rollouts: many multi-turn tool-using conversations at once, and what a grammar costs.

sessions: `--sessions` conversations of `--turns` turns each run concurrently against `hotswap serve
--tool-call-parser hermes` (a random-weight model, `--preset`, vocabulary `--vocab`). Each turn is a streamed chat
request with two tools and tool_choice "required" (the last turn: "none"), then a tool message of random words.
Two ways of building the next turn's request are compared, each in its own server:
- exact: the assistant message carries the turn's `token_ids`, and the requests carry `X-Session-ID`;
- retokenized: the assistant message carries its text and tool calls only (the template re-tokenizes them) and no
  session id, as clients without token-in/token-out do.
Reported: prefix-cache hit rate on turns 2..N (cached / prompt tokens), generated tokens/s, time to first token
by turn (mean), and the KV cache's size against what the conversations hold at the end.

grammar: `--rows` sequences decode `--tokens` tokens each (temperature 1, EOS ignored) in one batch, in-process:
all unconstrained, half under a grammar, all under it (a regex that stays open, so every row runs to the end).
Reported: tokens/s and the step time of each, as ratios to the unconstrained batch.

    python -m benchmarks.agentic [--parts sessions,grammar] [--sessions 16] [--turns 20] [--preset 125m]
        [--vocab 39084] [--kv-cache-memory-bytes N] [--max-model-len 8192] [--rows 32] [--tokens 128]
        [--isa native|avx2-kernels|avx2]

Prints human-readable lines and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

WORDS = (
    "alpha beta gamma delta river stone cloud paper seven green north light table window garden music "
    "number winter silver orange market bridge forest letter planet engine mirror candle"
).split()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Searches the web",
            "parameters": {
                "type": "object",
                "properties": {"query": {"enum": WORDS[:8]}, "top_k": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["query", "top_k"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]

# A Hermes-style template (tools in the system turn, calls in <tool_call> blocks, results in <tool_response>), so
# that a re-tokenized conversation renders its tool calls as such a model's template would.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else '' }}"
    "\n\n# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\nFor each call, answer with:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    '{%- for c in m.tool_calls | default([]) %}\n<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n'
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def conversation(client: Any, base: str, index: int, turns: int, exact: bool) -> list[dict[str, Any]]:
    """One agent episode; returns per turn: prompt and cached tokens, generated tokens, TTFT, seconds."""
    rng = random.Random(index)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent. Use the tools to answer."},
        {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(40))},
    ]
    headers = {"X-Session-ID": f"agent-{index}"} if exact else {}
    figures = []
    for turn in range(turns):
        last = turn == turns - 1
        body = {
            "model": "m",
            "messages": messages,
            "tools": TOOLS,
            "tool_choice": "none" if last else "required",
            "max_tokens": 96,
            "temperature": 1.0,
            "chat_template": TEMPLATE,
            "seed": index * 1000 + turn,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "parallel_tool_calls": False,
        }
        start = time.perf_counter()
        first: float | None = None
        ids: list[int] = []
        content, calls, usage = "", [], {}
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                raise RuntimeError(f"turn {turn}: {response.status_code} {(await response.aread()).decode()}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    if choice.get("token_ids") and first is None:
                        first = time.perf_counter() - start
                    ids += choice.get("token_ids") or []
                    content += choice["delta"].get("content") or ""
                    calls += choice["delta"].get("tool_calls") or []
        figures.append(
            {
                "turn": turn,
                "prompt": usage["prompt_tokens"],
                "cached": usage["prompt_tokens_details"]["cached_tokens"],
                "generated": len(ids),
                "ttft": first or 0.0,
                "seconds": time.perf_counter() - start,
            }
        )
        assistant: dict[str, Any] = {"role": "assistant", "content": content}
        if exact:
            assistant["token_ids"] = ids
        if calls:
            assistant["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        messages.append(assistant)
        for call in calls:
            result = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20)))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        if not calls:
            messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(20))})
    return figures


async def run_sessions(base: str, sessions: int, turns: int, exact: bool) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        episodes = await asyncio.gather(*(conversation(client, base, i, turns, exact) for i in range(sessions)))
        wall = time.perf_counter() - start
    later = [t for episode in episodes for t in episode if t["turn"] > 0]
    generated = sum(t["generated"] for episode in episodes for t in episode)
    by_turn = [statistics.mean(e[turn]["ttft"] for e in episodes) for turn in range(turns)]
    return {
        "hit_rate_turns_2_n": sum(t["cached"] for t in later) / sum(t["prompt"] for t in later),
        "generated_tok_s": generated / wall,
        "wall_s": wall,
        "ttft_s_by_turn": [round(x, 4) for x in by_turn],
        "ttft_p50_s": statistics.median(t["ttft"] for e in episodes for t in e),
        "final_context_tokens": sum(e[-1]["prompt"] + e[-1]["generated"] for e in episodes),
    }


def sessions_part(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from hotswap.testing import running_server

    out: dict[str, Any] = {}
    for mode in ("exact", "retokenized"):
        with running_server(
            model,
            "--served-model-name",
            "m",
            "--tool-call-parser",
            "hermes",
            "--kv-cache-memory-bytes",
            str(args.kv_cache_memory_bytes),
        ) as (base, _):
            import httpx

            figures = asyncio.run(run_sessions(base, args.sessions, args.turns, mode == "exact"))
            stats = httpx.get(f"{base}/metrics", timeout=60).text
            blocks = [line for line in stats.splitlines() if line.startswith("hotswap_session_cached_blocks")]
            figures["session_cached_blocks"] = blocks[0].split()[-1] if blocks else None
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in figures.items() if k != "ttft_s_by_turn"}
        print(f"  {mode}: {shown}")
        print(f"    ttft by turn (s): {figures['ttft_s_by_turn']}")
        out[mode] = figures
    return out


def grammar_part(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from hotswap import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(100, args.vocab) for _ in range(32)]} for _ in range(args.rows)]
    constrained = {"regex": "[a-z ,.]{1,4000}"}  # stays open: every row runs its tokens

    def params(i: int, grammar: bool) -> SamplingParams:
        return SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=args.tokens,
            ignore_eos=True,
            structured_outputs=constrained if grammar else None,
        )

    modes = {"off": [False] * args.rows, "half": [i % 2 == 1 for i in range(args.rows)], "all": [True] * args.rows}
    best: dict[str, float] = {}
    for rep in range(args.reps):
        for name, grammar in modes.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, [params(i, g) for i, g in enumerate(grammar)], use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            best[name] = max(best.get(name, 0.0), tokens / seconds)
            print(f"  rep {rep} {name}: {tokens / seconds:.1f} tok/s")
    figures = {f"{name}_tok_s": round(v, 1) for name, v in best.items()}
    figures["half_over_off"] = round(best["half"] / best["off"], 3)
    figures["all_over_off"] = round(best["all"] / best["off"], 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="sessions,grammar")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--vocab", type=int, default=39084)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--isa", default="native", help="native, avx2-kernels or avx2 (see benchmarks/throughput.py)")
    args = parser.parse_args()

    from benchmarks.throughput import kernel_build
    from hotswap.kernels import emulation
    from hotswap.testing import make_tiny_model

    emulation.reexec_under(args.isa)
    build = kernel_build()
    print(f"cpu: {build['cpu']}; kernels: {build['build']}; torch: {build['torch_isa']}")
    figures: dict[str, Any] = {"isa": args.isa, "preset": args.preset, "vocab": args.vocab, **build}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(
            make_tiny_model(
                Path(tmp) / "model",
                preset=args.preset,
                vocab_size=args.vocab,
                max_position_embeddings=args.max_model_len,
            )
        )
        if "sessions" in args.parts:
            print(f"sessions: {args.sessions} x {args.turns} turns")
            figures["sessions"] = sessions_part(model, args)
        if "grammar" in args.parts:
            print(f"grammar: {args.rows} rows x {args.tokens} tokens")
            figures["grammar"] = grammar_part(model, args)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
