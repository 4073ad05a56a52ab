"""The live-training demo: a spawned trainer improves the engine's policy through verified weight pushes (shm, and
the GPU demo's cuda_ipc handles over shared CPU tensors); its settings and the errors of `--device cuda` here."""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hotswap import LLM
from hotswap.demo import CopyTask, DemoResult, TrainerSettings, _TrainerHandle, add_demo_arguments, run_demo
from hotswap.demo.run import demo_settings
from transfer_helpers import children_started, shm_segments

# A shortened demo: copy one digit, a short warm-up, 60 RL steps. The reward starts at chance (0.1); over seeds 0-5
# the mean of the last 10 steps reaches 0.80-0.96 and greedy copies 89-100% of fresh prompts.
SHORT = {"num_digits": 1, "prompts_per_step": 32, "group_size": 8, "lr": 2e-3, "warmup_steps": 100, "steps": 60}


def _torch_segments(creators: set[int]) -> set[str]:
    """The shared-memory segments torch made for these processes (cuda_ipc's CPU handles: torch_<pid>_...)."""
    return {f for f in os.listdir("/dev/shm") if any(f.startswith(f"torch_{pid}_") for pid in creators)}


@contextlib.contextmanager
def _no_leaks(torch_segments: bool = True) -> Iterator[None]:
    """The block leaves no child process, and no hotswap_* shared memory segment that this process or a child it
    started created (segments of tests running beside this one are theirs to check); with `torch_segments`, none of
    the torch_* segments a child made for shared CPU tensors either."""
    before = shm_segments(creators={os.getpid()})
    with children_started() as children:
        yield
    assert children, "the block started no process: nothing was checked"
    assert shm_segments(creators=children | {os.getpid()}) == before, "hotswap_* shared memory segments left behind"
    if torch_segments:
        assert _torch_segments(children) == set(), "the trainer's torch_* shared memory segments left behind"
    assert multiprocessing.active_children() == [], "child processes left behind"


def test_short_demo_learns_through_verified_pushes(tmp_path, capsys):
    with _no_leaks():
        result = run_demo(out_dir=str(tmp_path), quiet=True, log_every=10, seed=0, **SHORT)

    assert isinstance(result, DemoResult)
    assert result.checksums_ok and result.mismatched == []
    steps = SHORT["steps"]
    assert len(result.rewards) == len(result.update_ms) == len(result.tokens_per_s) == steps
    # v1 is the warm-up push; every RL step pushes once more, and the version is what the engine reports.
    assert result.weight_versions == list(range(2, steps + 2))
    assert all(0.0 <= r <= 1.0 for r in result.rewards)
    # The warm-up teaches the output format only, so RL starts at chance (0.1); the gain comes from the pushes.
    assert result.initial_reward < 0.25
    assert result.final_reward > max(0.6, result.initial_reward + 0.4)
    assert result.improved and result.ok
    assert result.greedy_exact_match > 0.7
    # The trainer recomputes the engine's logprobs of the sampled tokens with the same weights: in deterministic
    # mode (the demo's default), through hotswap.train's forward, bit for bit.
    assert result.max_logprob_gap == 0.0

    assert result.plot_path == str(tmp_path / "reward.png")
    png = (tmp_path / "reward.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["rewards"] == result.rewards and metrics["checksums_ok"] is True

    out = capsys.readouterr().out
    assert "engine: in-process LLM; trainer: separate process" in out and "pushing weights over shm" in out
    assert "checksums ok" in out and "summary: reward" in out and "result: ok" in out
    assert "trainer/engine logprob gap = 0 (bitwise" in out


def test_short_demo_over_cuda_ipc_handles(tmp_path, capsys):
    """What `--device cuda` runs, over shared CPU tensors: each push one flat bucket exported by CudaIpcSender (kept
    alive by the trainer until the engine's update returned), deterministic mode off (the GPU's default: the
    trainer scores with its own forward). The same learning, every push verified by checksum."""
    with _no_leaks():
        result = run_demo(
            out_dir=str(tmp_path), quiet=True, log_every=10, seed=0, transport="cuda_ipc", deterministic=False, **SHORT
        )

    assert (result.device, result.transport, result.deterministic) == ("cpu", "cuda_ipc", False)
    assert result.checksums_ok and result.mismatched == []
    steps = SHORT["steps"]
    assert len(result.rewards) == len(result.update_ms) == steps
    assert result.weight_versions == list(range(2, steps + 2))
    assert result.initial_reward < 0.25
    assert result.final_reward > max(0.6, result.initial_reward + 0.4)
    assert result.improved and result.ok and result.greedy_exact_match > 0.7
    # not bitwise outside deterministic mode, but the same weights: float32 rounding apart
    assert result.max_logprob_gap < 1e-4
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["device"], metrics["transport"]) == ("cpu", "cuda_ipc")

    out = capsys.readouterr().out
    assert "pushing weights over cuda_ipc (shared CPU tensors)" in out
    assert f"{steps + 1} weight pushes over cuda_ipc (shared CPU tensors)" in out and "result: ok" in out


@pytest.mark.cuda
def test_short_demo_on_the_gpu(tmp_path, capsys, device):
    """`--device cuda` (pytest --device cuda on a GPU machine): the engine and the trainer's model and Adam on the
    GPU, each push one flat bucket of CUDA IPC handles, deterministic mode off; the reward rises, every push
    verified by checksum. (torch's CUDA IPC reference-count files are left to torch: not checked here.)"""
    with _no_leaks(torch_segments=False):
        result = run_demo(out_dir=str(tmp_path), quiet=True, log_every=10, seed=0, device=device, **SHORT)

    assert result.device.startswith("cuda") and (result.transport, result.deterministic) == ("cuda_ipc", False)
    assert result.checksums_ok and result.mismatched == []
    assert result.weight_versions == list(range(2, SHORT["steps"] + 2))
    assert result.final_reward > max(0.6, result.initial_reward + 0.4)
    assert result.improved and result.ok and result.max_logprob_gap < 1e-3
    out = capsys.readouterr().out
    assert f"engine: in-process LLM on {result.device}" in out and "pushing weights over CUDA IPC" in out


def test_checksum_mismatch_stops_the_demo_loudly(tmp_path, capsys, monkeypatch):
    """An engine whose weights differ from what the trainer sent (simulated by a wrong digest) fails the run."""
    real = LLM.weight_checksums

    def tampered(self: LLM) -> dict[str, str]:
        sums = real(self)
        sums["model.norm.weight"] = "0" * 64
        return sums

    monkeypatch.setattr(LLM, "weight_checksums", tampered)
    with _no_leaks():
        result = run_demo(out_dir=str(tmp_path), quiet=True, steps=3, warmup_steps=1)
    assert not result.checksums_ok and not result.ok
    assert result.mismatched == ["model.norm.weight"]
    assert result.rewards == []  # stopped at the first push, before any RL step
    assert "CHECKSUM MISMATCH" in capsys.readouterr().err


def test_a_failing_trainer_is_reported_and_reaped():
    """The trainer's traceback reaches the engine side, and closing leaves no process or segment behind."""
    task = CopyTask(digit_ids=tuple(range(3, 13)), sep_id=13, bos_id=0, num_digits=2)
    with _no_leaks():
        handle = _TrainerHandle(
            TrainerSettings("no/such/checkpoint", task, seed=0, lr=1e-3, warmup_steps=1, warmup_lr=1e-3)
        )
        try:
            with pytest.raises(RuntimeError, match="the trainer failed"):
                handle.receive("ready")
        finally:
            handle.close()
    assert handle.process.exitcode == 0  # it reported the error and returned


def test_arguments_and_validation(tmp_path):
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    args = parser.parse_args([])
    assert args.out_dir == "demo_out" and args.steps > 0 and args.group_size >= 2 and not args.quiet
    args = parser.parse_args(["--steps", "5", "--group-size", "4", "--lr", "0.01", "--quiet", "--out-dir", "x"])
    assert (args.steps, args.group_size, args.lr, args.quiet, args.out_dir) == (5, 4, 0.01, True, "x")
    for bad in ({"group_size": 1}, {"steps": 0}, {"num_digits": 0}, {"lr": 0.0}, {"entropy_coef": -1.0}):
        with pytest.raises(ValueError):
            run_demo(out_dir=str(tmp_path / "never"), **bad)
    assert not (tmp_path / "never").exists()  # settings are checked before anything is built or spawned


@pytest.mark.unit
def test_device_transport_and_deterministic_settings():
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    args = parser.parse_args([])
    assert (args.device, args.transport, args.deterministic) == ("cpu", None, None)
    args = parser.parse_args(["--device", "cuda:1", "--transport", "cuda_ipc", "--no-deterministic"])
    assert (args.device, args.transport, args.deterministic) == ("cuda:1", "cuda_ipc", False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--transport", "nccl"])
    # the CPU keeps its defaults (shm, deterministic); cuda_ipc is allowed there (shared CPU tensors)
    assert demo_settings() == ("cpu", "shm", True)
    assert demo_settings("cpu", "cuda_ipc", False) == ("cpu", "cuda_ipc", False)
    with pytest.raises(ValueError, match="transport must be one of"):
        demo_settings("cpu", "nccl")
    # deterministic mode is the CPU's: forcing it on a GPU is refused up front, on any machine
    with pytest.raises(ValueError, match="--deterministic runs on the CPU only"):
        demo_settings("cuda", None, True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_demo_on_cuda_without_a_gpu_fails_at_once(tmp_path):
    """`hotswap demo --device cuda` here: the reason on stderr, exit code 2, no traceback, nothing built."""
    for argv in (["-m", "hotswap", "demo"], ["-m", "hotswap.demo"]):
        out = subprocess.run(
            [sys.executable, *argv, "--device", "cuda", "--out-dir", str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).parents[1],
        )
        assert out.returncode == 2, out.stderr
        assert "error: device='cuda', but" in out.stderr and "CUDA" in out.stderr
        assert "Traceback" not in out.stderr and out.stdout == ""
    assert not (tmp_path / "out").exists()
