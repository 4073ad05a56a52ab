"""hotswap on one GPU: checks, then times, then prints a table last (and one JSON line). Sized for under 6 minutes
on one H200 with only torch, triton, transformers, safetensors and tokenizers installed and the repository on the
path:

    PYTHONPATH=. HOTSWAP_NATIVE_KERNELS=0 python3 -m benchmarks.gpu [--parts facts,kernels,correct,steps,rollout]
        [--shapes 0.5b,1.5b] [--quick]

Parts (each runs even if an earlier one failed; a failure is a row of the table, with its error):
- facts: torch / triton / transformers versions, the GPU, its free memory, `varlen_attn`'s signature.
- kernels: the Triton paged kernels (hotswap/kernels/triton_attention.py) against a float64 reference at real
  shapes: random block permutations, context 1, block edges, a 32k context, GQA 1/4/8, head_dim 64/128, bf16 and
  fp32 caches, decode and extend; each its largest relative error.
- correct: greedy tokens of small llama / qwen2 / qwen3 / qwen3-MoE models against transformers on the same GPU
  (teacher-forced on the engine's tokens): fp32 equal at every step, logprobs within 1e-3; bf16 equal up to each
  sequence's first near-tie of transformers' two best logprobs (< 0.2 apart), logprobs within 0.2.
- steps: the engine's decode step at 1/8/32/128/512 rows of a 1.5B-shaped bf16 model (random weights), eager and
  from CUDA graphs, against the HBM floor (weight bytes / 4.8 TB/s) and the plain-torch reference the issue names
  (the shape's MLP blocks and LM head, eager and as one graph replay); the target: graphs <= 1.5x that replay at
  128 rows.
- rollout: the GRPO-shaped rollout (64 prompts x 16 samples = 1,024 requests, T=1, max_tokens = min_tokens drawn
  long-tailed in 16-1024, prompts of 48-160 random ids) and 128 x 256 fixed, on 0.5B and 1.5B shapes in bf16,
  beside transformers `generate` at 128 x 256 (its best case) in the same run; tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HBM_BYTES_PER_S = 4.8e12  # H200
DEVICE = "cuda"  # --dry-run: "cpu", to check the script itself on a machine without a GPU
SHAPES = {  # Qwen2.5 shapes (random weights)
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "dry": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "tie_word_embeddings": True,
    },  # --dry-run
}
ROWS: list[dict[str, Any]] = []  # the table
# the demo on the GPU, shortened (about a minute)
DEMO_ARGS = ["--steps", "60", "--warmup-steps", "100", "--digits", "1", "--lr", "2e-3", "--log-every", "20"]


def row(part: str, what: str, figure: str, ok: bool | None = None, **extra: Any) -> None:
    ROWS.append({"part": part, "what": what, "figure": figure, "ok": ok, **extra})
    mark = "" if ok is None else (" ok" if ok else " FAIL")
    print(f"[{part}] {what}: {figure}{mark}", flush=True)


def guarded(part: str, fn: Callable[[], None]) -> None:
    start = time.perf_counter()
    try:
        fn()
    except Exception as err:  # a failing part is a row, and the next part still runs
        traceback.print_exc()
        row(part, "error", f"{type(err).__name__}: {str(err)[:200]}", False)
    print(f"[{part}] done in {time.perf_counter() - start:.1f} s", flush=True)


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


# ---- facts ---------------------------------------------------------------------------------------------------


def facts() -> None:
    import inspect

    import transformers
    import triton

    row(
        "facts",
        "versions",
        f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}",
    )
    if DEVICE == "cpu":
        return
    free, total = torch.cuda.mem_get_info()
    row(
        "facts",
        "gpu",
        f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count}"
        f" SMs), {free / 2**30:.1f} of {total / 2**30:.1f} GiB free",
    )
    try:
        from torch.nn.attention.varlen import varlen_attn

        row("facts", "varlen_attn", str(inspect.signature(varlen_attn))[:160])
    except ImportError as err:
        row("facts", "varlen_attn", f"absent ({err})")


# ---- kernels -------------------------------------------------------------------------------------------------


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context: list[int],
    query: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's last query[b] tokens over its context[b] cached keys, in float64."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    block = k_cache.shape[1]
    out, start = [], 0
    for b, (c, n) in enumerate(zip(context, query, strict=True)):
        blocks = tables[b, : math.ceil(c / block)]
        keys = k_cache[blocks].flatten(0, 1)[:c].double().repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache[blocks].flatten(0, 1)[:c].double().repeat_interleave(heads // kv_heads, dim=1)
        qs = q[start : start + n].double()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        pos_q = torch.arange(c - n, c, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(c, device=q.device)[None, :] > pos_q, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).flatten(1))
        start += n
    return torch.cat(out)


def kernel_case(
    name: str, heads: int, kv_heads: int, dim: int, block: int, context: list[int], query: list[int], dtype: torch.dtype
) -> None:
    from hotswap.kernels import triton_attention as ta

    gen = torch.Generator(device=DEVICE).manual_seed(hash(name) % 2**31)
    blocks_each = [math.ceil(c / block) for c in context]
    total_blocks = sum(blocks_each) + 3
    perm = torch.randperm(total_blocks, generator=gen, device=DEVICE)  # random block permutation
    tables = torch.zeros(len(context), max(blocks_each), dtype=torch.long, device=DEVICE)  # as the engine's
    at = 0
    for b, n in enumerate(blocks_each):
        tables[b, :n] = perm[at : at + n]
        at += n
    k_cache = torch.randn(total_blocks, block, kv_heads, dim, generator=gen, device=DEVICE).to(dtype)
    v_cache = torch.randn(total_blocks, block, kv_heads, dim, generator=gen, device=DEVICE).to(dtype)
    q = torch.randn(sum(query), heads, dim, generator=gen, device=DEVICE).to(dtype)
    scale = dim**-0.5
    lens = torch.tensor(context, dtype=torch.long, device=DEVICE)
    qlens = None if all(n == 1 for n in query) else torch.tensor(query, dtype=torch.long, device=DEVICE)
    got = ta.paged_attention(q, k_cache, v_cache, tables, lens, qlens, None, scale)
    want = reference_attention(q, k_cache, v_cache, tables, context, query, scale)
    err = float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-6))
    limit = 1e-4 if dtype == torch.float32 else 2e-2
    row("kernels", name, f"max rel err {err:.1e}", err < limit and bool(torch.isfinite(got).all()))


def kernels(quick: bool) -> None:
    rng = random.Random(0)
    for dtype in (torch.bfloat16, torch.float32):
        tag = "bf16" if dtype == torch.bfloat16 else "fp32"
        for heads, kv_heads in ((8, 8), (16, 4), (32, 4)):  # GQA 1, 4, 8
            for dim in (64, 128):
                kernel_case(
                    f"decode {tag} GQA {heads // kv_heads} d{dim}",
                    heads,
                    kv_heads,
                    dim,
                    16,
                    [1, 15, 16, 17, 31, 32, 33, 700],
                    [1] * 8,
                    dtype,
                )
        kernel_case(f"extend {tag} d128", 16, 2, 128, 16, [5, 64, 129, 300], [5, 17, 1, 64], dtype)
        if not quick:
            kernel_case(f"decode {tag} 32k", 32, 8, 128, 16, [32768, 1, 4097], [1, 1, 1], dtype)
            many = [rng.randint(1, 4096) for _ in range(256)]
            kernel_case(f"decode {tag} 256 rows", 32, 8, 128, 16, many, [1] * 256, dtype)


# ---- correctness against transformers --------------------------------------------------------------------------


def correct(tmp: Path) -> None:
    from transformers import AutoModelForCausalLM

    from hotswap import LLM, SamplingParams
    from hotswap.testing import make_tiny_model

    prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(8 + 5 * i)] for i in range(6)]
    for arch in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        path = make_tiny_model(tmp / f"c-{arch}", arch=arch)  # the tests' tiny preset
        for dtype, limit in ((torch.float32, 1e-3), (torch.bfloat16, 0.2)):
            tag = str(dtype).removeprefix("torch.")
            llm = LLM(str(path), device=DEVICE, dtype=tag, kv_cache_dtype=tag, kv_cache_memory_bytes=1 << 28)
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(DEVICE).eval()
            compared = wrong = 0
            worst = 0.0
            for p, o in zip(prompts, outs, strict=True):
                got = o.outputs[0].token_ids
                with torch.no_grad():
                    logits = hf(torch.tensor([p + got], device=DEVICE)).logits[0, len(p) - 1 : -1].float()
                ref = logits.log_softmax(-1).cpu()
                for step, token in enumerate(got):
                    best = ref[step].topk(2)
                    if dtype != torch.float32 and float(best.values[0] - best.values[1]) < limit:
                        break  # a near-tie in bf16: either token is the argmax, and the rest may rightly differ
                    wrong += int(best.indices[0]) != token
                    worst = max(worst, abs(o.outputs[0].logprobs[step][token].logprob - float(ref[step, token])))
                    compared += 1
            total = 24 * len(prompts)
            ok = wrong == 0 and worst < limit and compared > total // 4  # bf16: random tiny models tie often
            row(
                "correct",
                f"{arch} {tag}",
                f"greedy = transformers at {compared - wrong}/{compared} compared steps "
                f"(of {total}), max |dlogprob| {worst:.1e}",
                ok,
            )
            del llm, hf
            torch.cuda.empty_cache()


# ---- the engine on a GPU-sized model ---------------------------------------------------------------------------


def model_folder(tmp: Path, shape: str) -> Path:
    """config.json and a tokenizer for a Qwen2.5 shape; the engine makes random weights (load_format="dummy")."""
    from transformers import Qwen2Config

    from hotswap.testing import make_tokenizer

    folder = tmp / f"qwen2-{shape}"
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        Qwen2Config(
            **SHAPES[shape], max_position_embeddings=4096, dtype="bfloat16", architectures=["Qwen2ForCausalLM"]
        ).save_pretrained(str(folder))
        make_tokenizer(folder, 4096)
    return folder


def engine(folder: Path, **kwargs: Any) -> Any:
    from hotswap import LLM

    return LLM(str(folder), device=DEVICE, dtype="bfloat16", load_format="dummy", max_model_len=2048, **kwargs)


def weight_bytes(shape: str) -> int:
    s = SHAPES[shape]
    h, i, layers, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    return 2 * (layers * per_layer + v * h)


def decode_step_ms(llm: Any, rows: int) -> float:
    """The engine's decode step at `rows` sequences of 16-token prompts: (a 65-token run - a 1-token run) / 64."""
    from hotswap import SamplingParams

    prompts = [{"prompt_token_ids": [random.randrange(3, 4000) for _ in range(16)]} for _ in range(rows)]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up, captures
    sync()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=65, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - start - prefill) / 64 * 1e3


def reference_stack_ms(shape: str, rows: int, graph: bool) -> float:
    """The plain-torch floor the issue names: the shape's MLP blocks and LM head at `rows` rows, bf16, eager or as
    one CUDA graph replay (median of 20)."""
    s = SHAPES[shape]
    h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    layers = [
        (
            torch.randn(2 * i, h, device=DEVICE, dtype=torch.bfloat16) * 0.02,
            torch.randn(h, i, device=DEVICE, dtype=torch.bfloat16) * 0.02,
        )
        for _ in range(s["num_hidden_layers"])
    ]
    head = torch.randn(v, h, device=DEVICE, dtype=torch.bfloat16) * 0.02
    x = torch.randn(rows, h, device=DEVICE, dtype=torch.bfloat16)

    def forward() -> torch.Tensor:
        y = x
        for gate_up, down in layers:
            g, u = (y @ gate_up.T).chunk(2, dim=-1)
            y = y + (torch.nn.functional.silu(g) * u) @ down.T
        return y @ head.T

    run: Callable[[], Any] = forward
    if graph and DEVICE != "cpu":
        from hotswap.worker.cuda_graphs import cuda_capture

        out = torch.empty(rows, SHAPES[shape]["vocab_size"], device=DEVICE, dtype=torch.bfloat16)

        def captured() -> None:
            out.copy_(forward())

        run = cuda_capture(captured)
    times = []
    for _ in range(23):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times[3:])[10] * 1e3


def steps(tmp: Path, quick: bool, shape: str) -> None:
    folder = model_folder(tmp, shape)
    all_rows = (1, 8) if DEVICE == "cpu" else (1, 8, 32, 128) if quick else (1, 8, 32, 128, 512)
    figures: dict[tuple[bool, int], float] = {}
    for eager in (True, False):
        llm = engine(
            folder, max_num_seqs=512, max_num_batched_tokens=8192, enforce_eager=eager, gpu_memory_utilization=0.4
        )
        for rows in all_rows:
            figures[eager, rows] = decode_step_ms(llm, rows)
        replays = llm.collective_rpc(lambda w: None if w.runner.graphs is None else w.runner.graphs.replays)
        row(
            "steps",
            f"{shape} engine {'eager' if eager else 'graphs'}",
            f"graph replays {replays}",
            None if eager or DEVICE == "cpu" else bool(replays[0]),
        )
        del llm
        torch.cuda.empty_cache()
    floor_ms = weight_bytes(shape) / HBM_BYTES_PER_S * 1e3
    for rows in all_rows:
        eager_ms, graph_ms = figures[True, rows], figures[False, rows]
        ref_eager, ref_graph = reference_stack_ms(shape, rows, False), reference_stack_ms(shape, rows, True)
        target = rows == 128 and DEVICE != "cpu"
        row(
            "steps",
            f"{shape} bf16 decode step, {rows} rows",
            f"eager {eager_ms:.2f} / graphs {graph_ms:.2f} ms; "
            f"torch MLPs+head eager {ref_eager:.2f} / graph {ref_graph:.2f}; floor {floor_ms:.2f}",
            graph_ms <= 1.5 * ref_graph if target else None,
            rows=rows,
            eager_ms=eager_ms,
            graph_ms=graph_ms,
            reference_eager_ms=ref_eager,
            reference_graph_ms=ref_graph,
            floor_ms=floor_ms,
        )
    torch.cuda.empty_cache()


def grpo_requests(prompts: int, samples: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, length) per request: 48-160 random ids, L long-tailed in 16..1024."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        ids = [rng.randrange(3, 4000) for _ in range(rng.randint(48, 160))]
        out += [(ids, min(1024, int(16 / (1 - rng.random()) ** 0.8))) for _ in range(samples)]
    return out


def rollout(tmp: Path, shapes: list[str], quick: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hotswap import SamplingParams

    for shape in shapes:
        folder = model_folder(tmp, shape)
        llm = engine(folder, max_num_seqs=1024, max_num_batched_tokens=16384)
        dry = DEVICE == "cpu"
        workloads = {
            "grpo 64x16": grpo_requests(2 if dry else 16 if quick else 64, 4 if dry else 16),
            "fixed 128x256": [([random.randrange(3, 4000) for _ in range(128)], 16 if dry else 256)]
            * (8 if dry else 128),
        }
        figures: dict[str, float] = {}
        for name, requests in workloads.items():
            prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
            params = [SamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True) for _, n in requests]
            llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
            sync()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            figures[name] = tokens / wall
            row(
                "rollout",
                f"{shape} hotswap {name}",
                f"{tokens / wall:,.0f} tok/s ({tokens:,} tokens, {wall:.1f} s)",
                None,
                tok_s=tokens / wall,
            )
        del llm
        torch.cuda.empty_cache()
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.bfloat16)
        hf = hf.to(DEVICE).eval()
        rows, new = (8, 16) if dry else (128, 256)
        ids = torch.randint(3, 4000, (rows, 128), device=DEVICE)
        with torch.no_grad():
            hf.generate(ids[:8], max_new_tokens=8, min_new_tokens=8, do_sample=True, pad_token_id=0)
            sync()
            start = time.perf_counter()
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                pad_token_id=0,
            )
            sync()
        hf_tok_s = rows * new / (time.perf_counter() - start)
        row("rollout", f"{shape} transformers generate 128x256", f"{hf_tok_s:,.0f} tok/s", None, tok_s=hf_tok_s)
        for name, tok_s in figures.items():
            target = name.startswith("grpo") and shape == "1.5b"
            row(
                "rollout",
                f"{shape} {name} / transformers",
                f"{tok_s / hf_tok_s:.1f}x",
                (tok_s >= 16000 and tok_s / hf_tok_s >= 10) if target else None,
            )
        del hf
        torch.cuda.empty_cache()


# ---- weights onto the GPU: every path, against the copy floors ---------------------------------------------------


def median_ms(fn: Callable[[], Any], reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def checkpoint(tmp: Path, shape: str) -> tuple[Path, list[tuple[str, torch.Tensor]]]:
    """A safetensors checkpoint of the shape (random weights made on the device by transformers), and its tensors
    on the device by checkpoint name (the trainer's)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    source = model_folder(tmp, shape)
    folder = tmp / f"ckpt-{shape}"
    config = AutoConfig.from_pretrained(str(source))
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    named = [
        (n, t.detach())
        for n, t in model.state_dict().items()
        if not (config.tie_word_embeddings and n == "lm_head.weight")
    ]
    if not folder.exists():
        shutil.copytree(source, folder)
        save_file({n: t.contiguous().cpu() for n, t in named}, str(folder / "model.safetensors"))
    return folder, named


def ipc_trainer(folder: str, device: str, commands: Any, replies: Any) -> None:
    """A trainer process: its weights on `device`; on each command ("tensors" | "bucket") the update_info of its
    CUDA IPC handles (kept alive until the next command)."""
    from safetensors.torch import load_file

    from hotswap.transfer.cuda_ipc import CudaIpcSender

    named = [(n, t.to(device)) for n, t in load_file(str(Path(folder) / "model.safetensors")).items()]
    sender = CudaIpcSender()
    while (command := commands.get()) != "stop":
        replies.put(sender.update_info(named, bucket=command == "bucket"))
    sender.release()


def weights(tmp: Path, shape: str) -> None:
    """#49: each way new weights reach the engine on the GPU, timed per full push (median of 3) beside the floors:
    a device-to-device copy of the same bytes, and a pinned host-to-device copy; checksums and what they cost;
    rollback copies on the host and in HBM; sleep and wake."""
    folder, named = checkpoint(tmp, shape)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    d2d, h2d = floors(nbytes)
    expected = pushes(folder, named, d2d, h2d)
    rollback(folder, named, expected)
    sleep_wake(folder, expected)


def floors(nbytes: int) -> tuple[float, float]:
    """ms of a device-to-device copy and of a pinned host-to-device copy of `nbytes`."""
    src, dst = (
        torch.empty(nbytes, dtype=torch.uint8, device=DEVICE),
        torch.empty(nbytes, dtype=torch.uint8, device=DEVICE),
    )
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE != "cpu")
    return median_ms(lambda: dst.copy_(src)), median_ms(lambda: dst.copy_(host, non_blocking=True))


def pushes(folder: Path, named: list[tuple[str, torch.Tensor]], d2d: float, h2d: float) -> dict[str, str]:
    """Every path's full push, timed; returns the trainer's checksums."""
    import multiprocessing as mp
    import threading

    from hotswap import LLM
    from hotswap.testing import free_port
    from hotswap.transfer.shm import ShmSender
    from hotswap.transfer.torch_dist import TorchDistSender
    from hotswap.weights.checksum import tensor_sha256

    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    row(
        "weights",
        f"{folder.name}: {len(named)} tensors, {nbytes / 1e9:.2f} GB",
        f"floors: device copy {d2d:.2f} ms "
        f"({nbytes / d2d / 1e6:.0f} GB/s), pinned host->device {h2d:.1f} ms ({nbytes / h2d / 1e6:.0f} GB/s)",
        None,
        d2d_ms=d2d,
        h2d_ms=h2d,
    )
    llm = LLM(str(folder), device=DEVICE, dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.25)
    expected = {n: tensor_sha256(t) for n, t in named}

    def push_row(what: str, ms: float, floor: float) -> None:
        row("weights", what, f"{ms:.1f} ms ({ms / floor:.1f}x the floor)", None, ms=ms)

    push_row(
        "in-process reload_weights(iterator on the device)",
        median_ms(lambda: llm.reload_weights(weights_iterator=named)),
        d2d,
    )
    ms = median_ms(lambda: llm.weight_checksums(), 1)
    row(
        "weights",
        "checksums after a push (SHA-256 over a device->host copy)",
        f"{ms:.0f} ms; equal to the trainer's",
        llm.weight_checksums() == expected,
        ms=ms,
    )
    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(target=ipc_trainer, args=(str(folder), DEVICE, commands, replies), daemon=True)
    trainer.start()
    try:
        llm.init_weight_transfer_engine({"backend": "cuda_ipc"})
        for form in ("tensors", "bucket"):

            def push(form: str = form) -> None:
                commands.put(form)
                info = replies.get(timeout=120)
                llm.start_weight_update()
                llm.update_weights(info)
                llm.finish_weight_update()

            push()  # the first open pays the CUDA context and the handle cache
            push_row(
                f"cuda_ipc from a trainer process ({'one flat bucket' if form == 'bucket' else 'per tensor'})",
                median_ms(push),
                d2d,
            )
        llm.shutdown_weight_transfer_engine()
    finally:
        commands.put("stop")
        trainer.join(30)
    on_host = [(n, t.cpu()) for n, t in named]
    sender = ShmSender()
    llm.init_weight_transfer_engine({"backend": "shm"})

    def shm_push() -> None:
        llm.start_weight_update()
        llm.update_weights(sender.write(on_host))
        llm.finish_weight_update()

    push_row("shm (host) through pinned double buffers", median_ms(shm_push), h2d)
    llm.shutdown_weight_transfer_engine()
    sender.close()
    port = free_port()
    box: dict[str, Any] = {}
    joining = threading.Thread(
        target=lambda: box.setdefault("s", TorchDistSender("127.0.0.1", port, device=DEVICE, dist_backend="gloo"))
    )
    joining.start()
    llm.init_weight_transfer_engine(
        {"backend": "torch_dist", "master_address": "127.0.0.1", "master_port": port, "dist_backend": "gloo"}
    )
    joining.join()
    dist = box["s"]

    def dist_push() -> None:
        llm.start_weight_update()
        info = dist.update_info(named)
        sending = threading.Thread(target=dist.send, args=(named,))
        sending.start()
        llm.update_weights(info)
        sending.join()
        llm.finish_weight_update()

    push_row("torch_dist over gloo, device buckets (NCCL needs 2 GPUs)", median_ms(dist_push), d2d)
    llm.shutdown_weight_transfer_engine()
    dist.close()
    push_row(
        "reload from the checkpoint folder (page cache -> pinned -> device)",
        median_ms(lambda: llm.reload_weights(weights_path=str(folder))),
        h2d,
    )
    row("weights", "after every path", "checksums equal to the trainer's", llm.weight_checksums() == expected)
    return expected


def rollback(folder: Path, named: list[tuple[str, torch.Tensor]], expected: dict[str, str]) -> None:
    """A session that fails on its last tensor (a NaN) after writing the others, with its rollback copies in
    page-locked host memory and in HBM: the rollback's time and its result (bit-identical)."""
    from hotswap import LLM
    from hotswap.transfer.tensors import tensors_update_info

    for where in ("cpu", "device"):
        llm = LLM(
            str(folder),
            device=DEVICE,
            dtype="bfloat16",
            max_model_len=2048,
            gpu_memory_utilization=0.25,
            backup_device=where,
        )
        bad = named[-1][1].clone()
        bad.view(-1)[0] = float("nan")
        llm.init_weight_transfer_engine({"backend": "tensors"})
        llm.start_weight_update()
        llm.update_weights(tensors_update_info(named[:-1]))  # written, with rollback copies
        sync()
        start = time.perf_counter()
        try:
            llm.update_weights(tensors_update_info([(named[-1][0], bad)]))
        except ValueError:
            pass
        sync()
        ms = (time.perf_counter() - start) * 1e3
        row(
            "weights",
            f"rollback of a failed session, copies {'on the host (pinned)' if where == 'cpu' else 'in HBM'}",
            f"{ms:.1f} ms",
            llm.weight_checksums() == expected,
            ms=ms,
        )


def sleep_wake(folder: Path, expected: dict[str, str]) -> None:
    """Level 1 (weights to page-locked host memory, KV freed) and wake_up, the decode step before and after (the
    graphs captured again); level 2 then a reload."""
    from hotswap import LLM

    llm = LLM(str(folder), device=DEVICE, dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.25)
    before = decode_step_ms(llm, 8)
    free = torch.cuda.mem_get_info()[0] if DEVICE != "cpu" else 0
    sleep_ms = median_ms(lambda: llm.sleep(1), 1)
    released = (torch.cuda.mem_get_info()[0] - free) / 1e9 if DEVICE != "cpu" else 0.0
    wake_ms = median_ms(lambda: llm.wake_up(), 1)
    after = decode_step_ms(llm, 8)
    row(
        "weights",
        "sleep(1) / wake_up()",
        f"{sleep_ms:.0f} / {wake_ms:.0f} ms, {released:.1f} GB freed; decode step {before:.2f} -> {after:.2f} ms",
        llm.weight_checksums() == expected,
        sleep_ms=sleep_ms,
        wake_ms=wake_ms,
    )
    llm.sleep(2)
    llm.wake_up()
    ms = median_ms(lambda: llm.reload_weights(weights_path=str(folder)), 1)
    row(
        "weights",
        "sleep(2), wake_up(), reload from the folder",
        f"reload {ms:.0f} ms",
        llm.weight_checksums() == expected,
    )


def staged(tmp: Path, shape: str) -> None:
    """#50 on the GPU: the pause a full reload from disk puts into 8 running streams, staged (the commit a device
    copy) and in place (pause keep, reload, resume), from benchmarks/staged_updates.py's measure."""
    import asyncio

    from benchmarks.staged_updates import trial
    from hotswap.engine.async_llm_engine import AsyncLLMEngine

    folder, _ = checkpoint(tmp, shape)

    async def run() -> None:
        for mode in ("in_place", "shadow"):
            engine = AsyncLLMEngine.from_kwargs(
                str(folder),
                device=DEVICE,
                dtype="bfloat16",
                max_model_len=2048,
                gpu_memory_utilization=0.25,
                update_staging=mode,
            )
            figures = [await trial(engine, mode, {"weights_path": str(folder)}, 8, seed) for seed in range(3)]
            await engine.shutdown()
            med = {k: sorted(f[k] for f in figures)[1] for k in figures[0]}
            row(
                "staged",
                f"{shape} full reload, 8 streams, {mode}",
                f"pause {med['pause_ms']:.1f} ms (commit gap "
                f"{med['commit_gap_ms']:.1f}), wall {med['wall_ms']:.0f} ms, {med['tok_s_during']:.0f} tok/s during "
                f"/ {med['tok_s_before']:.0f} before",
                (med["pause_ms"] <= 10) if mode == "shadow" else None,
                **med,
            )
            torch.cuda.empty_cache() if DEVICE != "cpu" else None

    asyncio.run(run())


# ---- the test suite's device tests ----------------------------------------------------------------------------

DEVICE_TESTS = [
    "tests/test_device.py",
    "tests/test_correctness.py",
    "tests/test_sampling.py",
    "tests/test_weight_update.py",
    "tests/test_weight_writes.py",
    "tests/test_cuda_ipc.py",
    "tests/test_host_staging.py",
    "tests/test_offload.py",
    "tests/test_triton_attention.py",
    "tests/test_triton_engine.py",
    "tests/test_chunked_prefill.py",
    "tests/test_delta.py",
    "tests/test_bad_updates.py",
    "tests/test_moe.py",
    "tests/test_staged_updates.py",
    "tests/test_kv_policy.py",
    "tests/test_teacher_scoring.py",
]


def suite(timeout_s: int = 360) -> None:
    """The tests that take `--device` (and the `cuda`-marked ones) on this GPU, in a child pytest; one row per
    outcome count, and the names of failures."""
    import os
    import subprocess
    import sys

    device = "cpu" if DEVICE == "cpu" else "cuda"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-o",
        "timeout=0",
        f"--device={device}",
        "-rfE",
        *DEVICE_TESTS,
    ]
    if DEVICE == "cpu":
        command[-len(DEVICE_TESTS) :] = ["tests/test_device.py"]  # --dry-run: the script's own plumbing
    env = {**os.environ, "PYTHONPATH": "."}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as err:
        row("suite", "pytest --device", f"timed out after {timeout_s} s: {str(err.stdout)[-300:]}", False)
        return
    tail = [line for line in done.stdout.splitlines() if line.strip()][-12:]
    print("\n".join(tail), flush=True)
    summary = tail[-1] if tail else done.stderr[-300:]
    row("suite", f"pytest --device {device} ({len(DEVICE_TESTS)} files)", summary[:200], done.returncode == 0)
    for line in tail:
        if line.startswith(("FAILED", "ERROR")):
            row("suite", "failed", line[:200], False)


def demo(tmp: Path, timeout_s: int = 300) -> None:
    """The live-RL demo on the GPU: the trainer in its own process pushing over CUDA IPC every step, checksums
    verified, the reward rising (`python -m hotswap demo --device cuda`, shortened)."""
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "hotswap",
        "demo",
        "--device",
        DEVICE,
        "--out-dir",
        str(tmp / "demo"),
        "--quiet",
        *DEMO_ARGS,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        row("demo", "hotswap demo --device", f"timed out after {timeout_s} s", False)
        return
    tail = [line for line in done.stdout.splitlines() if line.strip()][-6:]
    print("\n".join(tail), flush=True)
    row(
        "demo",
        f"hotswap demo --device {DEVICE}",
        (tail[-1] if tail else done.stderr[-200:])[:200],
        done.returncode == 0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="facts,kernels,correct,steps,rollout,weights,staged,suite,demo")
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--quick", action="store_true", help="smaller kernel cases and rollouts")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the script itself on the CPU, with a tiny shape and "
        "the kernels under TRITON_INTERPRET=1 (set it in the environment)",
    )
    args = parser.parse_args()
    global DEVICE
    shapes = args.shapes.split(",")
    if args.dry_run:
        DEVICE, shapes, args.quick = "cpu", ["dry"], True
    elif not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks.gpu needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run checks "
            "the script on the CPU"
        )
    parts = args.parts.split(",")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        work: dict[str, Callable[[], None]] = {
            "facts": facts,
            "kernels": lambda: kernels(args.quick),
            "correct": lambda: correct(tmp),
            "steps": lambda: steps(tmp, args.quick, shapes[-1]),
            "rollout": lambda: rollout(tmp, shapes, args.quick),
            "weights": lambda: weights(tmp, shapes[-1]),
            "staged": lambda: staged(tmp, shapes[-1]),
            "suite": suite,
            "demo": lambda: demo(tmp),
        }
        for part in parts:
            guarded(part, work[part])
    print(f"\n{'part':8} {'what':44} {'figure':70} ok")
    for r in ROWS:
        print(f"{r['part']:8} {r['what'][:44]:44} {r['figure'][:70]:70} {'' if r['ok'] is None else r['ok']}")
    failed = [r for r in ROWS if r["ok"] is False]
    print(f"{len(failed)} failed; {time.perf_counter() - started:.0f} s")
    print(json.dumps({"rows": ROWS, "failed": len(failed)}))


if __name__ == "__main__":
    main()
