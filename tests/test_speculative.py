"""Speculative decoding: exactness (greedy identity, the target's distribution), the engine features it must keep,
and the draft's weights in the weight lifecycle (one session for target and draft, rollback of both)."""

from __future__ import annotations

import logging
import shutil
import tempfile

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from conftest import PROMPTS, serves
from hotswap import LLM, EngineConfig, SamplingParams, current_config
from hotswap.engine.speculator import lookup
from hotswap.model.layers.rejection_sampler import propose, verify
from hotswap.model.layers.sampler import distribution
from hotswap.testing import make_tiny_model
from hotswap.transfer.tensors import tensors_update_info
from hotswap.wire import SampleSpec
from server_helpers import running_server

KV = 1 << 23
LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " * 2
# a shared prefix of several blocks (prefix-cache hits), then distinct tails
CACHED_PROMPTS = [LONG + tail for tail in ("hello world", "the quick brown fox", "x y", "a")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, model_dirs):
    """Per target architecture: a smaller random draft (one layer, other weights) with the same tokenizer."""
    root = tmp_path_factory.mktemp("drafts")
    return {
        arch: make_tiny_model(
            root / arch,
            arch=arch,
            seed=11,
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
        for arch in ("llama", "qwen2", "qwen3")
    }


def token_ids(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [c.token_ids for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


_reference: dict[tuple[str, int, str | None], list[list[int]]] = {}


def plain_tokens(path, prompts: list[str], tp: int = 1, device: str | None = None) -> list[list[int]]:
    """Greedy tokens without speculation (cached per model and device; None: the engines' default device)."""
    key = (str(path), len(prompts), device)
    if key not in _reference:
        llm = LLM(str(path), kv_cache_memory_bytes=KV, **({} if device is None else {"device": device}))
        _reference[key] = token_ids(llm, prompts)
    return _reference[key]


def spec_llm(target, draft=None, k: int = 3, **kwargs) -> LLM:
    config = {"method": "ngram", "num_speculative_tokens": k}
    if draft is not None:
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    return LLM(str(target), kv_cache_memory_bytes=KV, speculative_config=config, **kwargs)


# ---- exactness ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("which", ["self", "small"])
def test_greedy_identity_with_a_draft_model(model_dirs, drafts, arch, which, device):
    """Greedy outputs equal decoding without speculation on the same device, for a draft that always agrees (the
    target itself: every proposal accepted) and one that rarely does; the shared prompt prefix is served from the
    prefix cache the second time, for the draft's cache as much as the target's."""
    target = model_dirs[arch]
    llm = spec_llm(target, target if which == "self" else drafts[arch], k=3, device=device)
    prompts = PROMPTS + CACHED_PROMPTS
    assert token_ids(llm, prompts) == plain_tokens(target, prompts, device=device)
    assert token_ids(llm, CACHED_PROMPTS) == plain_tokens(target, prompts, device=device)[len(PROMPTS) :]
    stats = llm.llm_engine.stats()
    assert stats["prefix_hit_tokens"] > 0
    if which == "self":
        assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > 3.0


@pytest.mark.parametrize(("arch", "draft_tp"), [("llama", 2), ("qwen3", 1)], ids=["sharded", "replicated"])
def test_greedy_identity_under_tensor_parallelism(model_dirs, drafts, arch, draft_tp):
    target = model_dirs[arch]
    draft = target if arch == "llama" else drafts[arch]
    llm = LLM(
        str(target),
        kv_cache_memory_bytes=KV,
        tensor_parallel_size=2,
        speculative_config={
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": draft_tp,
        },
    )
    try:
        assert llm.config.speculative_config.draft_tensor_parallel_size == draft_tp
        prompts = PROMPTS + CACHED_PROMPTS
        assert token_ids(llm, prompts) == plain_tokens(target, prompts)
        if draft is target:
            assert llm.llm_engine.stats()["spec_acceptance_rate"] == 1.0
    finally:
        llm.shutdown()


def test_ngram_greedy_identity_and_long_acceptances(llama_dir, device):
    """Prompt lookup keeps greedy outputs (those of the same device without it); on a repetitive prompt (a greedy
    random model soon loops, too) it accepts more than one token per step on average."""
    llm = spec_llm(llama_dir, k=4, device=device)
    prompts = [*PROMPTS, "a b c d a b c d a b c d a b c d"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(llama_dir), kv_cache_memory_bytes=KV, device=device)
    assert token_ids(llm, prompts, params) == token_ids(plain, prompts, params)
    out = llm.generate(prompts[-1:], params, use_tqdm=False)[0].outputs[0]
    assert out.spec_stats is not None and out.spec_stats.mean_accepted_length > 1.5


def test_lookup_proposes_what_followed_the_latest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 1, 3, 2) == [7, 1]
    assert lookup([5, 6, 7], 1, 3, 2) == []
    assert lookup([4, 1, 4], 1, 2, 3) == [1, 4]  # the one-token match when no longer one exists


SETTINGS = {
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=1.2, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.1),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafted", [True, False], ids=["draft", "point_mass"])
def test_emitted_tokens_follow_the_target_distribution(setting, drafted):
    """Over a tiny vocabulary, with a draft whose distribution differs from the target's: the token emitted at
    each position (the first, and the second where the first was accepted) has the target's distribution
    (chi-square, fixed seed). Also with prompt lookup's point-mass proposals."""
    torch.manual_seed(1234)
    vocab, k, trials = 6, 2, 12000
    spec = SampleSpec(**SETTINGS[setting])
    target_rows = torch.randn(k + 1, vocab) * 1.5
    draft_rows = target_rows[:k] + torch.randn(k, vocab)
    p = distribution(target_rows, [spec] * (k + 1))
    specs = [[SampleSpec(**SETTINGS[setting], position=j) for j in range(k + 1)] for _ in range(trials)]
    if drafted:
        proposals = [[] for _ in range(trials)]
        q_rows: list[list[torch.Tensor]] = [[] for _ in range(trials)]
        for j in range(k):
            tokens, q = propose(draft_rows[j].expand(trials, vocab), [s[j] for s in specs])
            assert q is not None
            for i in range(trials):
                proposals[i].append(tokens[i])
                q_rows[i].append(q[i])
        q_list = [torch.stack(rows) for rows in q_rows]
    else:
        fixed = [int(target_rows[0].argsort()[-2]), int(target_rows[1].argmax())]  # a plausible, often wrong guess
        proposals = [list(fixed) for _ in range(trials)]
        q_list = [None] * trials
    logits = target_rows.repeat(trials, 1)
    emitted = verify(logits, proposals, q_list, specs)
    for j in range(2):
        tokens = [e[j].token_id for e in emitted if len(e) > j]
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
        expected = p[j].double() * len(tokens)
        support = expected > 0
        assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
        assert len(tokens) > 1000
        stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
        dof = int(support.sum()) - 1
        pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
        assert pvalue > 1e-3, (setting, j, counts.tolist(), expected.tolist())


def test_seeded_outputs_equal_plain_sampling_whatever_the_batch(llama_dir, drafts):
    """A seeded request's tokens under speculation are those of plain seeded sampling (verified against the
    token the plain sampler draws at each position), alone, in a batch and through preemption; with the target as
    its own draft (coupled to the same noise) every proposal is accepted."""
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, seed=5, ignore_eos=True)
    plain = token_ids(LLM(str(llama_dir), kv_cache_memory_bytes=KV), PROMPTS, params)
    same = spec_llm(llama_dir, llama_dir, k=3)
    assert token_ids(same, PROMPTS, params) == plain
    assert token_ids(same, PROMPTS[:1], params) == plain[:1]
    assert same.llm_engine.stats()["spec_acceptance_rate"] == 1.0
    for llm in (spec_llm(llama_dir, drafts["llama"], k=3), spec_llm(llama_dir, k=3)):
        assert token_ids(llm, PROMPTS, params) == plain
    config = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3}
    crowded = LLM(str(llama_dir), kv_cache_memory_bytes=150_000, max_model_len=128, speculative_config=config)
    assert token_ids(crowded, PROMPTS, params) == plain
    assert crowded.llm_engine.stats()["num_preemptions"] > 0


def test_engine_features_keep_working(llama_dir, drafts):
    """n > 1, stop strings, min_tokens, logprobs (the target's) and max_tokens equal decoding without
    speculation; preemption (a cache too small for the batch) recomputes the draft's KV too."""
    plain = LLM(str(llama_dir), kv_cache_memory_bytes=KV)
    llm = spec_llm(llama_dir, llama_dir, k=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, n=2, stop=[" the"], min_tokens=3, logprobs=3)
    for a, b in zip(
        plain.generate(PROMPTS, params, use_tqdm=False), llm.generate(PROMPTS, params, use_tqdm=False), strict=True
    ):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == (
                cb.token_ids,
                cb.text,
                cb.finish_reason,
                cb.stop_reason,
            )
            for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert la.keys() == lb.keys()
                assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 and la[t].rank == lb[t].rank for t in la)
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    small = LLM(
        str(llama_dir),
        kv_cache_memory_bytes=200_000,
        max_model_len=256,
        speculative_config={"method": "draft_model", "model": str(drafts["llama"]), "num_speculative_tokens": 4},
    )
    assert token_ids(small, PROMPTS, long) == token_ids(plain, PROMPTS, long)
    assert small.llm_engine.stats()["num_preemptions"] > 0


def test_a_draft_with_another_vocabulary_is_refused(llama_dir, tmp_path):
    other = make_tiny_model(tmp_path / "other", vocab_size=640)
    with pytest.raises(ValueError, match="vocab_size 640 differs"):
        EngineConfig.from_kwargs(str(llama_dir), speculative_config={"method": "draft_model", "model": str(other)})
    with pytest.raises(ValueError, match="method"):
        EngineConfig.from_kwargs(str(llama_dir), speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="unknown speculative_config"):
        EngineConfig.from_kwargs(str(llama_dir), speculative_config={"method": "ngram", "k": 3})
    with pytest.raises(TypeError, match="unknown engine argument 'method'"):
        EngineConfig.from_kwargs(str(llama_dir), method="ngram")


# ---- the draft's weights ------------------------------------------------------------------------------------


@pytest.fixture()
def a_copy(ckpts, tmp_path):
    """A second folder with checkpoint A's weights: the draft of an engine serving A (always accepted)."""
    return shutil.copytree(ckpts["A"], tmp_path / "draft_A")


def acceptance(llm: LLM) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    proposed = sum(o.outputs[0].spec_stats.num_draft_tokens for o in outs)
    return sum(o.outputs[0].spec_stats.num_accepted_tokens for o in outs) / proposed


def test_one_session_updates_target_and_draft(ckpts, a_copy, b_tensors, caplog):
    """A session for the target alone leaves the draft stale (warned once; outputs are B's, acceptance drops);
    a session with target 'all' carrying both brings acceptance back to where it was; the versions say so."""
    llm = spec_llm(ckpts["A"], a_copy, k=3)
    assert acceptance(llm) == 1.0
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(b_tensors))
    with caplog.at_level(logging.WARNING, logger="hotswap.speculative"):
        llm.finish_weight_update()
        assert serves(llm, ckpts["B"])
        stale = acceptance(llm)
    assert stale < 0.5
    assert sum("draft is stale" in r.message for r in caplog.records) == 1
    assert (llm.get_weight_version(), llm.get_weight_version("draft")) == (1, 0)
    token = llm.start_weight_update(target="all")
    llm.update_weights(
        tensors_update_info([(f"draft.{n}", t) for n, t in b_tensors[: len(b_tensors) // 2]]), session_token=token
    )
    rest = b_tensors[len(b_tensors) // 2 :]
    llm.update_weights({**tensors_update_info(rest), "target": "draft"}, session_token=token)
    llm.finish_weight_update(session_token=token)
    assert (llm.get_weight_version(), llm.get_weight_version("draft")) == (1, 1)
    assert not llm.llm_engine.draft_stale
    assert serves(llm, ckpts["B"])
    assert acceptance(llm) == 1.0
    draft_sums = llm.weight_checksums("draft")
    model_sums = llm.weight_checksums()
    assert [draft_sums[f"draft.{n}"] for n in sorted(model_sums)] == [model_sums[n] for n in sorted(model_sums)]


def test_a_failure_mid_session_rolls_back_both(ckpts, a_copy, b_tensors):
    llm = spec_llm(ckpts["A"], a_copy, k=3)
    before = llm.weight_checksums("all")
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update(target="all")
    llm.update_weights(tensors_update_info(b_tensors))
    llm.update_weights(tensors_update_info([(f"draft.{n}", t) for n, t in b_tensors[:3]]))
    name, tensor = b_tensors[4]
    with pytest.raises(ValueError, match="wrong shape"):
        llm.update_weights(tensors_update_info([(f"draft.{name}", tensor[:1])]))
    assert llm.weight_checksums("all") == before
    assert serves(llm, ckpts["A"]) and acceptance(llm) == 1.0
    assert (llm.get_weight_version(), llm.get_weight_version("draft")) == (0, 0)
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(b_tensors[:2]))
    with pytest.raises(ValueError, match=r"started for 'model'.*rolled back"):
        llm.update_weights({**tensors_update_info(b_tensors[:1]), "target": "draft"})
    assert llm.weight_checksums("all") == before
    assert llm.llm_engine.executor.worker.session.state.value == "ready", "the failed update ended the session"
    llm.start_weight_update("draft")  # a new session opens
    llm.abort_weight_update()
    assert llm.get_weight_version() == 0


def test_a_failed_draft_update_never_stops_serving(ckpts, a_copy, b_tensors):
    """Without rollback copies (atomic off) a streamed draft update that fails half-way (a NaN in its second
    file) leaves the draft part-written, yet the engine serves on (outputs never depend on the draft), and a draft
    reload repairs it."""
    config = {"method": "draft_model", "model": str(a_copy), "num_speculative_tokens": 3}
    llm = LLM(
        str(ckpts["A"]), kv_cache_memory_bytes=KV, weight_transfer_config={"atomic": False}, speculative_config=config
    )
    before = llm.weight_checksums("draft")
    llm.init_weight_transfer_engine({"backend": "disk"})
    with tempfile.TemporaryDirectory() as tmp:
        save_file(dict(b_tensors[:3]), f"{tmp}/a.safetensors")
        name, tensor = b_tensors[3]
        save_file({name: torch.full_like(tensor, float("nan"))}, f"{tmp}/b.safetensors")
        llm.start_weight_update("draft")
        with pytest.raises(ValueError, match="NaN"):
            llm.update_weights({"path": tmp})
    after = llm.weight_checksums("draft")
    assert any(after[f"draft.{n}"] != before[f"draft.{n}"] for n, _ in b_tensors[:3]), "nothing was written"
    assert llm.llm_engine.health_problem() is None
    assert serves(llm, ckpts["A"])
    llm.reload_weights(weights_path=str(a_copy), target="draft")
    assert llm.weight_checksums("draft") == before and acceptance(llm) == 1.0


def test_reload_the_draft_and_staleness_policies(ckpts, a_copy, b_tensors):
    """reload_weights(target='draft') from an iterator and from a folder (recorded as the draft's); 'disable'
    stops speculating while the draft is stale, and outputs never change."""
    llm = LLM(
        str(ckpts["A"]),
        kv_cache_memory_bytes=KV,
        speculative_config={
            "method": "draft_model",
            "model": str(a_copy),
            "num_speculative_tokens": 3,
            "draft_staleness": "disable",
        },
    )
    llm.reload_weights(weights_path=str(ckpts["B"]))
    assert serves(llm, ckpts["B"])
    steps = llm.llm_engine.stats()["spec_steps"]
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert llm.llm_engine.stats()["spec_steps"] == steps, "a stale draft under 'disable' must not speculate"
    llm.reload_weights(weights_iterator=iter(b_tensors), target="draft")
    assert llm.get_weight_version("draft") == llm.get_weight_version() == 1
    assert acceptance(llm) == 1.0 and serves(llm, ckpts["B"])
    llm.reload_weights(weights_path=str(ckpts["A"]), target="draft")
    assert llm.config.speculative_config.model == str(ckpts["A"])
    assert acceptance(llm) < 0.5 and serves(llm, ckpts["B"])
    llm.update_config({"speculative_config": {"draft_staleness": "allow"}})
    with pytest.raises(ValueError, match="needs a draft model"):
        spec_llm(ckpts["A"]).reload_weights(weights_iterator=iter(b_tensors), target="draft")
    with pytest.raises(ValueError, match="shape"):
        llm.reload_weights(weights_iterator=[(b_tensors[0][0], b_tensors[0][1][:1])], target="draft")


def test_draft_entry_points_run_in_the_draft_scope(ckpts, a_copy, b_tensors):
    """Every worker entry point that reaches the draft's layers (the load, reloads of the draft, an update
    session's update and finish) runs their post-processing under the draft's config: current_config() is the
    worker's draft config, whose model_config is the draft's folder."""
    llm = spec_llm(ckpts["A"], a_copy, k=2)
    worker = llm.llm_engine.executor.worker
    seen: dict[str, str] = {}
    label = [""]
    qkv = worker.draft_model.model.layers[0].self_attn.qkv_proj
    original = qkv.process_weights_after_loading

    def probe():
        config = current_config()
        assert config is worker.draft_config
        seen[label[0]] = config.model_config.model
        original()

    q_name = "model.layers.0.self_attn.q_proj.weight"
    q = dict(b_tensors)[q_name]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(qkv, "process_weights_after_loading", probe)
        label[0] = "reload_weights"
        llm.reload_weights(weights_iterator=b_tensors, target="draft")
        label[0] = "update_weights"
        llm.init_weight_transfer_engine({"backend": "tensors"})
        llm.start_weight_update(target="all")
        llm.update_weights(tensors_update_info([(f"draft.{n}", t) for n, t in b_tensors if "layers.0.self_attn" in n]))
        llm.finish_weight_update()
        label[0] = "finish_weight_update"
        llm.start_weight_update(target="draft")
        llm.update_weights(tensors_update_info([(q_name, q)]))  # q alone: qkv_proj is post-processed at finish
        llm.finish_weight_update()
        label[0] = "load_model"
        m.setattr(
            "hotswap.worker.worker.build_model",
            lambda mc, settings: worker.draft_model if mc is worker.config.draft_model_config else worker.model,
        )
        worker.load_model()
    assert seen == dict.fromkeys(
        ["reload_weights", "update_weights", "finish_weight_update", "load_model"], str(a_copy)
    )
    with pytest.raises(RuntimeError, match="outside a config scope"):
        current_config()


# ---- the server ---------------------------------------------------------------------------------------------


def test_server_with_speculation(ckpts, a_copy):
    """The OpenAI routes serve with speculation on; the admin routes take `target`; /metrics shows acceptance."""
    config = f'{{"method": "draft_model", "model": "{a_copy}", "num_speculative_tokens": 3}}'
    with running_server(
        str(ckpts["A"]), "--admin-auth", "none", "--kv-cache-memory-bytes", str(KV), "--speculative-config", config
    ) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        plain = LLM(str(ckpts["A"]), kv_cache_memory_bytes=KV)
        expected = plain.generate(
            PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )
        for prompt, ref in zip(PROMPTS[:2], expected, strict=True):
            out = client.completions.create(
                model="A", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
            )
            assert out.choices[0].text == ref.outputs[0].text
        stream = client.chat.completions.create(
            model="A", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        assert sum(1 for _ in stream) > 1
        metrics = httpx.get(f"{base}/metrics").text
        assert "hotswap_spec_acceptance_rate 1.0" in metrics and "hotswap_draft_stale 0.0" in metrics
        r = httpx.post(f"{base}/reload_weights", json={"weights_path": str(ckpts["B"])})
        assert r.json() == {"weight_version": "1", "draft_weight_version": "0", "draft_stale": True}
        assert "hotswap_draft_stale 1.0" in httpx.get(f"{base}/metrics").text
        assert httpx.post(f"{base}/init_weight_transfer_engine", json={"init_info": {"backend": "disk"}}).is_success
        assert httpx.post(f"{base}/start_weight_update", json={"target": "all"}).is_success
        r = httpx.post(f"{base}/update_weights", json={"update_info": {"path": str(ckpts["B"]), "target": "draft"}})
        assert r.is_success, r.text
        r = httpx.post(f"{base}/finish_weight_update")
        assert r.json() == {"weight_version": "1", "draft_weight_version": "1", "draft_stale": False}
        assert httpx.get(f"{base}/get_weight_version").json()["draft_stale"] is False
        r = httpx.post(f"{base}/reload_weights", json={"weights_path": str(ckpts["A"]), "target": "draft"})
        assert r.status_code == 200, r.text
        assert httpx.post(f"{base}/reload_weights", json={"target": "nope"}).status_code == 400
        assert httpx.post(f"{base}/start_weight_update", json={"target": "nope"}).status_code == 400
