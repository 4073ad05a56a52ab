"""`hotswap demo`: live RL training in which a trainer process pushes new weights into the running engine every step.

The task is to copy the digits of the prompt: a prompt is the token ids of `<bos> d1 ... dK =` and the right
completion is `d1 ... dK`. The reward of a completion is the fraction of its K positions that hold the right
digit (1.0 at best); a policy that writes uniformly random digits scores 0.1 on average (chance).

Who does what:

- This process builds a small random-weight llama checkpoint, runs the engine in-process (`hotswap.LLM`), samples
  the rollouts from it (n per prompt, temperature 1, with logprobs), scores them, and applies and verifies every
  weight update.
- A trainer in a separate, spawned process loads the same checkpoint as a transformers model in fp32. It first
  warms up supervised on the output *format* only (random digits after the `=`, so the reward stays at chance),
  then runs GRPO on the engine's rollouts: group-normalized advantages, a clipped policy-gradient loss whose
  importance ratio uses the engine's logprobs of the sampled tokens, one Adam step per batch. After every optimizer
  step it writes all its parameters into shared memory (`ShmSender`) and sends back the update info and the
  SHA-256 of every tensor it sent. With `--device cuda` both run on the GPU (deterministic mode off: it is the
  CPU's for now) and each push is one flat bucket of CUDA IPC handles (`CudaIpcSender`); `--transport cuda_ipc`
  sends the same handles over shared CPU tensors on the CPU.
- This process applies each update (`start_weight_update`, `update_weights`, `finish_weight_update`) before it
  samples the next batch, and compares `llm.weight_checksums()` with the trainer's hashes.

The engine's weights change only through these pushes, so the reward curve is the engine learning live.
"""

from hotswap.demo.result import MIN_GAIN, DemoResult
from hotswap.demo.run import add_demo_arguments, run_demo, run_demo_from_args
from hotswap.demo.task import CHANCE_REWARD, NUM_SYMBOLS, CopyTask
from hotswap.demo.trainer import RolloutBatch, TrainerSettings, _TrainerHandle

__all__ = [
    "CHANCE_REWARD",
    "MIN_GAIN",
    "NUM_SYMBOLS",
    "CopyTask",
    "DemoResult",
    "RolloutBatch",
    "TrainerSettings",
    "_TrainerHandle",
    "add_demo_arguments",
    "run_demo",
    "run_demo_from_args",
]
