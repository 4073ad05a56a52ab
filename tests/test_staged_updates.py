"""Staged updates (`update_staging="shadow"`): every update form is received into staging copies while requests
keep generating on the served version; the commit swaps them in between two steps; a failure or an abort drops
them, the served weights bit-identical throughout."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from conftest import PROMPTS, hf_greedy, serves
from hotswap import LLM, SamplingParams
from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.transfer.delta import xor_delta
from hotswap.transfer.tensors import tensors_update_info
from hotswap.weights.checksum import tensor_sha256
from transfer_helpers import BACKENDS, Pusher

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def staged_llm(path, **kw) -> LLM:
    return LLM(str(path), update_staging="shadow", kv_cache_memory_bytes=1 << 23, **kw)


def pool_and_weights(worker) -> tuple[int, int]:
    """Elements held by the staging pool, and the model's (each tied weight once)."""
    return (sum(t.numel() for t in worker.session.shadows.values()), sum(p.numel() for p in worker.model.parameters()))


def params_of(llm: LLM) -> dict[str, torch.Tensor]:
    (state,) = llm.collective_rpc("export_state")
    return state


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_session_streams_beside_running_requests_and_commits_between_steps(ckpts, b_tensors):
    """Requests started on A run while B is received (no pause); they keep A's tokens until the commit, then
    continue on B, and the per-token versions say where the change landed. After the commit the engine serves B
    exactly (transformers' greedy tokens)."""
    llm = staged_llm(ckpts["A"])
    tok = llm.get_tokenizer()
    engine = llm.llm_engine
    ids = tok.encode(PROMPTS[0])
    engine.add_request("r0", None, ids, GREEDY)
    for _ in range(8):
        engine.step()
    before = params_of(llm)
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()  # no pause: refused in place, accepted staged
    llm.update_weights(tensors_update_info(b_tensors))
    assert identical(params_of(llm), before), "the served weights changed before the commit"
    steps_between = 0
    for _ in range(6):  # generation goes on, on A
        engine.step()
        steps_between += 1
    llm.finish_weight_update()
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
    assert out is not None
    tokens, versions = out.outputs[0].token_ids, out.outputs[0].weight_versions
    a_tokens = hf_greedy(str(ckpts["A"]), tuple(ids), 40)[0]
    assert [(s.version, s.start_token, s.end_token) for s in versions] == [
        (0, 0, versions[0].end_token),
        (1, versions[0].end_token, 40),
    ]
    switch = versions[0].end_token
    assert tokens[:switch] == a_tokens[:switch], "tokens before the commit are A's"
    assert switch >= 8 + steps_between, "the commit landed before the steps that ran while staging"
    assert serves(llm, ckpts["B"])
    b = dict(b_tensors)
    assert identical({k: v for k, v in params_of(llm).items() if k in b}, {k: b[k] for k in b if k in before})


def test_failure_and_abort_drop_the_staging_copy_and_leave_the_served_weights_bitwise(ckpts, b_tensors):
    llm = staged_llm(ckpts["A"])
    before = params_of(llm)
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    bad = [(n, t.clone()) for n, t in b_tensors]
    bad[-1][1].view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match="staged: the served weights were never written"):
        llm.update_weights(tensors_update_info(bad))
    assert identical(params_of(llm), before)
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(b_tensors[:5]))
    llm.abort_weight_update()
    assert identical(params_of(llm), before)
    assert serves(llm, ckpts["A"])
    (held, weights) = llm.collective_rpc(pool_and_weights)[0]
    assert held == weights, "after a failure or an abort, the reservation (one copy of the weights) and no more"
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(b_tensors))
    llm.finish_weight_update()
    assert serves(llm, ckpts["B"])
    (held, weights) = llm.collective_rpc(pool_and_weights)[0]
    assert held == weights, "after a full commit the pool holds the previous weights, to stage the next update"


def test_reloads_deltas_checksums_and_the_canary_are_staged(ckpts, b_tensors, tmp_path):
    """A folder reload, an xor delta with the trainer's checksums, and a session checked by a canary all commit
    only once received and checked; a canary that fails leaves the served weights as they were."""
    llm = staged_llm(ckpts["A"])
    llm.reload_weights(weights_path=str(ckpts["B"]))
    assert serves(llm, ckpts["B"]) and llm.llm_engine.weight_version == 1
    a = load_file(str(ckpts["A"] / "model.safetensors"))
    b = dict(b_tensors)
    delta = {n: xor_delta(b[n], a[n]) for n in a}
    llm.reload_weights(
        weights_iterator=list(delta.items()), encoding="xor", checksums={n: tensor_sha256(t) for n, t in a.items()}
    )
    assert serves(llm, ckpts["A"])
    before = params_of(llm)
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(b_tensors))
    tok = llm.get_tokenizer()
    probe = tok.encode(PROMPTS[1])[:6]
    with pytest.raises(ValueError, match="canary"):
        llm.finish_weight_update(canary={"token_ids": [probe], "max_nll": 1e-6})
    assert identical(params_of(llm), before)
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(b_tensors))
    llm.finish_weight_update(canary={"token_ids": [probe], "max_nll": 1e9})
    assert serves(llm, ckpts["B"])


def test_the_serving_engine_alternates_slices_with_steps(ckpts):
    """AsyncLLMEngine: a staged reload from a folder is received in slices between the steps of a running
    stream: tokens keep arriving while the reload call runs, on A until the commit and on B after it."""

    async def run() -> tuple[list[float], float, float, list]:
        engine = AsyncLLMEngine.from_kwargs(
            str(ckpts["A"]), update_staging="shadow", staging_slice_ms=0.001, kv_cache_memory_bytes=1 << 23
        )
        tok = engine.tokenizer
        times: list[float] = []
        spans: list = []
        loop = asyncio.get_running_loop()

        async def stream() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            async for out in engine.generate({"prompt_token_ids": tok.encode(PROMPTS[0])}, params, "s"):
                times.append(loop.time())
                spans[:] = out.outputs[0].weight_versions

        task = asyncio.create_task(stream())
        while len(times) < 5:
            await asyncio.sleep(0.001)
        start = loop.time()
        await engine.reload_weights(weights_path=str(ckpts["B"]))
        end = loop.time()
        await task
        await engine.shutdown()
        return times, start, end, spans

    times, start, end, spans = asyncio.run(run())
    during = sum(start < t < end for t in times)
    assert during >= 5, f"only {during} tokens arrived while the staged reload was received"
    assert [s.version for s in spans] == [0, 1] and spans[0].end_token > 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_transport_is_staged_and_a_bad_push_changes_nothing(ckpts, b_tensors, backend):
    """Each transport's session (tensors, shm, torch_dist, disk) lands in the staging copies: served weights
    bit-identical until finish; a push with a NaN fails (rolled back: dropped), the next one commits."""
    llm = staged_llm(ckpts["A"])
    before = params_of(llm)
    pusher = Pusher(llm, backend)
    try:
        llm.start_weight_update()
        bad = [(n, t.clone()) for n, t in b_tensors]
        bad[2][1].view(-1)[0] = float("inf")
        with pytest.raises(ValueError, match="never written"):
            pusher.update(bad)
        assert identical(params_of(llm), before)
        if backend == "torch_dist":  # a failed torch_dist session closes its channel
            pusher.connect()
        llm.start_weight_update()
        pusher.update(b_tensors)
        assert identical(params_of(llm), before)
        assert serves(llm, ckpts["A"])  # generation goes on, on the served version, between update and finish
        llm.finish_weight_update()
        assert serves(llm, ckpts["B"])
    finally:
        pusher.close()


def test_staging_that_does_not_fit_is_refused_before_anything_is_allocated(ckpts, b_tensors, monkeypatch):
    """The staging copies are reserved when the model loads (refused there with the reason when they do not
    fit); after sleep released them, an update that cannot stage is refused before anything moves."""
    monkeypatch.setattr("hotswap.weights.shadow._free_bytes", lambda device: 1000)
    with pytest.raises(MemoryError, match=r"needs .* MiB more for the staging copies"):
        staged_llm(ckpts["A"])
    monkeypatch.undo()
    llm = staged_llm(ckpts["A"])
    (held, weights) = llm.collective_rpc(pool_and_weights)[0]
    assert held == weights, "one copy of the weights reserved at start"
    llm.sleep(1)
    llm.wake_up()
    before = params_of(llm)
    monkeypatch.setattr("hotswap.weights.shadow._free_bytes", lambda device: 1000)
    with pytest.raises(RuntimeError, match=r"needs .* MiB more for the staging copies"):
        llm.reload_weights(weights_iterator=b_tensors)
    (pool,) = llm.collective_rpc(lambda worker: len(worker.session.shadows))
    assert pool == 0
    assert identical(params_of(llm), before)
    monkeypatch.undo()
    llm.reload_weights(weights_iterator=b_tensors)
    assert serves(llm, ckpts["B"])


@pytest.mark.cpu_only  # a server process
def test_a_staged_server_takes_a_push_mid_stream_without_a_pause(ckpts, b_tensors):
    """`hotswap serve --update-staging shadow`: a trainer pushes over shm with no pause while completions stream;
    the stream running at the commit goes on through it (its version spans cross it), and the engine then holds
    B's tensors. Streams are kept running, each next one started when the previous one is halfway, until the push
    returned: whatever the push takes on a loaded machine, one of them spans the commit."""
    import threading

    import openai

    from hotswap.entrypoints.client import AdminClient
    from hotswap.testing import running_server
    from hotswap.weights.checksum import tensor_sha256

    args = ("--admin-key", "k", "--update-staging", "shadow", "--kv-cache-memory-bytes", str(1 << 23))
    with running_server(str(ckpts["A"]), *args) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        admin = AdminClient(base, admin_key="k")
        try:
            model = client.models.list().data[0].id
            finished: list[tuple[list, str | None]] = []  # (spans, finish reason) of each stream

            def stream(started: threading.Event, halfway: threading.Event) -> None:
                chunks = client.completions.create(
                    model=model,
                    prompt=PROMPTS[2],
                    max_tokens=900,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True, "return_weight_versions": True},
                )
                spans: list = []
                reason = None
                for count, chunk in enumerate(chunks):
                    started.set()
                    if count == 450:
                        halfway.set()
                    spans = chunk.choices[0].model_extra["weight_versions"]  # the whole output's, so far
                    reason = chunk.choices[0].finish_reason or reason
                halfway.set()
                finished.append((spans, reason))

            pushed: list[str] = []
            push_done = threading.Event()
            pusher = threading.Thread(
                target=lambda: (
                    pushed.append(admin.push_weights(b_tensors, backend="shm", pause_mode=None, weight_version="s1")),
                    push_done.set(),
                )
            )
            streams: list[threading.Thread] = []
            while not push_done.is_set() and len(streams) < 50:
                started, halfway = threading.Event(), threading.Event()
                streams.append(threading.Thread(target=stream, args=(started, halfway)))
                streams[-1].start()
                assert started.wait(timeout=60), "a stream produced no token"
                if not pusher.is_alive() and not pushed:
                    pusher.start()
                assert halfway.wait(timeout=120)
            pusher.join(timeout=120)
            for thread in streams:
                thread.join(timeout=120)
            assert pushed == ["s1"]
            assert not admin.is_paused()
            assert len(finished) == len(streams) and all(reason == "length" for _, reason in finished)
            versions = [[s["version"] for s in spans] for spans, _ in finished]
            crossed = [spans for (spans, _), v in zip(finished, versions, strict=True) if v == ["0", "s1"]]
            assert crossed, f"no stream ran on through the staged update: {versions}"
            assert all(v in (["0"], ["0", "s1"], ["s1"]) for v in versions), versions
            assert 0 < crossed[0][0]["end"] < 900
            assert admin.checksums() == {n: tensor_sha256(t) for n, t in b_tensors}
        finally:
            admin.close()


@pytest.mark.cpu_only  # Ray
def test_a_fleet_of_staged_replicas_prepares_beside_serving_and_commits_or_rolls_back(ckpts, b_tensors, tmp_path):
    """Two staged replicas: a fleet reload prepares into each replica's staging copies and commits on both; a
    reload with a NaN fails in the prepare phase and changes neither; the fleet serves B throughout."""
    pytest.importorskip("ray")
    from hotswap.fleet import Fleet

    fleet = LLM.create(
        str(ckpts["A"]),
        data_parallel_size=2,
        distributed_executor_backend="ray",
        num_gpus_per_worker=0,
        ray_init_kwargs={"num_cpus": 2, "object_store_memory": 256 << 20},
        update_staging="shadow",
        kv_cache_memory_bytes=1 << 23,
    )
    try:
        assert isinstance(fleet, Fleet)
        fleet.reload_weights(weights_path=str(ckpts["B"]))
        sums = fleet.collective_rpc("weight_checksums")
        assert len(sums) == 2 and sums[0] == sums[1]
        bad = [(n, t.clone()) for n, t in b_tensors]
        bad[0][1].view(-1)[1] = float("nan")
        with pytest.raises(Exception, match="NaN"):
            fleet.reload_weights(weights_iterator=bad)
        assert fleet.collective_rpc("weight_checksums") == sums
        assert serves(fleet, ckpts["B"])
    finally:
        fleet.shutdown()


def test_a_lora_reload_is_received_in_slices_between_steps(ckpts, tmp_path, monkeypatch):
    """AsyncLLMEngine: an adapter's next version (tensors) is received in slices between the steps of a stream
    running on that adapter, then served; one with NaNs is dropped, the adapter unchanged: its values were checked
    in groups (of a few KiB here), one per slice, all before the first write, and both bad tensors are named."""
    import hotswap.weights.update as update_module
    from hotswap.lora.request import LoRARequest
    from hotswap.testing import make_tiny_lora

    passes: list[int] = []
    check = update_module.non_finite_names

    def counted(pairs, limit):
        passes.append(len(pairs))
        return check(pairs, limit)

    monkeypatch.setattr(update_module, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(update_module, "non_finite_names", counted)

    first = make_tiny_lora(ckpts["A"], tmp_path / "v1", rank=8, seed=1)
    second = make_tiny_lora(ckpts["A"], tmp_path / "v2", rank=8, seed=2)
    new = list(load_file(str(second / "adapter_model.safetensors")).items())
    lora = LoRARequest("a", 1, str(first))

    async def run() -> tuple[int, list[int]]:
        engine = AsyncLLMEngine.from_kwargs(
            str(ckpts["A"]),
            enable_lora=True,
            max_lora_rank=8,
            max_cpu_loras=4,
            staging_slice_ms=0.001,
            kv_cache_memory_bytes=1 << 23,
        )
        tok = engine.tokenizer
        times: list[float] = []
        loop = asyncio.get_running_loop()
        params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

        async def stream() -> None:
            async for _ in engine.generate(
                {"prompt_token_ids": tok.encode(PROMPTS[0])}, params, "s", lora_request=lora
            ):
                times.append(loop.time())

        task = asyncio.create_task(stream())
        while len(times) < 5:
            await asyncio.sleep(0.001)
        start = loop.time()
        await engine.reload_weights(target="lora:a", weights_iterator=new)
        end = loop.time()
        await task
        bad = [(n, t.clone()) for n, t in new]
        bad[0][1].view(-1)[0] = bad[-1][1].view(-1)[0] = float("nan")
        passes.clear()
        with pytest.raises(ValueError, match="NaN") as caught:
            await engine.reload_weights(target="lora:a", weights_iterator=bad)
        assert bad[0][0] in str(caught.value) and bad[-1][0] in str(caught.value)
        assert len(passes) > 2 and sum(passes) == len(bad), passes
        short = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = [
            o
            async for o in engine.generate({"prompt_token_ids": tok.encode(PROMPTS[1])}, short, "t", lora_request=lora)
        ]
        await engine.shutdown()
        return sum(start < t < end for t in times), outs[-1].outputs[0].token_ids

    during, tokens = asyncio.run(run())
    assert during >= 3, f"only {during} tokens arrived while the adapter was received"
    reference = LLM(str(ckpts["A"]), enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=1 << 23)
    expected = reference.generate(
        [{"prompt_token_ids": reference.get_tokenizer().encode(PROMPTS[1])}],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        lora_request=LoRARequest("a", 1, str(second)),
        use_tqdm=False,
    )
    assert tokens == expected[0].outputs[0].token_ids, "the adapter serves its second version after the NaN"
