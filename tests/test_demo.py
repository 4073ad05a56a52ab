"""The live-training demo: a spawned trainer improves the engine's policy through verified shm weight pushes."""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
from collections.abc import Iterator

import pytest

from hotswap import LLM
from hotswap.demo import CopyTask, DemoResult, TrainerSettings, _TrainerHandle, add_demo_arguments, run_demo
from transfer_helpers import children_started, shm_segments

# A shortened demo: copy one digit, a short warm-up, 60 RL steps. The reward starts at chance (0.1); over seeds 0-5
# the mean of the last 10 steps reaches 0.80-0.96 and greedy copies 89-100% of fresh prompts.
SHORT = {"num_digits": 1, "prompts_per_step": 32, "group_size": 8, "lr": 2e-3, "warmup_steps": 100, "steps": 60}


@contextlib.contextmanager
def _no_leaks() -> Iterator[None]:
    """The block leaves no child process, and no hotswap_* shared memory segment that this process or a child it
    started created (segments of tests running beside this one are theirs to check)."""
    before = shm_segments(creators={os.getpid()})
    with children_started() as children:
        yield
    assert children, "the block started no process: nothing was checked"
    assert shm_segments(creators=children | {os.getpid()}) == before, "hotswap_* shared memory segments left behind"
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
