"""The engine side of the demo: sampling rollouts, applying and verifying every push, the report and plot; and
the command line."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from tqdm.auto import tqdm

from hotswap.demo.result import DemoResult
from hotswap.demo.task import CHANCE_REWARD, CopyTask
from hotswap.demo.trainer import RolloutBatch, TrainerSettings, _TrainerHandle
from hotswap.entrypoints.llm import LLM
from hotswap.sampling_params import SamplingParams
from hotswap.testing import make_tiny_model

if TYPE_CHECKING:
    from hotswap.outputs import SampleLogprobs


def _build_checkpoint(model_dir: Path, seed: int) -> tuple[Path, int]:
    """A random-weight 'tiny' llama checkpoint (vocab 512, 2 layers, hidden 64) with tied embeddings, so that copying
    a token mostly means attending to the right position. `make_tiny_model` scales the final norm so random logits
    are sharply peaked (what exact greedy comparisons in tests want); here it is reset to 1, so the random policy
    starts broad, as a freshly initialized language model does. Returns (folder, number of parameters)."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(model_dir, arch="llama", preset="tiny", seed=seed, tie_word_embeddings=True)
    weights_file = str(path / "model.safetensors")
    tensors = load_file(weights_file)
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"])
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return path, sum(t.numel() for t in tensors.values())


def _sample(
    llm: LLM, task: CopyTask, rng: random.Random, prompts: int, group_size: int
) -> tuple[RolloutBatch, list[Any], float]:
    """Samples `group_size` completions for each of `prompts` fresh prompts from the engine at temperature 1 (the
    distribution whose logprobs the engine reports, so the rollouts are on-policy) and scores them. Returns the
    batch, the engine's outputs and the rollout throughput in tokens/s."""
    digits = [task.sample(rng) for _ in range(prompts)]
    prompt_ids = [task.prompt_ids(d) for d in digits]
    params = [
        SamplingParams(
            n=group_size,
            temperature=1.0,
            max_tokens=task.num_digits,
            ignore_eos=True,
            logprobs=0,
            seed=rng.randrange(1 << 31),
        )
        for _ in digits
    ]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    batch = RolloutBatch(prompt_ids, [], [], [])
    for d, out in zip(digits, outputs, strict=True):
        batch.completions.append([list(c.token_ids) for c in out.outputs])
        batch.rewards.append([task.reward(d, c.token_ids) for c in out.outputs])
        batch.engine_logprobs.append(  # the logprobs were requested (logprobs=0): never None here
            [
                [step[t].logprob for step, t in zip(cast("SampleLogprobs", c.logprobs), c.token_ids, strict=True)]
                for c in out.outputs
            ]
        )
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return batch, outputs, tokens / max(elapsed, 1e-9)


def _mean_reward(batch: RolloutBatch) -> float:
    return statistics.fmean(r for group in batch.rewards for r in group)


def _apply_push(llm: LLM, info: dict[str, Any], trainer_sums: dict[str, str]) -> tuple[float, list[str]]:
    """Applies one pushed update (shm or cuda_ipc) as a complete session and compares checksums. Returns (update
    ms, mismatched)."""
    start = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights(info)
    llm.finish_weight_update()
    update_ms = (time.perf_counter() - start) * 1e3
    engine_sums = llm.weight_checksums()
    return update_ms, sorted(name for name, digest in trainer_sums.items() if engine_sums.get(name) != digest)


def _check_versions(outputs: list[Any], version: int) -> None:
    """Every rollout token must come from the weights the last push installed."""
    for out in outputs:
        for c in out.outputs:
            if any(span.version != version for span in c.weight_versions):
                raise RuntimeError(f"a rollout was sampled with weights {c.weight_versions}, expected v{version}")


def _plot(result: DemoResult, path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    steps = list(range(len(result.rewards)))
    k = max(1, result.window)
    smooth = [statistics.fmean(result.rewards[max(0, i - k + 1) : i + 1]) for i in steps]
    fig = Figure(figsize=(7.5, 4.2), dpi=120)
    ax = fig.add_subplot()
    ax.plot(steps, result.rewards, lw=1, alpha=0.45, label="mean reward of the step's rollouts")
    ax.plot(steps, smooth, lw=2.2, label=f"moving average ({k} steps)")
    ax.axhline(CHANCE_REWARD, color="gray", ls="--", lw=1, label="chance (random digits)")
    ax.axhline(1.0, color="black", ls=":", lw=1, label="maximum")
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel("RL step (one weight push into the running engine per step)")
    ax.set_ylabel("reward")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


TRANSPORTS = ("shm", "cuda_ipc")


def demo_settings(
    device: str = "cpu", transport: str | None = None, deterministic: bool | None = None
) -> tuple[str, str, bool]:
    """(device, transport, deterministic) resolved and checked before anything is built: the device normalised
    ("cpu" or "cuda:N"), the transport defaulting to shm on the CPU and cuda_ipc on a GPU, deterministic mode to on
    on the CPU and off on a GPU (it runs on the CPU only for now). Raises ValueError with the reason (a forced
    `deterministic` on a GPU; CUDA where this torch has none or no GPU is visible: `hotswap.device.parse_device`)."""
    from hotswap.device import parse_device

    if transport is not None and transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {transport!r}")
    on_gpu = isinstance(device, str) and device.strip().startswith("cuda")
    if on_gpu and deterministic:
        raise ValueError(
            f"--deterministic runs on the CPU only for now (device {device!r}: the engine's batch-"
            "invariant kernels, equal to the trainer's forward bit for bit, are CPU kernels); on a GPU "
            "leave it off (--no-deterministic, the default there), or use --device cpu"
        )
    device = parse_device(device)
    gpu = device != "cpu"
    return device, transport or ("cuda_ipc" if gpu else "shm"), (not gpu) if deterministic is None else deterministic


def _transport_label(transport: str, device: str) -> str:
    if transport == "shm":
        return "shm"
    return "CUDA IPC" if device != "cpu" else "cuda_ipc (shared CPU tensors)"


def run_demo(
    out_dir: str = "demo_out",
    steps: int = 250,
    *,
    seed: int = 0,
    num_digits: int = 3,
    prompts_per_step: int = 32,
    group_size: int = 8,
    lr: float = 1e-3,
    warmup_steps: int = 200,
    warmup_lr: float = 3e-3,
    entropy_coef: float = 0.02,
    log_every: int = 25,
    quiet: bool = False,
    deterministic: bool | None = None,
    device: str = "cpu",
    transport: str | None = None,
) -> DemoResult:
    """Runs the live-training demo and returns what it measured; writes the checkpoint (`out_dir/model`), the
    reward plot (`out_dir/reward.png`) and the metrics (`out_dir/metrics.json`).

    Each of `steps` RL steps samples `group_size` completions for each of `prompts_per_step` fresh prompts from the
    engine, sends them to the trainer process for one GRPO step (Adam, `lr`), applies the trainer's push and
    verifies it by checksum; a supervised format warm-up (`warmup_steps` at `warmup_lr`) is pushed first. Progress
    goes to stdout (a line every `log_every` steps, a tqdm bar unless `quiet`). Raises ValueError for invalid
    settings and RuntimeError if the trainer fails; a checksum mismatch stops the run with `checksums_ok` False.
    The trainer process and its shared memory are gone when this returns or raises.

    `device` ("cpu", "cuda", "cuda:N") is the engine's and the trainer's (its model and optimizer on the same GPU,
    in its own process); `transport` "shm" (the CPU's default) or "cuda_ipc" (a GPU's: one flat bucket of CUDA IPC
    handles per push; on the CPU, shared CPU tensors); `deterministic` None is on for the CPU, off on a GPU
    (`demo_settings`)."""
    if steps < 1 or prompts_per_step < 1 or warmup_steps < 0 or log_every < 1:
        raise ValueError("steps, prompts_per_step and log_every must be >= 1, warmup_steps >= 0")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 (advantages are normalized within a group), got {group_size}")
    if not 1 <= num_digits <= 16:
        raise ValueError(f"num_digits must be between 1 and 16, got {num_digits}")
    if not (lr > 0 and warmup_lr > 0 and entropy_coef >= 0):
        raise ValueError("lr and warmup_lr must be positive, entropy_coef non-negative")
    device, transport, deterministic = demo_settings(device, transport, deterministic)

    def say(line: str) -> None:
        tqdm.write(line, file=sys.stdout)

    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = DemoResult(deterministic=deterministic, device=device, transport=transport)
    say("hotswap demo: live RL training; a trainer process pushes new weights into the running engine every step")
    model_dir, result.num_params = _build_checkpoint(out / "model", seed)
    say(f"model: random-weight llama ('tiny' preset), {result.num_params / 1e3:.0f}k parameters, fp32, at {model_dir}")

    llm = LLM(
        str(model_dir),
        max_model_len=64,
        kv_cache_memory_bytes=32 << 20,
        seed=seed,
        deterministic=deterministic,
        device=device,
    )
    task = CopyTask.from_tokenizer(llm.get_tokenizer(), num_digits)
    engine_dtype = str(llm.config.model_config.torch_dtype).removeprefix("torch.")
    settings = TrainerSettings(
        str(model_dir),
        task,
        seed,
        lr,
        warmup_steps,
        warmup_lr,
        entropy_coef=entropy_coef,
        deterministic=deterministic,
        device=device,
        transport=transport,
        engine_dtype=engine_dtype,
    )
    trainer = _TrainerHandle(settings)  # its start-up (imports, model load) overlaps the engine's work below
    rng = random.Random(seed)
    bar = None
    try:
        llm.init_weight_transfer_engine({"backend": transport})
        where = "" if device == "cpu" else f" on {device}"
        say(
            f"engine: in-process LLM{where}; trainer: separate process (pid {trainer.process.pid}){where}, pushing "
            f"weights over {_transport_label(transport, device)}"
        )
        example = task.sample(random.Random(seed + 2))
        batch, _, _ = _sample(llm, task, rng, prompts_per_step, group_size)
        result.random_init_reward = _mean_reward(batch)
        say(
            f"task: copy the {num_digits} digit{'s' if num_digits > 1 else ''} of the prompt, e.g. "
            f"'{task.render(task.prompt_ids(example))}' -> '{task.render([task.digit_ids[d] for d in example])}'; "
            f"reward = fraction of digits right "
            f"(max 1.00, chance {CHANCE_REWARD:.2f}, random init {result.random_init_reward:.2f})"
        )
        trainer.receive("ready")

        trainer.requests.put(("warmup",))
        info, sums, stats = trainer.receive("pushed")
        update_ms, bad = _apply_push(llm, info, sums)
        if bad:
            result.checksums_ok, result.mismatched = False, bad
        else:
            say(
                f"warm-up: {warmup_steps} supervised step{'s' if warmup_steps != 1 else ''} on random digits (the "
                f"output format, not the task) in {stats['train_ms'] / 1e3:.1f} s -> pushed as "
                f"v{llm.get_weight_version()} in {update_ms:.1f} ms; "
                f"checksums match ({len(sums)} tensors)"
            )
            say(f"RL: {steps} GRPO steps x {prompts_per_step} prompts x {group_size} samples, Adam lr {lr:g}")
        bar = tqdm(  # disable=None: no bar when stdout is not a terminal
            total=steps, desc="GRPO", unit="step", disable=True if quiet else None, dynamic_ncols=True, file=sys.stdout
        )
        for step in range(steps if result.checksums_ok else 0):
            version = llm.get_weight_version()
            batch, outputs, tokens_per_s = _sample(llm, task, rng, prompts_per_step, group_size)
            _check_versions(outputs, version)
            trainer.requests.put(("train", batch, llm.get_weight_version()))  # the base of its next delta
            info, sums, stats = trainer.receive("pushed")
            update_ms, bad = _apply_push(llm, info, sums)
            reward = _mean_reward(batch)
            result.rewards.append(reward)
            result.weight_versions.append(llm.get_weight_version())
            result.update_ms.append(update_ms)
            result.tokens_per_s.append(tokens_per_s)
            result.train_ms.append(stats["train_ms"])
            result.push_mb.append(stats["push_bytes"] / 1e6)
            result.full_mb = stats["full_bytes"] / 1e6
            result.max_logprob_gap = max(result.max_logprob_gap, stats["logprob_gap"])
            if bad:
                result.checksums_ok, result.mismatched = False, bad
                break
            bar.set_postfix_str(
                f"reward {reward:.2f} | v{llm.get_weight_version()} | update {update_ms:.1f} ms | "
                f"{tokens_per_s:,.0f} tok/s",
                refresh=False,
            )
            bar.update(1)
            if step % log_every == 0 or step == steps - 1:
                say(
                    f"step {step + 1:4d}/{steps}  reward {reward:.2f}  sampled on v{version} -> pushed "
                    f"v{llm.get_weight_version()}  update {update_ms:5.1f} ms  rollouts {tokens_per_s:7,.0f} tok/s  "
                    f"trainer {stats['train_ms']:5.1f} ms  checksums ok"
                )
        bar.close()
        if not result.checksums_ok:
            print(
                f"CHECKSUM MISMATCH after the push that made v{llm.get_weight_version()}: the engine's weights differ "
                f"from the trainer's for {', '.join(result.mismatched)}",
                file=sys.stderr,
            )
        else:
            result.greedy_exact_match = _greedy_exact_match(llm, task, random.Random(seed + 3), 256)
            for digits in [task.sample(rng) for _ in range(3)]:
                ids = task.prompt_ids(digits)
                got = llm.generate({"prompt_token_ids": ids}, _greedy(task), use_tqdm=False)[0].outputs[0].token_ids
                mark = "right" if task.reward(digits, got) == 1.0 else "wrong"
                say(f"  greedy: {task.render(ids)} {task.render(list(got))}  ({mark})")
    finally:
        if bar is not None:
            bar.close()
        try:
            llm.shutdown_weight_transfer_engine()  # let go of the trainer's memory before it frees it
        finally:
            trainer.close()
    result.total_s = time.perf_counter() - start
    _report(result, out, steps, say)
    return result


def _greedy(task: CopyTask) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=task.num_digits, ignore_eos=True)


def _greedy_exact_match(llm: LLM, task: CopyTask, rng: random.Random, count: int) -> float:
    """Fraction of `count` fresh prompts whose greedy completion copies every digit."""
    digits = [task.sample(rng) for _ in range(count)]
    outputs = llm.generate([{"prompt_token_ids": task.prompt_ids(d)} for d in digits], _greedy(task), use_tqdm=False)
    return statistics.fmean(
        float(task.reward(d, o.outputs[0].token_ids) == 1.0) for d, o in zip(digits, outputs, strict=True)
    )


def _report(result: DemoResult, out: Path, steps: int, say: Callable[[str], None]) -> None:
    """Prints the summary, writes metrics.json and the plot (`result.plot_path` stays None without matplotlib)."""
    if result.rewards:
        title = (
            f"hotswap demo: reward {result.initial_reward:.2f} -> {result.final_reward:.2f} in {len(result.rewards)} "
            f"steps, {result.total_s:.0f} s (every step a live weight push)"
        )
        try:
            _plot(result, out / "reward.png", title)
            result.plot_path = str(out / "reward.png")
        except ImportError:
            say("matplotlib is not installed: no plot (pip install matplotlib)")
    metrics = {**asdict(result), "initial_reward": result.initial_reward, "final_reward": result.final_reward}
    metrics = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in metrics.items()}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    if not result.rewards:
        return
    pushes = len(result.weight_versions) + 1
    say(
        f"summary: reward {result.initial_reward:.2f} -> {result.final_reward:.2f} (mean of the first / last "
        f"{result.window} steps; random init {result.random_init_reward:.2f}, chance {CHANCE_REWARD:.2f}, max 1.00) "
        f"in {len(result.rewards)}/{steps} steps, {result.total_s:.1f} s total"
    )
    if result.checksums_ok:
        say(
            f"  {pushes} weight pushes over {_transport_label(result.transport, result.device)} "
            f"(v1 -> v{result.weight_versions[-1]}), each verified: engine SHA-256 "
            f"== trainer SHA-256 for every tensor; {_gap_line(result.max_logprob_gap, result.deterministic)}"
        )
        say(
            f"  update (engine start -> finish) median {statistics.median(result.update_ms):.1f} ms; rollouts median "
            f"{statistics.median(result.tokens_per_s):,.0f} tok/s; trainer step median "
            f"{statistics.median(result.train_ms):.0f} ms"
        )
        say(
            f"  pushes as sparse deltas against the committed version: median {statistics.median(result.push_mb):.2f}"
            f" MB of a full {result.full_mb:.2f} MB ({statistics.median(result.push_mb) / result.full_mb:.0%}; Adam "
            "moves nearly every element each step, so most tensors travel whole)"
        )
        say(f"  greedy on 256 new prompts: {result.greedy_exact_match:.1%} copied exactly")
    if result.plot_path:
        say(f"  plot: {result.plot_path}")
    verdict = "ok" if result.ok else ("FAILED: checksums differ" if not result.checksums_ok else "FAILED: no gain")
    say(f"result: {verdict}")


# ---- command line ---------------------------------------------------------------------------------------------


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's flags (the defaults are the full demo: under a minute on two CPU cores)."""
    parser.add_argument("--out-dir", default="demo_out", help="checkpoint, reward.png and metrics.json go here")
    parser.add_argument("--steps", type=int, default=250, help="RL steps, one weight push each (default 250)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", type=int, default=3, help="digits to copy per prompt (default 3)")
    parser.add_argument("--prompts-per-step", type=int, default=32, help="prompts sampled per step (default 32)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt, the GRPO group (default 8)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of the RL steps (default 1e-3)")
    parser.add_argument("--warmup-steps", type=int, default=200, help="supervised format warm-up steps (default 200)")
    parser.add_argument("--warmup-lr", type=float, default=3e-3, help="Adam learning rate of the warm-up")
    parser.add_argument("--entropy-coef", type=float, default=0.02, help="entropy bonus in the RL loss (default 0.02)")
    parser.add_argument("--log-every", type=int, default=25, help="print a line every N steps (default 25)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="engine in deterministic mode, trainer scoring through hotswap.train (default: on for "
        "the CPU; off on a GPU, where it is not supported yet)",
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu (default), cuda or cuda:N: the engine's and the trainer's device"
    )
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=None,
        help="how the trainer pushes: shm (the CPU's default) or cuda_ipc (a GPU's default: CUDA IPC "
        "handles of one flat bucket; on the CPU, shared CPU tensors)",
    )


def _gap_line(gap: float, deterministic: bool) -> str:
    """The trainer/engine logprob gap as the summary states it."""
    if deterministic and gap == 0.0:
        return "trainer/engine logprob gap = 0 (bitwise: deterministic mode and hotswap.train.token_logprobs)"
    return f"trainer/engine logprob gap <= {gap:.1e}"


def run_demo_from_args(args: argparse.Namespace) -> int:
    """Runs the demo with parsed flags. Returns 0 if every push was verified and the reward improved by at least
    MIN_GAIN, 1 otherwise."""
    result = run_demo(
        out_dir=args.out_dir,
        steps=args.steps,
        seed=args.seed,
        num_digits=args.digits,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        warmup_lr=args.warmup_lr,
        entropy_coef=args.entropy_coef,
        log_every=args.log_every,
        quiet=args.quiet,
        deterministic=args.deterministic,
        device=args.device,
        transport=args.transport,
    )
    return 0 if result.ok else 1
