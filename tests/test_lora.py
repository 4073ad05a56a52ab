"""LoRA adapters in one engine, judged against transformers + PEFT's own `PeftModel` on the same adapter folders:
greedy tokens and logprobs, mixed batches, in-place updates served at once (vllm#42125), updates through the
weight session over the transports with rollback, deltas against a base version, versions held while used,
and bad input that changes nothing."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from conftest import ARCHS, PROMPTS
from hotswap import LLM, LoRARequest, SamplingParams
from hotswap.engine.llm_engine import LLMEngine
from hotswap.lora.peft_format import read_folder
from hotswap.testing import make_tiny_lora, make_tiny_model
from hotswap.transfer.delta import xor_delta
from transfer_helpers import Pusher

pytestmark = pytest.mark.timeout(300)

TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_bases")
    return {name: make_tiny_model(root / name, arch, **overrides) for name, (arch, overrides) in ARCHS.items()}


@pytest.fixture(scope="module")
def adapters(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per base: "a" (rank 8, every projection), "b" (rank 4, rsLoRA, q/v/down only), "c" (rank 8, another
    draw of "a"'s shape: an update of "a")."""
    root = tmp_path_factory.mktemp("lora_adapters")
    out = {}
    for name, base in bases.items():
        out[f"{name}/a"] = make_tiny_lora(base, root / name / "a", rank=8, seed=1)
        out[f"{name}/b"] = make_tiny_lora(
            base,
            root / name / "b",
            rank=4,
            alpha=8,
            use_rslora=True,
            seed=2,
            target_modules=["q_proj", "v_proj", "down_proj"],
        )
        out[f"{name}/c"] = make_tiny_lora(base, root / name / "c", rank=8, seed=3)
    return out


@functools.cache
def peft_greedy(
    base: str, adapter: str | None, prompt_ids: tuple[int, ...], dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers (+ PEFT's PeftModel for `adapter`) greedy tokens and per-step log-softmax rows (on the host), in
    `dtype`, on `device`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.to(device).eval()
    with torch.no_grad():
        mask = torch.ones(1, len(prompt_ids), dtype=torch.long, device=device)
        out = model.generate(
            torch.tensor([prompt_ids], device=device),
            attention_mask=mask,
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt_ids) :].tolist(), [s[0].float().log_softmax(-1).cpu() for s in out.logits]


def check_matches(base: Path, adapter: Path | None, prompt_ids: list[int], out, device: str = "cpu") -> None:
    """`out` (a RequestOutput) has PEFT's greedy tokens (PEFT on `device`), and each sampled logprob within 1e-4 of
    PEFT's."""
    tokens, rows = peft_greedy(str(base), None if adapter is None else str(adapter), tuple(prompt_ids), device=device)
    completion = out.outputs[0]
    assert completion.token_ids == tokens
    for step, token in enumerate(tokens):
        assert abs(completion.logprobs[step][token].logprob - rows[step][token].item()) < 1e-4


def ids_of(llm: LLM, prompts: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(p) for p in prompts]


def run(llm: LLM, ids: list[list[int]], loras) -> list:
    return llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, lora_request=loras, use_tqdm=False)


@pytest.fixture(scope="module")
def llm(bases: dict[str, Path]):
    engine = LLM(str(bases["llama"]), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=6)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_mixed_batch_matches_peft(bases, adapters, arch, device):
    """Base rows and two adapters (one rank-8 on every projection, one rank-4 rsLoRA on three) in one batch:
    each row equals transformers + PEFT on its own adapter (untied and tied heads, q/k/v bias, q/k norms), the
    engine and PEFT on `device`."""
    base = bases[arch]
    engine = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, device=device)
    try:
        a = LoRARequest("a", 1, str(adapters[f"{arch}/a"]))
        b = LoRARequest("b", 2, str(adapters[f"{arch}/b"]))
        loras = [a, None, b, a, b, None]
        ids = ids_of(engine, PROMPTS[:6])
        outs = run(engine, ids, loras)
        for prompt_ids, out, lora in zip(ids, outs, loras, strict=True):
            check_matches(base, None if lora is None else Path(lora.lora_path), prompt_ids, out, device)
            assert out.lora_name == (None if lora is None else lora.lora_name)
            assert out.outputs[0].lora_versions == ([] if lora is None else [(1, 0, TOKENS)])
        # the adapters change the model's distribution (else the comparison above would prove little)
        plain = run(engine, ids, None)
        for i in (0, 2):
            assert abs(plain[i].outputs[0].cumulative_logprob - outs[i].outputs[0].cumulative_logprob) > 1e-2
    finally:
        engine.shutdown()


def test_inplace_update_is_served_on_the_next_request(llm, bases, adapters):
    """vllm#42125: the same name reloaded with new weights serves them on the very next request, even for a
    prompt whose KV the old weights left in the prefix cache."""
    base, ids = bases["llama"], ids_of(llm, PROMPTS[3:4])
    request = LoRARequest("inplace", 11, str(adapters["llama/a"]))
    check_matches(base, adapters["llama/a"], ids[0], run(llm, ids, request)[0])
    again = run(llm, ids, LoRARequest("inplace", 11, str(adapters["llama/c"]), load_inplace=True))[0]
    assert again.num_cached_tokens > 0  # the old version's KV is cached ...
    check_matches(base, adapters["llama/a"], ids[0], again)  # a request never makes the engine re-read a folder
    llm.load_lora_adapter("inplace", str(adapters["llama/c"]), load_inplace=True)
    after = run(llm, ids, request)[0]
    assert after.num_cached_tokens == 0  # ... and never served to the new one
    check_matches(base, adapters["llama/c"], ids[0], after)
    assert after.outputs[0].lora_versions == [(2, 0, TOKENS)]
    assert next(d for d in llm.list_loras() if d["lora_name"] == "inplace")["version"] == 2
    llm.unload_lora_adapter("inplace")


def test_adapter_steps_never_replay_decode_graphs(llm, bases, adapters):
    """Decode graphs hold no adapter (cuda_graphs.py): a step whose rows use one runs the modules without asking
    the graphs; a base-only step asks them. Checked with a stand-in that holds nothing."""
    asked: list[list[int]] = []

    class Graphs:
        def applies(self, query_lens: list[int], block_tables: list[list[int]]) -> bool:
            asked.append(query_lens)
            return False

        def invalidate(self) -> None:
            pass

    ids = ids_of(llm, PROMPTS[2:3])
    llm.collective_rpc(lambda w: setattr(w.runner, "graphs", Graphs()))
    try:
        out = run(llm, ids, LoRARequest("graphs", 13, str(adapters["llama/a"])))[0]
        assert asked == []
        check_matches(bases["llama"], adapters["llama/a"], ids[0], out)
        run(llm, ids, None)
        assert len(asked) == TOKENS
    finally:
        llm.collective_rpc(lambda w: setattr(w.runner, "graphs", None))
        llm.unload_lora_adapter("graphs")


def test_prefix_cache_is_not_shared_between_base_and_adapter(llm, bases, adapters):
    base, ids = bases["llama"], ids_of(llm, PROMPTS[1:2])
    run(llm, ids, None)
    request = LoRARequest("isolated", 12, str(adapters["llama/a"]))
    out = run(llm, ids, request)[0]
    assert out.num_cached_tokens == 0
    check_matches(base, adapters["llama/a"], ids[0], out)
    assert run(llm, ids, request)[0].num_cached_tokens > 0  # its own KV is reused
    llm.unload_lora_adapter("isolated")


def live_peft_tensors(adapter: Path) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors as a trainer's live PeftModel names them ("lora_A.default.weight")."""
    _, tensors = read_folder(str(adapter))
    return [(n.replace(".weight", ".default.weight"), t.clone()) for n, t in tensors.items()]


@pytest.mark.parametrize("backend", ["tensors", "shm", "torch_dist"])
def test_session_update_over_a_transport_then_a_bad_tensor_rolls_back(llm, bases, adapters, backend):
    """A trainer pushes an adapter's new weights through the weight session (target "lora:<name>"), under its
    live PeftModel names; a later update with a wrong shape is refused and the adapter keeps serving the
    committed version."""
    base, ids = bases["llama"], ids_of(llm, PROMPTS[4:5])
    name = f"session-{backend}"
    llm.load_lora_adapter(name, str(adapters["llama/a"]))
    request = LoRARequest(name, llm.list_loras()[-1]["lora_int_id"])
    pusher = Pusher(llm, backend)
    try:
        llm.start_weight_update(target=f"lora:{name}")
        pusher.update(live_peft_tensors(adapters["llama/c"]))
        # nothing pauses while an adapter's next version loads: the base model and the adapter's current
        # version go on serving
        check_matches(base, None, ids[0], run(llm, ids, None)[0])
        check_matches(base, adapters["llama/a"], ids[0], run(llm, ids, request)[0])
        llm.finish_weight_update()
        check_matches(base, adapters["llama/c"], ids[0], run(llm, ids, request)[0])
        bad = live_peft_tensors(adapters["llama/a"])
        bad[0] = (bad[0][0], bad[0][1].t().contiguous())  # transposed: the wrong shape
        llm.start_weight_update(target=f"lora:{name}")
        with pytest.raises(ValueError, match="shape"):
            pusher.update(bad)
        check_matches(base, adapters["llama/c"], ids[0], run(llm, ids, request)[0])
        assert next(d for d in llm.list_loras() if d["lora_name"] == name)["version"] == 2
        # the base model's weight version never moved
        assert llm.get_weight_version() == 0
    finally:
        pusher.close()
        llm.unload_lora_adapter(name)


def test_reload_from_tensors_as_a_delta_with_a_base_version(llm, bases, adapters):
    """reload_weights(target="lora:<name>") from pairs, as an xor delta against the adapter's version: equal to
    the full update; a delta against another version is refused naming both, and nothing changes."""
    base, ids = bases["llama"], ids_of(llm, PROMPTS[5:6])
    llm.load_lora_adapter("delta", str(adapters["llama/a"]))
    request = LoRARequest("delta", llm.list_loras()[-1]["lora_int_id"])
    _, old = read_folder(str(adapters["llama/a"]))
    _, new = read_folder(str(adapters["llama/c"]))
    delta = [(n, xor_delta(old[n], new[n])) for n in old]
    with pytest.raises(ValueError, match=r"version 7.*version 1"):
        llm.reload_weights(weights_iterator=delta, target="lora:delta", encoding="xor", base_version=7)
    check_matches(base, adapters["llama/a"], ids[0], run(llm, ids, request)[0])
    llm.reload_weights(weights_iterator=delta, target="lora:delta", encoding="xor", base_version=1)
    check_matches(base, adapters["llama/c"], ids[0], run(llm, ids, request)[0])
    llm.unload_lora_adapter("delta")


def test_request_started_on_a_version_finishes_on_it(bases, adapters):
    """finish_on_old: a request running when its adapter is updated finishes on the version it started on
    (every token, and its version spans, say so); a request admitted after gets the new version; the old
    version leaves the workers once its last request ends. switch: the running request goes on with the new
    version, and its spans show where."""
    base = bases["llama"]
    for policy in ("finish_on_old", "switch"):
        engine = LLMEngine(_config(base, policy))
        tok_ids = engine.tokenizer.encode(PROMPTS[0])
        request = LoRARequest("live", 1, str(adapters["llama/a"]))
        engine.add_request("old", None, tok_ids, GREEDY, lora_request=request)
        while len(engine.requests["old"].seqs[0].output_token_ids) < 3:
            engine.step()
        _, new = read_folder(str(adapters["llama/c"]))
        engine.weights.reload_weights(weights_iterator=list(new.items()), target="lora:live")
        engine.add_request("new", None, tok_ids, GREEDY, lora_request=request)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
        old_tokens, _ = peft_greedy(str(base), str(adapters["llama/a"]), tuple(tok_ids))
        new_tokens, _ = peft_greedy(str(base), str(adapters["llama/c"]), tuple(tok_ids))
        assert done["new"].outputs[0].token_ids == new_tokens
        assert done["new"].outputs[0].lora_versions == [(2, 0, TOKENS)]
        spans = done["old"].outputs[0].lora_versions
        if policy == "finish_on_old":
            assert done["old"].outputs[0].token_ids == old_tokens
            assert spans == [(1, 0, TOKENS)]
        else:
            assert done["old"].outputs[0].token_ids[:3] == old_tokens[:3]
            assert spans[0] == (1, 0, 3) and spans[-1][0] == 2 and spans[-1][2] == TOKENS
        assert engine.loras is not None and engine.loras.held() == 1  # version 1 was dropped
        engine.shutdown()


def _config(base: Path, policy: str):
    from hotswap.config import EngineConfig

    return EngineConfig.from_kwargs(
        str(base), enable_lora=True, max_loras=2, max_cpu_loras=2, lora_version_policy=policy
    )


def test_more_adapters_than_max_loras_in_one_generate(bases, adapters, tmp_path):
    """Three adapters and the base with max_loras=2: a step never uses more than two adapter versions, and every
    row still gets its own adapter's output."""
    base = bases["llama"]
    extra = make_tiny_lora(base, tmp_path / "d", rank=2, seed=4, target_modules=["o_proj", "up_proj"])
    engine = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    try:
        paths = [adapters["llama/a"], adapters["llama/b"], extra]
        loras = [LoRARequest(f"n{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        per_row = [loras[0], loras[1], loras[2], None, loras[2], loras[0]]
        ids = ids_of(engine, PROMPTS[:6])
        seen: list[int] = []
        scheduler = engine.llm_engine.scheduler
        schedule = scheduler.schedule

        def counting(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if out is not None:
                seen.append(len({s.request.lora.uid for s in out.seqs if s.request.lora is not None}))
            return out

        scheduler.schedule = counting
        outs = run(engine, ids, per_row)
        assert max(seen) == 2
        for prompt_ids, out, lora in zip(ids, outs, per_row, strict=True):
            check_matches(base, None if lora is None else Path(lora.lora_path), prompt_ids, out)
    finally:
        engine.shutdown()


def test_bad_adapters_are_refused_and_change_nothing(llm, bases, adapters, tmp_path):
    base, ids = bases["llama"], ids_of(llm, PROMPTS[2:3])
    llm.load_lora_adapter("kept", str(adapters["llama/a"]))
    before = llm.list_loras()
    wide = make_tiny_lora(base, tmp_path / "wide", rank=16, seed=5)
    _, tensors = read_folder(str(adapters["llama/a"]))
    unknown = {n.replace("q_proj", "nonexistent_proj"): t for n, t in tensors.items()}
    nan = {n: t.clone() for n, t in tensors.items()}
    next(iter(nan.values()))[0, 0] = float("nan")
    cases = [
        (lambda: llm.load_lora_adapter("x", str(tmp_path / "missing")), "not a folder"),
        (lambda: llm.load_lora_adapter("x", str(wide)), "exceeds max_lora_rank=8"),
        (
            lambda: llm.load_lora_adapter("x", tensors=unknown, peft_config={"r": 8, "lora_alpha": 16}),
            "nonexistent_proj",
        ),
        (lambda: llm.load_lora_adapter("x", tensors=nan, peft_config={"r": 8, "lora_alpha": 16}), "NaN"),
        (lambda: llm.load_lora_adapter("kept", str(adapters["llama/c"])), "already loaded"),
        (
            lambda: llm.load_lora_adapter("x", str(adapters["llama/a"]), lora_int_id=before[0]["lora_int_id"]),
            "already used",
        ),
        (lambda: llm.generate("hi", GREEDY, lora_request=LoRARequest("absent", 99), use_tqdm=False), "not loaded"),
        (
            lambda: llm.reload_weights(weights_iterator=[(n, t[:1]) for n, t in tensors.items()], target="lora:kept"),
            "shape",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert llm.list_loras() == before
    check_matches(base, adapters["llama/a"], ids[0], run(llm, ids, LoRARequest("kept", before[-1]["lora_int_id"]))[0])
    # the room for adapter versions (max_cpu_loras=6) runs out with a clear error, and nothing changes
    names = []
    with pytest.raises(ValueError, match="max_cpu_loras=6"):
        for i in range(6):
            llm.load_lora_adapter(f"fill{i}", str(adapters["llama/b"]))
            names.append(f"fill{i}")
    for name in names:
        llm.unload_lora_adapter(name)
    llm.unload_lora_adapter("kept")
    assert llm.list_loras() == []
    plain = LLM(str(base))
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            plain.generate("hi", GREEDY, lora_request=LoRARequest("a", 1, str(adapters["llama/a"])), use_tqdm=False)
    finally:
        plain.shutdown()


def test_two_ranks_equal_one(bases, adapters):
    """Tensor parallelism: lora_B of column-parallel layers and lora_A of row-parallel ones are split like their
    base layers (the rank-sized partial products summed across ranks): two ranks give PEFT's tokens too, and a
    session update reaches both ranks."""
    base = bases["llama"]
    engine = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, tensor_parallel_size=2)
    try:
        ids = ids_of(engine, PROMPTS[:3])
        a = LoRARequest("a", 1, str(adapters["llama/a"]))
        b = LoRARequest("b", 2, str(adapters["llama/b"]))
        loras = [a, b, None]
        for prompt_ids, out, lora in zip(ids, run(engine, ids, loras), loras, strict=True):
            check_matches(base, None if lora is None else Path(lora.lora_path), prompt_ids, out)
        _, new = read_folder(str(adapters["llama/c"]))
        engine.reload_weights(weights_iterator=list(new.items()), target="lora:a")
        check_matches(base, adapters["llama/c"], ids[0], run(engine, ids[:1], a)[0])
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_mixture_of_experts_adapters_match_peft(arch, tmp_path):
    """A PEFT adapter of a mixture-of-experts model adapts its experts too (PEFT's `target_parameters` on the
    fused expert weights, with the doubled rank and alpha of gate_up in `rank_pattern` / `alpha_pattern`), beside
    attention and, for Qwen2-MoE, the shared expert's projections: base and adapter rows in one batch equal
    transformers + PEFT; an update from tensors reaches the experts (Qwen2-MoE's experts are named as PEFT
    parameters explicitly: PEFT's defaults adapt only its shared expert there)."""
    base = make_tiny_model(tmp_path / "base", arch)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if arch == "qwen2_moe" else None
    first = make_tiny_lora(base, tmp_path / "a", rank=4, seed=1, target_parameters=experts)
    second = make_tiny_lora(base, tmp_path / "b", rank=4, seed=2, target_parameters=experts)
    config, tensors = read_folder(str(first))
    assert config["target_parameters"] and any(".experts." in n for n in tensors)  # the experts are adapted
    engine = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        ids = ids_of(engine, PROMPTS[:3])
        request = LoRARequest("moe", 1, str(first))
        loras = [request, None, request]
        for prompt_ids, out, lora in zip(ids, run(engine, ids, loras), loras, strict=True):
            check_matches(base, None if lora is None else first, prompt_ids, out)
        _, new = read_folder(str(second))
        engine.reload_weights(
            weights_iterator=[(n, t) for n, t in new.items() if ".experts." in n], target="lora:moe"
        )  # the experts' factors only
        mixed = tmp_path / "mixed"
        mixed.mkdir()
        (mixed / "adapter_config.json").write_text((first / "adapter_config.json").read_text())
        from safetensors.torch import save_file

        save_file(
            {n: (new[n] if ".experts." in n else t).contiguous() for n, t in tensors.items()},
            str(mixed / "adapter_model.safetensors"),
        )
        check_matches(base, mixed, ids[0], run(engine, ids[:1], request)[0])
    finally:
        engine.shutdown()


def test_bfloat16_adapters_match_peft_in_bfloat16(bases, adapters):
    """In bfloat16 (the adapters' factors in float32, as PEFT keeps them), for adapter rows beside base rows: the
    engine's prompt logprobs of transformers + PEFT's bfloat16 greedy continuation are within 0.2 of PEFT's own at
    every step (teacher-forced: a tiny random model's near-ties, which bf16 rounding may flip either way, do not
    end the comparison), and the adapter moves them (the base model's differ by more)."""
    base = bases["llama"]
    engine = LLM(str(base), dtype="bfloat16", enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        ids = ids_of(engine, PROMPTS[:4])
        request = LoRARequest("a", 1, str(adapters["llama/a"]))
        loras = [request, None, request, request]
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        worst, moved = 0.0, 0.0
        for prompt_ids, lora in zip(ids, loras, strict=True):
            adapter = None if lora is None else lora.lora_path
            tokens, rows = peft_greedy(str(base), adapter, tuple(prompt_ids), torch.bfloat16)
            out = engine.generate(
                [{"prompt_token_ids": prompt_ids + tokens}], scoring, lora_request=lora, use_tqdm=False
            )[0]
            scored = out.prompt_logprobs[len(prompt_ids) :]
            for step, token in enumerate(tokens):
                worst = max(worst, abs(scored[step][token].logprob - rows[step][token].item()))
            if lora is not None:  # the same continuation scored by the base model
                plain = engine.generate([{"prompt_token_ids": prompt_ids + tokens}], scoring, use_tqdm=False)[0]
                moved = max(
                    moved,
                    *(
                        abs(plain.prompt_logprobs[len(prompt_ids) + j][t].logprob - scored[j][t].logprob)
                        for j, t in enumerate(tokens)
                    ),
                )
        assert worst < 0.2
        assert moved > 0.5
    finally:
        engine.shutdown()


def test_an_open_lora_session_is_not_disturbed(llm, bases, adapters):
    """While an adapter's session is open: reloading an adapter is refused and unloading this one too, each
    changing nothing (the session still commits its update); a transport shut down mid-session drops the
    adapter's next version, and a model session afterwards runs as one (its version advances)."""
    base, ids = bases["llama"], ids_of(llm, PROMPTS[6:7])
    llm.load_lora_adapter("open", str(adapters["llama/a"]))
    request = LoRARequest("open", llm.list_loras()[-1]["lora_int_id"])
    held = llm.llm_engine.loras.held()
    pusher = Pusher(llm, "tensors")
    try:
        llm.start_weight_update(target="lora:open")
        _, new = read_folder(str(adapters["llama/b"]))
        with pytest.raises(RuntimeError, match="session is open"):
            llm.reload_weights(weights_iterator=list(new.items()), target="lora:open")
        with pytest.raises(ValueError, match="open update session"):
            llm.unload_lora_adapter("open")
        pusher.update(live_peft_tensors(adapters["llama/c"]))
        llm.finish_weight_update()
        check_matches(base, adapters["llama/c"], ids[0], run(llm, ids, request)[0])
        assert llm.llm_engine.loras.held() == held
        llm.start_weight_update(target="lora:open")
        llm.shutdown_weight_transfer_engine()  # the trainer went away mid-session
        assert llm.llm_engine.loras.held() == held
        check_matches(base, adapters["llama/c"], ids[0], run(llm, ids, request)[0])
        from safetensors.torch import load_file

        pusher.connect()
        version = llm.get_weight_version()
        llm.start_weight_update()
        pusher.update(list(load_file(str(base / "model.safetensors")).items()))  # the same weights, a new version
        llm.finish_weight_update()
        assert llm.get_weight_version() == version + 1
        check_matches(base, adapters["llama/c"], ids[0], run(llm, ids, request)[0])
    finally:
        pusher.close()
        llm.unload_lora_adapter("open")
