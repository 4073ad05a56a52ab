"""The engine on the Triton paged-attention kernels (`attention_backend="triton"`, the GPU's path), run by Triton's
interpreter on the CPU: greedy tokens and logprobs equal transformers' for a llama, a qwen3 (q/k norms, head_dim
!= hidden / heads) and a qwen3-MoE model, through decode steps, prompts, chunked prefills that share a step with
decodes (the two-part batch) and prefix-cache hits (extends over cached blocks).

The interpreter only runs kernels in a process where TRITON_INTERPRET=1 was set before triton was first imported,
so the engine runs in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import PROMPTS, hf_greedy
from hotswap.testing import make_tiny_model

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

TOKENS = 6
CHILD = r"""
import json, sys
import numpy as np

try:  # triton 3.6's interpreter takes int() of a one-element array as a loop bound; numpy >= 2.4 refuses
    int(np.array([1]))
except TypeError:  # (fixed upstream: triton-lang/triton#9172)
    from triton.runtime import interpreter
    original = interpreter._patch_lang_tensor
    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    interpreter._patch_lang_tensor = patch

from hotswap import LLM, SamplingParams

path, prompts, graphs = sys.argv[1], json.loads(sys.argv[2]), sys.argv[4] == "graphs"
llm = LLM(path, attention_backend="triton", block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
          kv_cache_memory_bytes=1 << 22)
backend = llm.collective_rpc(lambda worker: worker.runner.attention_kernel.name)
if graphs:  # decode graphs with an eager stand-in for the capture: the replay runs the captured function again
    llm.collective_rpc(lambda w: w.runner.allocate_kv_cache(w.runner.num_blocks, capture=lambda fn: (fn(), fn)[1]))
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True, logprobs=1)
first = llm.generate(prompts, params, use_tqdm=False)
again = llm.generate(prompts[:2], params, use_tqdm=False)  # prefix-cache hits: extends over cached blocks
out = [{"ids": o.prompt_token_ids, "tokens": o.outputs[0].token_ids, "cached": o.num_cached_tokens,
        "logprobs": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
       for o in first + again]
replays = llm.collective_rpc(lambda w: None if w.runner.graphs is None else w.runner.graphs.replays)
print(json.dumps({"backend": backend, "out": out, "replays": replays}))
"""


@pytest.mark.parametrize(
    ("arch", "graphs"),
    [("llama", False), ("qwen3", False), ("qwen3_moe", False), ("llama", True), ("qwen3", True), ("qwen3_moe", True)],
)
def test_greedy_on_the_triton_kernels_matches_transformers(tmp_path, arch, graphs):
    """With `graphs`, decode steps run through `DecodeGraphs` (hotswap/worker/cuda_graphs.py) with an eager stand-in
    for the capture: its static buffers, size classes (3 rows replay the class of 4, one row padding into the
    scratch block) and the Triton kernels' trusted mode; a MoE model is not captured."""
    path = make_tiny_model(tmp_path / arch, arch=arch)
    prompts = [PROMPTS[7], PROMPTS[1], PROMPTS[0]]  # 17+ tokens: chunked (16 a step) beside the others' decodes
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), json.dumps(prompts), str(TOKENS), "graphs" if graphs else "eager"],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["backend"] == ["triton"]
    if graphs and arch != "qwen3_moe":
        assert result["replays"][0] >= TOKENS  # most decode steps came from a graph
    else:
        assert result["replays"] == [None]
    assert any(o["cached"] > 0 for o in result["out"][3:])  # the second pass hit the prefix cache
    for o in result["out"]:
        tokens, logprobs = hf_greedy(str(path), tuple(o["ids"]), TOKENS)
        assert o["tokens"] == tokens
        for step, token in enumerate(tokens):
            assert abs(o["logprobs"][step] - logprobs[step][token].item()) < 1e-4
