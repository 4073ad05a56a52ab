"""The post-update canary (hotswap/engine/canary.py): probes scored with the new weights before the commit. A
trainer that sends transposed tensors of the right shape (checksums of what it sent would match) is caught and
rolled back, naming the probe; a correct update passes; bounds the user sets hold; a malformed canary is refused;
over HTTP, on worker processes (every rank rolls back) and in a fleet (every replica rolls back)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM, SamplingParams
from hotswap.transfer.tensors import tensors_update_info

KV = 1 << 22
PROBES = [[5, 17, 42, 99, 7, 3, 250, 31], [400, 12, 12, 88, 1, 64]]


def trainer_logprobs(path, named: dict[str, torch.Tensor]) -> list[list[float]]:
    """What the trainer's own forward (transformers, with the weights it means to send) gives each probe."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.load_state_dict(named, strict=False)
    out = []
    with torch.no_grad():
        for ids in PROBES:
            x = torch.tensor([ids])
            lp = model(x).logits[0, :-1].float().log_softmax(-1).gather(1, x[0, 1:, None]).squeeze(1)
            out.append(lp.tolist())
    return out


@pytest.fixture(scope="module")
def b_state(ckpts):
    return dict(load_file(str(ckpts["B"] / "model.safetensors")))


@pytest.fixture(scope="module")
def canary(ckpts, b_state):
    return {"token_ids": PROBES, "logprobs": trainer_logprobs(ckpts["A"], b_state), "atol": 1e-3}


def sums(llm) -> dict[str, str]:
    return llm.collective_rpc("weight_checksums")[0]


def session(llm, named, canary, version=None) -> None:
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(list(named.items())))
    llm.finish_weight_update(version, canary=canary)


def transposed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A trainer bug that keeps every shape: the square attention projections sent transposed."""
    out = dict(state)
    for name, t in state.items():
        if name.endswith(("q_proj.weight", "o_proj.weight")) and t.shape[0] == t.shape[1]:
            out[name] = t.t().contiguous()
    assert out.keys() == state.keys() and any(not torch.equal(out[n], state[n]) for n in state)
    return out


def test_a_correct_update_passes_its_canary(ckpts, b_state, canary):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    session(llm, b_state, canary, "step-1")
    assert llm.llm_engine.weight_version_label == "step-1"
    scored = llm.generate(
        [{"prompt_token_ids": PROBES[0]}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0].prompt_logprobs
    assert abs(scored[1][PROBES[0][1]].logprob - canary["logprobs"][0][0]) < 1e-3


def test_transposed_tensors_of_the_right_shape_are_caught_and_rolled_back(ckpts, b_state, canary):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    before = sums(llm)
    with pytest.raises(ValueError, match=r"canary probe 0: the new weights' logprobs differ from the trainer's"):
        session(llm, transposed(b_state), canary)
    assert sums(llm) == before and llm.get_weight_version() == 0
    assert llm.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_a_bound_the_user_sets_holds(ckpts, b_state):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    before = sums(llm)
    with pytest.raises(ValueError, match=r"mean negative logprob .* exceeds max_nll 0\.5"):
        session(llm, b_state, {"token_ids": PROBES, "max_nll": 0.5})  # random weights: ~log(vocab) nats
    assert sums(llm) == before
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(list(b_state.items())))
    llm.finish_weight_update(canary={"token_ids": PROBES, "max_nll": 30.0})
    assert llm.get_weight_version() == 1


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"token_ids": PROBES}, "needs 'logprobs'"),
        ({"token_ids": [[1]], "max_nll": 3.0}, "at least 2 token ids"),
        ({"token_ids": PROBES, "logprobs": [[0.0]], "atol": 1e-3}, "one finite logprob for each token"),
        ({"token_ids": PROBES, "max_nll": 3.0, "tolerance": 1}, r"unknown field\(s\) \['tolerance'\]"),
        ({"token_ids": [[1, 10**9]], "max_nll": 3.0}, "token ids in"),
    ],
)
def test_a_malformed_canary_is_refused_and_rolls_the_session_back(ckpts, b_state, bad, message):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
    before = sums(llm)
    with pytest.raises(ValueError, match=message):
        session(llm, b_state, bad)
    assert sums(llm) == before
    llm.start_weight_update()  # the failed session ended; a new one opens
    llm.abort_weight_update()


def test_the_canary_over_http(ckpts, b_state, canary):
    import httpx

    from hotswap.entrypoints.client import AdminClient
    from hotswap.testing import running_server

    with running_server(str(ckpts["A"]), "--admin-key", "k", "--kv-cache-memory-bytes", str(KV)) as (base, _):
        client = AdminClient(base, admin_key="k")
        try:
            before = client.checksums()
            with pytest.raises(Exception, match="canary probe 0"):
                client.push_weights(list(transposed(b_state).items()), canary=canary)
            assert client.checksums() == before and client.get_weight_version() == "0"
            assert client.push_weights(list(b_state.items()), canary=canary, weight_version="s1") == "s1"
            assert httpx.get(f"{base}/liveness", timeout=30).status_code == 200
        finally:
            client.close()


@pytest.mark.slow
def test_every_rank_rolls_back_on_worker_processes(ckpts, b_state, canary):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV, tensor_parallel_size=2)
    before = llm.collective_rpc("weight_checksums")
    with pytest.raises(ValueError, match="canary probe 0"):
        session(llm, transposed(b_state), canary)
    assert llm.collective_rpc("weight_checksums") == before
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(list(b_state.items())))
    llm.finish_weight_update(canary=canary)
    assert llm.get_weight_version() == 1
    llm.shutdown()
