"""bf16 products on oneDNN-packed weights (`hotswap/kernels/packed.py`): the packed copies follow every change of
the weights they were made from (updates, rollbacks, user code, sleep and reload), so an engine always computes
with the weights it holds: its outputs equal a fresh engine's on the same weights, bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import PROMPTS
from hotswap import LLM, SamplingParams
from hotswap.kernels import packed
from transfer_helpers import Pusher

pytestmark = pytest.mark.skipif(not packed.supported(), reason="torch has no oneDNN bf16 support on this CPU")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.fixture
def always_packed(monkeypatch):
    """Takes the packed path for every shape (the engine runs in this process), whatever the timing says."""
    monkeypatch.setattr(packed, "faster", lambda out_features, in_features: True)


def outputs(llm: LLM) -> list[tuple[list[int], list[float]]]:
    results = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in results]


def packed_modules(llm: LLM) -> int:
    return llm.apply_model(lambda m: sum(packed._ATTR in mod.__dict__ for mod in m.modules()))[0]


def test_packed_copies_follow_every_change_of_the_weights(ckpts, b_tensors, always_packed, monkeypatch):
    fresh_b = LLM(str(ckpts["B"]), dtype="bfloat16", kv_cache_memory_bytes=1 << 22)
    expected_b = outputs(fresh_b)
    del fresh_b
    llm = LLM(str(ckpts["A"]), dtype="bfloat16", kv_cache_memory_bytes=1 << 22)
    expected_a = outputs(llm)
    assert packed_modules(llm) > 0
    assert expected_a != expected_b
    llm.reload_weights(weights_iterator=b_tensors)  # an update: every layer written, its copy dropped
    assert outputs(llm) == expected_b
    # a session that wrote A's tensors, then aborted: rolled back to B
    pusher = Pusher(llm, "tensors")
    llm.start_weight_update()
    pusher.update(list(load_file(str(ckpts["A"] / "model.safetensors")).items()))
    llm.abort_weight_update()
    pusher.close()
    assert outputs(llm) == expected_b
    # user code that writes a weight: the packed copies go with it
    llm.apply_model(lambda m: m.model.layers[0].mlp.down_proj.weight.data.mul_(-1))
    changed = outputs(llm)
    monkeypatch.setattr(packed, "faster", lambda out_features, in_features: False)  # the plain product
    plain = outputs(llm)
    assert changed != expected_b and [t for t, _ in changed] == [t for t, _ in plain]
    pairs = [(a, b) for (_, x), (_, y) in zip(changed, plain, strict=True) for a, b in zip(x, y, strict=True)]
    assert all(abs(a - b) < 1e-2 for a, b in pairs)
    monkeypatch.setattr(packed, "faster", lambda out_features, in_features: True)
    # sleep level 2 returns the weights' memory (and the copies'); a reload from the folder brings A back
    llm.sleep(2)
    assert packed_modules(llm) == 0
    llm.wake_up()
    llm.reload_weights(weights_path=str(ckpts["A"]))
    assert outputs(llm) == expected_a
    assert torch.bfloat16 == llm.apply_model(lambda m: m.model.embed_tokens.weight.dtype)[0]
