"""The native decoder stack (`decoder_layers`, one call per step for small float32 batches) against the module
path it replaces: the same kernels in the same order, so the same bits in outputs and caches."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from hotswap import LLM, SamplingParams
from hotswap.kernels import native
from hotswap.model import llama

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def ops():
    kernels = native.ops()
    if kernels is None:
        pytest.skip("native kernels unavailable (no C++ compiler)")
    return kernels


def _run(path: str, monkeypatch: pytest.MonkeyPatch, native_stack: bool) -> tuple[list, list[torch.Tensor], int]:
    """Outputs, every layer's KV cache afterwards, and how many forward passes took the native stack."""
    used = []
    real_stack = llama.LlamaModel._native_stack
    real_applies = llama.LlamaModel._native_stack_applies

    def counted(self, *args):
        used.append(1)
        return real_stack(self, *args)

    monkeypatch.setattr(llama.LlamaModel, "_native_stack", counted)
    if not native_stack:
        monkeypatch.setattr(llama.LlamaModel, "_native_stack_applies", lambda self, *args: False)
    llm = LLM(path, kv_cache_memory_bytes=1 << 22)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        caches = llm.apply_model(
            lambda model: [t.clone() for layer in model.model.layers for t in (layer.self_attn.attn.k_cache,
                                                                                 layer.self_attn.attn.v_cache)]
        )[0]  # fmt: skip
    finally:
        llm.shutdown()
        monkeypatch.setattr(llama.LlamaModel, "_native_stack", real_stack)
        monkeypatch.setattr(llama.LlamaModel, "_native_stack_applies", real_applies)
    return outs, caches, len(used)


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2"])  # qwen2: q/k/v biases
def test_native_stack_gives_the_module_paths_bits(ops, model_dirs, monkeypatch, name):
    fast, fast_caches, native_steps = _run(str(model_dirs[name]), monkeypatch, native_stack=True)
    slow, slow_caches, none = _run(str(model_dirs[name]), monkeypatch, native_stack=False)
    assert native_steps == PARAMS.max_tokens - 1 and none == 0  # every decode step; never the prefill
    for a, b in zip(fast, slow, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    for a, b in zip(fast_caches, slow_caches, strict=True):
        assert torch.equal(a, b)


def test_native_stack_is_skipped_where_the_modules_differ(ops, model_dirs, monkeypatch):
    """q/k norms (qwen3) are not in the native stack; a forward hook set through the worker on any layer module
    sees every step run, and once removed, decode steps take the native stack again."""
    _, _, native_steps = _run(str(model_dirs["qwen3"]), monkeypatch, native_stack=True)
    assert native_steps == 0

    seen, used = [], []
    real_stack = llama.LlamaModel._native_stack
    monkeypatch.setattr(llama.LlamaModel, "_native_stack", lambda self, *a: used.append(1) or real_stack(self, *a))
    llm = LLM(str(model_dirs["llama"]), kv_cache_memory_bytes=1 << 22)
    try:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)  # the hook check runs (and is remembered) before the hook
        assert len(used) == PARAMS.max_tokens - 1
        [handle] = llm.apply_model(
            lambda model: model.model.layers[1].mlp.register_forward_hook(lambda *_: seen.append(1))
        )
        used.clear()
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert len(seen) == PARAMS.max_tokens and used == []  # the prefill and every decode step ran the modules
        llm.apply_model(lambda model: handle.remove())
        llm.reset_prefix_cache()  # else the cached prompts make the prefill small enough for the native stack too
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert len(seen) == PARAMS.max_tokens and len(used) == PARAMS.max_tokens - 1
    finally:
        llm.shutdown()


def test_decoder_layers_rejects_bad_input(ops):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="entries per layer"):
        ops.decoder_layers(x, torch.zeros(4, dtype=torch.long), [None] * 5, [], [], torch.zeros(4, dtype=torch.long),
                           torch.zeros(4, 1, dtype=torch.long), torch.ones(4, dtype=torch.long), None, None, 1, 1, 8,
                           1.0, 1e-6, torch.ones(8))  # fmt: skip
