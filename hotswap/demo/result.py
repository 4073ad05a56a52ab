"""What one demo run measured, and whether it passed."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

MIN_GAIN = 0.2  # `DemoResult.improved`: the final reward must beat the initial one by at least this much


@dataclass
class DemoResult:
    """What one demo run measured. Per RL step t (0-based): `rewards[t]` is the mean reward of the rollouts the
    engine sampled at that step, `weight_versions[t]` the engine's weight version after that step's push,
    `update_ms[t]` the engine-side time from start_weight_update to finish_weight_update, `tokens_per_s[t]` the
    rollout throughput and `train_ms[t]` the trainer's optimizer step. `checksums_ok` is True only if after every
    push the engine's SHA-256 equalled the trainer's for every tensor sent; the run stops at the first mismatch,
    naming the tensors in `mismatched`."""

    rewards: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    update_ms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    train_ms: list[float] = field(default_factory=list)
    push_mb: list[float] = field(default_factory=list)  # bytes each RL push sent (a sparse delta), MB
    full_mb: float = 0.0  # what a full push sends, MB
    checksums_ok: bool = True
    mismatched: list[str] = field(default_factory=list)
    random_init_reward: float = math.nan  # before any push
    greedy_exact_match: float = math.nan  # fraction of fresh prompts copied exactly, greedy, at the end
    max_logprob_gap: float = 0.0  # largest |trainer logprob - engine logprob| of a sampled token
    deterministic: bool = True  # engine in deterministic mode, trainer scoring through hotswap.train
    device: str = "cpu"  # the engine's and the trainer's ("cpu" or "cuda:N")
    transport: str = "shm"  # how the trainer pushed: "shm" or "cuda_ipc"
    num_params: int = 0
    total_s: float = 0.0
    plot_path: str | None = None

    @property
    def window(self) -> int:
        """Steps averaged for `initial_reward` and `final_reward`: a quarter of the run, between 1 and 10."""
        return max(1, min(10, len(self.rewards) // 4))

    @property
    def initial_reward(self) -> float:
        return statistics.fmean(self.rewards[: self.window]) if self.rewards else math.nan

    @property
    def final_reward(self) -> float:
        return statistics.fmean(self.rewards[-self.window :]) if self.rewards else math.nan

    @property
    def improved(self) -> bool:
        """The mean reward of the last steps beats that of the first steps by at least MIN_GAIN."""
        return bool(self.rewards) and self.final_reward >= self.initial_reward + MIN_GAIN

    @property
    def ok(self) -> bool:
        return self.checksums_ok and self.improved
