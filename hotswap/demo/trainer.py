"""The demo's trainer: a transformers model in a spawned process that warms up on the output format, then runs
GRPO on the engine's rollouts and pushes all its weights after every step (over shared memory, or as CUDA IPC
handles: on a GPU, or shared CPU tensors); and the engine process's handle on it."""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
import traceback
from dataclasses import dataclass
from typing import Any, cast

import torch

from hotswap.demo.task import CopyTask
from hotswap.transfer.delta import DeltaEncoder

_REPLY_TIMEOUT_S = 300.0  # longest wait for one trainer reply (its start-up and warm-up included)


@dataclass(frozen=True)
class TrainerSettings:
    """Everything the spawned trainer needs (picklable)."""

    model_dir: str
    task: CopyTask
    seed: int
    lr: float
    warmup_steps: int
    warmup_lr: float
    warmup_batch: int = 64
    clip: float = 0.2  # PPO/GRPO ratio clip
    entropy_coef: float = 0.02  # entropy bonus: keeps a digit's output from collapsing onto a wrong token early
    num_threads: int = 2  # the model is tiny: more threads do not help
    # the engine runs deterministic=True and the RL steps score with hotswap.train's forward: the same bits
    deterministic: bool = True
    device: str = "cpu"  # the trainer's model and optimizer: the engine's device ("cpu" or "cuda:N")
    transport: str = "shm"  # "shm" (ShmSender) or "cuda_ipc" (CudaIpcSender, one flat bucket per push)
    engine_dtype: str = "float32"  # the engine's weight dtype: checksums and deltas are taken in it


@dataclass
class RolloutBatch:
    """One step's rollouts, grouped by prompt: `completions[g][i]` is the i-th sample for `prompts[g]`, with its
    reward `rewards[g][i]` and the engine's logprob of each of its tokens `engine_logprobs[g][i]`."""

    prompts: list[list[int]]
    completions: list[list[list[int]]]
    rewards: list[list[float]]
    engine_logprobs: list[list[list[float]]]


class _Trainer:
    """The policy as a transformers model, its optimizer and the sender. Lives in the trainer process."""

    def __init__(self, settings: TrainerSettings) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from hotswap.transfer.cuda_ipc import CudaIpcSender
        from hotswap.transfer.shm import ShmSender

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.settings = settings
        self.task = settings.task
        self.device = torch.device(settings.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, settings.engine_dtype)
        self.model = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=torch.float32)
        torch.nn.Module.to(self.model, self.device)  # in place (transformers wraps `to` in a way mypy misreads)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=settings.lr)  # the RL steps'
        self.sender: ShmSender | CudaIpcSender
        if settings.transport == "cuda_ipc":
            # keeps each push's bucket alive until the engine's update_weights returned (the next request)
            self.sender = CudaIpcSender()
        else:
            self.sender = ShmSender()
        # pushes are sparse deltas against what the engine committed (the first is full); Adam moves nearly every
        # element each step, so most tensors still travel whole: the report shows how much a push saved
        self.encoder = DeltaEncoder("sparse", dtype=self.dtype)

    def _tensor(self, data: object, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _completion_log_softmax(self, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For `sequences` [B, prompt_len + K]: the log-softmax at each completion position [B, K, V] and the
        logprob of each completion token [B, K]."""
        p = self.task.prompt_len
        log_probs = torch.log_softmax(self.model(sequences).logits[:, p - 1 : -1].float(), dim=-1)
        return log_probs, log_probs.gather(-1, sequences[:, p:, None]).squeeze(-1)

    def _completion_log_softmax_exact(self, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_completion_log_softmax` through `hotswap.train`'s forward: the deterministic engine's bits, so the
        importance ratio of a rollout from the weights the trainer holds is exactly 1."""
        from hotswap.train.logprobs import sequence_logprobs

        p = self.task.prompt_len
        rows = sequence_logprobs(self.model, list(sequences))  # each [len - 1, V]: after tokens 0 .. len - 2
        log_probs = torch.stack([r[p - 1 :] for r in rows])
        return log_probs, log_probs.gather(-1, sequences[:, p:, None]).squeeze(-1)

    def warmup(self) -> dict[str, float]:
        """Supervised steps on `prompt -> K random digits`: teaches the output alphabet, not the task (the targets
        do not depend on the prompt, so the expected reward stays at chance)."""
        s, task = self.settings, self.task
        rng = random.Random(s.seed + 1)
        optimizer = torch.optim.Adam(self.model.parameters(), lr=s.warmup_lr)
        loss = torch.zeros(())
        start = time.perf_counter()
        for _ in range(s.warmup_steps):
            rows = [
                task.prompt_ids(task.sample(rng)) + [task.digit_ids[d] for d in task.sample(rng)]
                for _ in range(s.warmup_batch)
            ]
            loss = -self._completion_log_softmax(self._tensor(rows))[1].mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return {"loss": loss.item(), "train_ms": (time.perf_counter() - start) * 1e3}

    def train(self, batch: RolloutBatch) -> dict[str, float]:
        """One GRPO step on the engine's rollouts: advantages are rewards normalized within each prompt's group,
        the loss is the clipped surrogate with ratio exp(logp_trainer - logp_engine) minus an entropy bonus, one
        Adam step."""
        start = time.perf_counter()
        rows: list[list[int]] = []
        advantages: list[float] = []
        behaviour: list[list[float]] = []
        for prompt, completions, rewards, logprobs in zip(
            batch.prompts, batch.completions, batch.rewards, batch.engine_logprobs, strict=True
        ):
            r = self._tensor(rewards, torch.float32)
            advantages += ((r - r.mean()) / (r.std() + 1e-6)).tolist()
            rows += [prompt + c for c in completions]
            behaviour += logprobs
        sequences = self._tensor(rows)
        old = self._tensor(behaviour, torch.float32)
        adv = self._tensor(advantages)[:, None]
        if self.settings.deterministic:
            log_probs, logp = self._completion_log_softmax_exact(sequences)
        else:
            log_probs, logp = self._completion_log_softmax(sequences)
        ratio = torch.exp(logp - old)
        clip = self.settings.clip
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()
        entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
        loss = -surrogate - self.settings.entropy_coef * entropy
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return {
            "loss": loss.item(),
            "entropy": entropy.item(),
            "logprob_gap": float((logp.detach() - old).abs().max()),  # trainer vs engine, same weights
            "train_ms": (time.perf_counter() - start) * 1e3,
        }

    def push(self, committed: int | None) -> tuple[dict[str, Any], dict[str, str], dict[str, float]]:
        """Writes what changed since the engine's `committed` version (None: nothing committed yet, a full push)
        into the shared segment (shm), or exports it as one flat bucket (cuda_ipc); returns (update_info, {name:
        sha256 of every parameter in the engine's dtype}, bytes sent / full). Called once the engine's
        update_weights for the previous push returned (its request came after), so that push's memory is free."""
        from hotswap.transfer.shm import ShmSender
        from hotswap.weights.checksum import tensor_sha256

        if committed is not None:
            self.encoder.committed(committed)
        named = [(name, p.detach()) for name, p in self.model.named_parameters()]  # a tied weight appears once
        delta, extra = self.encoder.encode(named)
        if isinstance(self.sender, ShmSender):
            info = {**self.sender.write(delta), **extra}
        else:
            self.sender.release()  # the previous push's bucket: the engine has read it and let go
            info = {**self.sender.update_info(delta, bucket=True), **extra}
        sizes = {"push_bytes": float(self.encoder.last_bytes), "full_bytes": float(self.encoder.last_full_bytes)}
        return info, {name: tensor_sha256(t, self.dtype) for name, t in named}, sizes

    def close(self) -> None:
        from hotswap.transfer.shm import ShmSender

        if isinstance(self.sender, ShmSender):
            self.sender.close()
        else:
            self.sender.release()


def _trainer_main(settings: TrainerSettings, requests: Any, replies: Any) -> None:
    """The trainer process. Requests: ("warmup",), ("train", RolloutBatch, committed version), ("stop",). Each of
    the first two is answered ("pushed", update_info, checksums, stats) once the new weights are in shared memory
    (a delta against the version the engine committed from the previous push); any failure is answered ("error",
    traceback) and ends the process. The engine must finish `update_weights` for one push before it sends the
    next request: the shm sender rewrites its buffer in place, the cuda_ipc sender releases the last bucket."""
    trainer: _Trainer | None = None
    try:
        torch.set_num_threads(settings.num_threads)
        torch.manual_seed(settings.seed)
        trainer = _Trainer(settings)
        replies.put(("ready",))
        while True:
            request = requests.get()
            if request[0] == "stop":
                break
            stats = trainer.warmup() if request[0] == "warmup" else trainer.train(request[1])
            info, checksums, sizes = trainer.push(None if request[0] == "warmup" else request[2])
            replies.put(("pushed", info, checksums, {**stats, **sizes}))
    except BaseException:
        replies.put(("error", traceback.format_exc()))
    finally:
        if trainer is not None:
            trainer.close()


class _TrainerHandle:
    """The engine process's end of the trainer: request/reply over queues, failing fast if the trainer dies."""

    def __init__(self, settings: TrainerSettings) -> None:
        ctx = mp.get_context("spawn")
        self.requests, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=_trainer_main, args=(settings, self.requests, self.replies), name="hotswap-demo-trainer"
        )
        self.process.start()

    def receive(self, expected: str) -> tuple[Any, ...]:
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        while True:
            try:
                reply = self.replies.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"the trainer process exited (code {self.process.exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no reply from the trainer in {_REPLY_TIMEOUT_S:.0f} s") from None
        if reply[0] == "error":
            raise RuntimeError(f"the trainer failed:\n{reply[1]}")
        if reply[0] != expected:
            raise RuntimeError(f"expected {expected!r} from the trainer, got {reply[0]!r}")
        return cast("tuple[Any, ...]", reply[1:])

    def _reap(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for the trainer to exit. Polls the process (waitpid) rather than joining:
        `join` waits for the spawn sentinel pipe to close, and torch's shared-memory manager, which a cuda_ipc
        trainer starts for its CPU handles, inherits that pipe and outlives the trainer (for as long as this
        process stays its client)."""
        deadline = time.monotonic() + timeout
        while self.process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        """Asks the trainer to stop (it unlinks its shared segment, or releases what it exported), then reaps it;
        kills it only if it hangs."""
        if self.process.is_alive():
            self.requests.put(("stop",))
            self._reap(30)
        if self.process.is_alive():
            self.process.terminate()
            self._reap(10)
        for q in (self.requests, self.replies):
            q.cancel_join_thread()  # never block on data nobody will read
            q.close()
