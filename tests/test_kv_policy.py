"""The KV policy of a running request at a weight commit (`SamplingParams.on_weight_update`, the engine's
`on_weight_update`): "keep" goes on with the KV computed so far; "recompute" computes it again on the new weights
(prompt and output so far), so that every token after the commit is the new model's greedy continuation."""

from __future__ import annotations

import pytest

from conftest import PROMPTS, hf_greedy
from hotswap import LLM, SamplingParams

pytestmark = pytest.mark.timeout(240)


def run_across_a_commit(llm: LLM, b_tensors, policies: dict[str, str | None], staged: bool, before: int = 9):
    """Starts one greedy request per policy on PROMPTS[0], steps `before` times, commits checkpoint B, runs them to
    the end; returns {request id: output} and the number of sequences sent back to be recomputed."""
    engine = llm.llm_engine
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    for rid, policy in policies.items():
        engine.add_request(
            rid, None, ids, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, on_weight_update=policy)
        )
    for _ in range(before):
        engine.step()
    preempted = engine.scheduler.num_preemptions
    if not staged:
        llm.pause_generation("keep", clear_cache=False)
    llm.reload_weights(weights_iterator=b_tensors)
    if not staged:
        llm.resume_generation()
    recomputed = engine.scheduler.num_preemptions - preempted
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0]
    return ids, outs, recomputed


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in_place"])
def test_keep_and_recompute_side_by_side(ckpts, b_tensors, staged):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 23, update_staging="shadow" if staged else "in_place")
    ids, outs, recomputed = run_across_a_commit(llm, b_tensors, {"k": "keep", "r": "recompute"}, staged)
    assert recomputed == 1, "exactly the request that asked for recompute was sent back"
    keep, again = outs["k"], outs["r"]
    switch = again.weight_versions[0].end_token
    assert [(s.version, s.start_token) for s in again.weight_versions] == [(0, 0), (1, switch)]
    assert [(s.version, s.start_token) for s in keep.weight_versions] == [(0, 0), (1, switch)]
    assert keep.token_ids[:switch] == again.token_ids[:switch] == hf_greedy(str(ckpts["A"]), tuple(ids), switch)[0]
    after = hf_greedy(str(ckpts["B"]), tuple(ids + again.token_ids[:switch]), 30 - switch)[0]
    assert again.token_ids[switch:] == after, "recompute: B's greedy continuation of everything so far"
    assert keep.token_ids[switch:] != after, "keep: the old KV shapes what follows (this prompt and these weights)"


def test_the_engine_default_applies_where_a_request_says_nothing(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 23, update_staging="shadow", on_weight_update="recompute")
    ids, outs, recomputed = run_across_a_commit(llm, b_tensors, {"d": None, "k": "keep"}, True)
    assert recomputed == 1
    switch = outs["d"].weight_versions[0].end_token
    assert (
        outs["d"].token_ids[switch:]
        == hf_greedy(str(ckpts["B"]), tuple(ids + outs["d"].token_ids[:switch]), 30 - switch)[0]
    )
    with pytest.raises(ValueError, match="on_weight_update"):
        SamplingParams(on_weight_update="refill")
    with pytest.raises(ValueError, match="on_weight_update"):
        LLM(str(ckpts["A"]), on_weight_update="sometimes")
