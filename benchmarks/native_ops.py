"""Native kernels against their torch paths, op by op, on the 125M model's shapes, for the build this process
loads (`--isa avx2-kernels`, or `HOTSWAP_KERNEL_MARCH=x86-64-v3`, builds for AVX2 hosts on an AVX-512 machine;
`--isa avx2` also caps torch's ATen, MKL and oneDNN at AVX2, as on an AVX2-only host: `hotswap.kernels.emulation`).

The linear ops rotate through more than 64 MB of weight copies, so a call does not find its weight in the core's
caches, as in a decode step over 30 layers. Each figure is the fastest of `--reps` calls after a warm-up, the
native and torch calls taking turns (`measurements.paired_seconds`: on a shared machine load only adds time); the
ratio is native time / torch time (below 1: native wins). Attention is one decode layer call over 64 keys per
sequence in scattered blocks, the paged kernel against the layer's torch path (gather, then SDPA). Also prints
the calibration's choice for each op and batch (`python -m hotswap.kernels --report` prints the whole table).

    python -m benchmarks.native_ops [--reps 30] [--isa native|avx2-kernels|avx2]

Prints human-readable lines and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hotswap.kernels import emulation, native, policy
from hotswap.kernels.ops import NATIVE_ATTENTION
from hotswap.model.layers.attention import Attention, AttentionMetadata

HIDDEN, INTERMEDIATE, QKV, VOCAB = 576, 1536, 960, 16384  # the 125M preset (SmolLM2-135M shape)


def pair_us(native_fn: Callable[[], object], torch_fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(native us, torch us): the fastest of `reps` calls of each, in turn (`policy.paired_seconds`)."""
    native_s, torch_s = policy.paired_seconds(native_fn, torch_fn, reps)
    return native_s * 1e6, torch_s * 1e6


def rotating(make: Callable[[], torch.Tensor], min_bytes: int = 64 << 20) -> Callable[[], torch.Tensor]:
    """Returns a function handing out copies of a tensor in turn, enough of them that they do not stay cached."""
    first = make()
    copies = [first] + [make() for _ in range(max(0, min_bytes // (first.numel() * first.element_size()) - 1))]
    state = {"i": 0}

    def next_copy() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]

    return next_copy


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def measure(ops: object, m: int, reps: int) -> list[tuple[str, int, float, float]]:
    """(op, M, native us, torch us) for a batch of `m` tokens."""
    kernels: Any = ops
    rows = []
    x = torch.randn(m, HIDDEN)
    for label, (n, k) in {"linear qkv": (QKV, HIDDEN), "linear down": (HIDDEN, INTERMEDIATE)}.items():
        weights = rotating(lambda n=n, k=k: torch.randn(n, k))
        xk = torch.randn(m, k)
        rows.append(
            (
                label,
                m,
                *pair_us(
                    lambda xk=xk, w=weights: kernels.small_batch_linear(xk, w(), None),
                    lambda xk=xk, w=weights: F.linear(xk, w()),
                    reps,
                ),
            )
        )
    gate_up = rotating(lambda: torch.randn(2 * INTERMEDIATE, HIDDEN))
    rows.append(
        (
            "gated linear",
            m,
            *pair_us(
                lambda: kernels.small_batch_gated_linear(x, gate_up(), None),
                lambda: kernels.silu_and_mul(F.linear(x, gate_up())),
                reps,
            ),
        )
    )
    w = torch.randn(HIDDEN)
    rows.append(
        ("rms_norm", m, *pair_us(lambda: kernels.rms_norm(x, w, 1e-5), lambda: rms_norm_torch(x, w, 1e-5), reps))
    )
    h = torch.randn(m, 2 * INTERMEDIATE)
    gate, up = h[:, :INTERMEDIATE], h[:, INTERMEDIATE:]
    rows.append(("silu_and_mul", m, *pair_us(lambda: kernels.silu_and_mul(h), lambda: F.silu(gate) * up, reps)))
    logits = torch.randn(m, VOCAB)

    def torch_greedy() -> object:
        best = logits.max(dim=-1)
        return best.indices, best.values - logits.logsumexp(dim=-1)

    rows.append(("greedy_sample", m, *pair_us(lambda: kernels.greedy_sample(logits), torch_greedy, reps)))
    rows.append(("attention", m, *attention_us(kernels, m, reps)))
    return rows


def attention_us(kernels: Any, m: int, reps: int, context: int = 64, block_size: int = 16) -> tuple[float, float]:
    """(native us, torch us) of one decode attention layer call (KV write and attention, 9 heads sharing 3 KV
    heads of 64) for `m` sequences of `context` keys in scattered blocks, the native paged kernel against the
    layer's torch path (the blocks gathered, then SDPA)."""
    per_seq = -(-context // block_size)  # the blocks the engine would give each sequence
    blocks = max(4 * m * per_seq, 1024)  # the sequences' blocks spread over a cache of at least 12 MB
    layer = Attention(9, 3, 64, deterministic=False)
    layer.k_cache, layer.v_cache = torch.randn(blocks, block_size, 3, 64), torch.randn(blocks, block_size, 3, 64)
    order = torch.randperm(blocks).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(m)]
    q, k, v = torch.randn(m, 9, 64), torch.randn(m, 3, 64), torch.randn(m, 3, 64)
    fast = AttentionMetadata.build([1] * m, [context] * m, tables, block_size, NATIVE_ATTENTION)
    slow = AttentionMetadata.build([1] * m, [context] * m, tables, block_size, None)
    with torch.inference_mode():
        return pair_us(lambda: layer(q, k, v, fast), lambda: layer(q, k, v, slow), reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--isa", choices=emulation.ISAS, default="native", help="emulate a narrower host")
    args = parser.parse_args()
    emulation.reexec_under(args.isa)
    ops = native.ops()
    if ops is None:
        raise SystemExit("native kernels unavailable (HOTSWAP_NATIVE_KERNELS=0 or no compiler)")
    build = f"{native.build_name()} (-march={native.MARCH}, {native.vector_bits()}-bit vectors)"
    print(f"build: {build}; torch: {emulation.torch_isa()}, {torch.get_num_threads()} threads")
    figures: dict = {"build": build, "isa": args.isa, "torch_isa": emulation.torch_isa(), "ops": {}}
    chosen = policy.prepare(
        {
            "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": VOCAB,
            "num_hidden_layers": 30,
        }
    )
    op_of = {
        "linear qkv": "linear",
        "linear down": "linear",
        "gated linear": "gated_linear",
        "attention": "paged_attention",
    }
    torch.manual_seed(0)
    rows = [row for m in (4, 16, 64) for row in measure(ops, m, args.reps)]
    print(f"{'op':<14} {'M':>3} {'native us':>10} {'torch us':>10} {'ratio':>6}  calibration's choice")
    for label, m, native_us, torch_us in rows:
        decision = chosen.decisions[op_of.get(label, label)]
        ratio = f" ({decision.ratios[m]:.2f})" if m in decision.ratios else " (rule)"
        choice = f"{'native' if decision.native[m] else 'torch'}{ratio}"
        print(f"{label:<14} {m:>3} {native_us:>10.1f} {torch_us:>10.1f} {native_us / torch_us:>6.2f}  {choice}")
        figures["ops"].setdefault(label, {})[str(m)] = {
            "native_us": round(native_us, 1),
            "torch_us": round(torch_us, 1),
            "ratio": round(native_us / torch_us, 3),
            "chosen": "native" if decision.native[m] else "torch",
        }
    print("(the calibration's own ratios, in brackets, rotate through the model's layers' weights, up to 64 MB)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
