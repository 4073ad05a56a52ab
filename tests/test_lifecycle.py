"""The engine's lifecycle as one state machine, and weight changes that are all-or-nothing: across worker
processes (two-phase commit), and when something fails where nothing was expected to."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import PROMPTS, hf_greedy, serves
from hotswap import LLM, EngineConfig, SamplingParams
from hotswap.engine.async_llm_engine import AsyncLLMEngine
from hotswap.engine.state import EngineState
from hotswap.errors import EngineUnavailable
from hotswap.testing import make_tiny_model
from hotswap.transfer.base import declare
from hotswap.transfer.tensors import tensors_update_info
from transfer_helpers import Pusher, free_port

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_generate_on_a_paused_engine_fails_fast_and_a_frozen_call_is_bounded(ckpts):
    """A synchronous generate never waits on a pause for ever: a new call is refused at once, and one that a pause
    froze from another thread gives up after rpc_timeout_s, its requests aborted. The pause gets the lock at the
    next step: the step loop never keeps a thread that asks for it waiting (Python's locks are not fair)."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, rpc_timeout_s=1)
    llm.pause_generation("keep")
    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match="resume_generation"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 5 and not llm.llm_engine.requests
    llm.resume_generation()
    box: dict = {}
    step, overtaken = llm.llm_engine.step, []

    def watched_step():  # a step that begins while another thread asks for the lock overtook that thread
        overtaken.append(llm._lock.waiting > 0)
        return step()

    llm.llm_engine.step = watched_step

    def run() -> None:
        try:
            llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True), use_tqdm=False)
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not llm.llm_engine.requests:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    llm.pause_generation("keep")  # handed the lock before the step loop's next step, not after the generation
    thread.join(timeout=30)
    assert sum(overtaken) <= 1, f"{sum(overtaken)} steps overtook a waiting pause"  # at most the one checked first
    assert not thread.is_alive() and isinstance(box.get("error"), TimeoutError), box
    assert "rpc_timeout_s" in str(box["error"]) and not llm.llm_engine.requests
    llm.resume_generation()
    assert serves(llm, ckpts["A"])


def test_state_moves_with_the_lifecycle(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    engine = llm.llm_engine
    assert engine.state is EngineState.RUNNING
    llm.pause_generation("keep")
    assert engine.state is EngineState.PAUSED and llm.is_paused()
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    assert engine.state is EngineState.UPDATING and llm.is_paused()
    llm.update_weights(tensors_update_info(b_tensors))
    llm.finish_weight_update()
    assert engine.state is EngineState.PAUSED
    llm.resume_generation()
    assert engine.state is EngineState.RUNNING and serves(llm, ckpts["B"])
    # sleeping deeper while asleep, then the documented restore
    llm.sleep(1)
    llm.sleep(2)
    assert engine.state is EngineState.ASLEEP and engine.released == {"kv_cache", "weights"}
    llm.wake_up(["weights"])
    llm.reload_weights(weights_path=str(ckpts["A"]))
    llm.wake_up(["kv_cache"])
    assert engine.state is EngineState.RUNNING and serves(llm, ckpts["A"])


def test_wake_up_during_an_update_returns_to_serving(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    llm.sleep(2)
    llm.wake_up(["weights"])
    llm.init_weight_transfer_engine({"backend": "tensors"})
    llm.start_weight_update()
    llm.update_weights(tensors_update_info(b_tensors))
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # the KV cache is still released
    llm.wake_up(["kv_cache"])
    llm.finish_weight_update()
    assert llm.llm_engine.state is EngineState.RUNNING and serves(llm, ckpts["B"])


def test_abort_without_an_open_update_keeps_the_prefix_cache(ckpts):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    prompt = {"prompt_token_ids": list(range(3, 60))}
    llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.abort_weight_update()  # nothing open: nothing to do
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens > 0


def test_a_request_sent_during_an_update_runs_after_it(ckpts, b_tensors):
    async def main() -> list[int]:
        engine = AsyncLLMEngine(EngineConfig.from_kwargs(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22))
        await engine.init_weight_transfer_engine({"backend": "tensors"})
        await engine.start_weight_update()

        async def request() -> list[int]:
            async for out in engine.generate(PROMPTS[0], GREEDY):
                if out.finished:
                    return out.outputs[0].token_ids
            raise AssertionError("no final output")

        task = asyncio.create_task(request())
        await asyncio.sleep(0.2)
        assert not task.done()  # no step runs while the session is open
        await engine.update_weights(tensors_update_info(b_tensors))
        await engine.finish_weight_update()
        tokens = await asyncio.wait_for(task, 30)
        await engine.shutdown()
        return tokens

    tok_path = str(ckpts["B"])
    tokens = asyncio.run(main())
    llm_tok = LLM(str(ckpts["B"]), kv_cache_memory_bytes=1 << 22).get_tokenizer()
    assert tokens == hf_greedy(tok_path, tuple(llm_tok.encode(PROMPTS[0])), 8)[0]


def test_unexpected_failure_after_an_uncopied_write_invalidates_the_weights(ckpts, b_tensors, monkeypatch):
    """A one-shot in-memory reload writes without rollback copies, as nothing is expected to fail after its
    first write. If something does (here: a layer's loader raising), the engine says so and refuses to generate
    until a successful reload, rather than serving a mix of weights as if restored."""
    from hotswap.model.layers.linear import Linear

    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    calls = []
    real = Linear.load_weight

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise MemoryError("simulated")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Linear, "load_weight", failing)
    with pytest.raises(Exception, match=r"without rollback copies.*refuses to generate"):
        llm.reload_weights(weights_iterator=b_tensors)
    monkeypatch.setattr(Linear, "load_weight", real)
    with pytest.raises(RuntimeError, match="inconsistent"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.reload_weights(weights_path=str(ckpts["A"]))
    assert serves(llm, ckpts["A"])


def test_tensors_the_loaders_cannot_read_are_refused_before_any_write(ckpts, b_tensors):
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    before = llm.weight_checksums()
    sparse = [(n, t.to_sparse() if n == "model.layers.0.mlp.down_proj.weight" else t) for n, t in b_tensors]
    with pytest.raises(ValueError, match=r"down_proj.*dense tensor"):
        llm.reload_weights(weights_iterator=sparse)
    assert llm.weight_checksums() == before


def test_fp8_values_beyond_the_stage_dtype_are_refused(tmp_path):
    path = make_tiny_model(tmp_path / "half", dtype="float16")
    llm = LLM(str(path), kv_cache_memory_bytes=1 << 22, quantization="fp8")
    before = llm.weight_checksums()
    weight = load_file(str(path / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].float()
    weight[0, 0] = 1e5  # finite in float32, inf in the float16 stage
    with pytest.raises(ValueError, match=r"NaN or Inf.*down_proj"):
        llm.reload_weights(weights_iterator=[("model.layers.0.mlp.down_proj.weight", weight)])
    assert llm.weight_checksums() == before


def test_a_new_folder_in_another_dtype_keeps_the_engine_dtype(ckpts, tmp_path):
    half = make_tiny_model(tmp_path / "B16", seed=1, dtype="float16")
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    llm.reload_weights(weights_path=str(half))
    assert llm.config.model_config.torch_dtype == torch.float32 and llm.config.model_config.model == str(half)
    llm.sleep(1)
    llm.wake_up()
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


@pytest.mark.slow
def test_worker_processes_change_together_or_not_at_all(ckpts, b_tensors):
    """A failure on one rank (a reload, or post-processing at finish) rolls every rank back: no rank keeps new
    weights while another has the old ones."""
    tp2 = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, tensor_parallel_size=2, rpc_timeout_s=60)
    before = tp2.collective_rpc("weight_checksums")

    def break_rank1(module_path: str):
        def patch(worker):
            if worker.rank == 1:
                module = worker.model.get_submodule(module_path)

                def boom():
                    raise RuntimeError("rank 1 post-processing failed")

                module.process_weights_after_loading = boom

        return patch

    def heal(worker):
        for module in worker.model.modules():
            module.__dict__.pop("process_weights_after_loading", None)

    tp2.collective_rpc(break_rank1("model.layers.1.mlp.down_proj"))
    with pytest.raises(RuntimeError, match="rank 1 post-processing failed"):
        tp2.reload_weights(weights_path=str(ckpts["B"]))
    assert tp2.collective_rpc("weight_checksums") == before
    assert tp2.config.model_config.model == str(ckpts["A"])
    assert tp2.collective_rpc(lambda w: w.config.model_config.model) == [str(ckpts["A"])] * 2

    tp2.collective_rpc(heal)
    tp2.collective_rpc(break_rank1("model.layers.0.self_attn.qkv_proj"))
    tp2.init_weight_transfer_engine({"backend": "tensors"})
    tp2.start_weight_update()
    q_only = [(n, t) for n, t in b_tensors if n != "model.layers.0.self_attn.k_proj.weight"]
    tp2.update_weights(tensors_update_info(q_only))  # qkv_proj of layer 0 waits for finish
    with pytest.raises(RuntimeError, match="rank 1 post-processing failed"):
        tp2.finish_weight_update()
    assert tp2.collective_rpc("weight_checksums") == before
    tp2.collective_rpc(heal)
    tp2.reload_weights(weights_path=str(ckpts["B"]))
    assert tp2.collective_rpc("weight_checksums")[0] != before[0] and serves(tp2, ckpts["B"])
    tp2.shutdown()


def test_an_update_session_belongs_to_the_caller_that_started_it(ckpts, b_tensors):
    """Calls carrying another caller's token are refused and change nothing; calls without a token (vLLM-API
    clients) are accepted; the owner's token works."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    llm.init_weight_transfer_engine({"backend": "tensors"})
    mine = llm.start_weight_update()
    assert isinstance(mine, str) and len(mine) >= 16
    for call in (
        lambda: llm.update_weights(tensors_update_info(b_tensors), session_token="someone-else"),
        lambda: llm.finish_weight_update(session_token="someone-else"),
        lambda: llm.abort_weight_update(session_token="someone-else"),
    ):
        with pytest.raises(RuntimeError, match="belongs to another caller"):
            call()
    assert llm.llm_engine.state is EngineState.UPDATING
    llm.update_weights(tensors_update_info(b_tensors[:4]))  # no token: accepted
    llm.update_weights(tensors_update_info(b_tensors[4:]), session_token=mine)
    llm.finish_weight_update(session_token=mine)
    assert serves(llm, ckpts["B"])
    llm.abort_weight_update(session_token=mine)  # that session is over: nothing to abort
    assert serves(llm, ckpts["B"])


class _SilentTrainer:
    """A trainer that connects (shm: declares its update; torch_dist: joins the group) but never sends data."""

    def __init__(self, backend: str, named: list, tensor_parallel_size: int) -> None:
        self.backend, self.sender = backend, None
        if backend == "shm":
            from hotswap.transfer.shm import ShmSender

            self.sender = ShmSender()
            self.info, _ = self.sender.prepare(named)  # declared, never published
            self.init_info: dict = {"backend": "shm"}
        else:
            from hotswap.transfer.torch_dist import TorchDistSender

            port = free_port()
            self.init_info = {"backend": "torch_dist", "master_address": "127.0.0.1", "master_port": port}
            self._joined = threading.Thread(
                target=lambda: setattr(
                    self, "sender", TorchDistSender("127.0.0.1", port, timeout_s=120, num_workers=tensor_parallel_size)
                )
            )
            self._joined.start()
            self.info = {**declare(named), "bucket_size_bytes": 1 << 16}

    def close(self) -> None:
        if self.backend == "torch_dist":
            self._joined.join()
        if self.sender is not None:
            self.sender.close()


@pytest.mark.parametrize("backend", ["shm", "torch_dist"])
@pytest.mark.parametrize("tensor_parallel_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_abort_interrupts_an_update_waiting_for_its_trainer(ckpts, b_tensors, backend, tensor_parallel_size):
    """A trainer that connected but never sends: an abort ends the wait at once (the update rolls back) instead
    of waiting for the transport's timeout, and the engine serves the old weights."""
    config = EngineConfig.from_kwargs(
        str(ckpts["A"]),
        kv_cache_memory_bytes=1 << 22,
        tensor_parallel_size=tensor_parallel_size,
        weight_transfer_config={"timeout_s": 120},
    )
    trainer = _SilentTrainer(backend, b_tensors, tensor_parallel_size)

    async def main() -> tuple[float, BaseException | None, list[int]]:
        engine = AsyncLLMEngine(config)
        before = await engine.collective_rpc("weight_checksums")
        await engine.init_weight_transfer_engine(trainer.init_info)
        await engine.start_weight_update()
        waiting = asyncio.create_task(engine.update_weights(trainer.info))
        await asyncio.sleep(1.0)
        start = time.monotonic()
        await engine.abort_weight_update()
        error = None
        try:
            await waiting
        except BaseException as err:
            error = err
        elapsed = time.monotonic() - start
        assert await engine.collective_rpc("weight_checksums") == before
        tokens = []
        async for out in engine.generate(PROMPTS[0], GREEDY):
            tokens = out.outputs[0].token_ids
        await engine.shutdown()
        engine.engine.shutdown()
        return elapsed, error, tokens

    elapsed, error, tokens = asyncio.run(main())
    trainer.close()
    assert elapsed < 5 and error is not None and "aborted while waiting" in str(error)
    llm_tok = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22).get_tokenizer()
    assert tokens == hf_greedy(str(ckpts["A"]), tuple(llm_tok.encode(PROMPTS[0])), 8)[0]


def test_torch_dist_init_to_a_dead_port_does_not_stop_generation(ckpts, b_tensors):
    """Nobody listens on the master port: while the engine tries to join (up to timeout_s), requests keep being
    generated; then the init fails with an error naming the address, and a later init with a trainer works."""
    timeout_s = 3.0
    config = EngineConfig.from_kwargs(
        str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, weight_transfer_config={"timeout_s": timeout_s}
    )
    held = socket.socket()  # bound and never listening: a join is refused, and no other process can take the port
    held.bind(("127.0.0.1", 0))
    dead = {"backend": "torch_dist", "master_address": "127.0.0.1", "master_port": held.getsockname()[1]}
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    async def main() -> tuple[float, float, BaseException | None]:
        engine = AsyncLLMEngine(config)
        start = time.monotonic()
        init = asyncio.create_task(engine.init_weight_transfer_engine(dead))
        await asyncio.sleep(0.3)  # the init is under way
        outputs = [out async for out in engine.generate(PROMPTS[1], params)]
        assert len(outputs[-1].outputs[0].token_ids) == 32
        generated = time.monotonic() - start
        error = None
        try:
            await init
        except BaseException as err:
            error = err
        failed = time.monotonic() - start
        await engine.shutdown()
        engine.engine.shutdown()
        return generated, failed, error

    generated, failed, error = asyncio.run(main())
    # waiting for the init would take timeout_s or more; the margin absorbs a shared CPU
    assert generated < timeout_s - 0.5, f"generation waited for the init: {generated:.1f} s"
    assert error is not None and "could not join" in str(error) and dead["master_address"] in str(error)
    assert failed < timeout_s + 10
    held.close()
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    pusher = Pusher(llm, "torch_dist")
    pusher.push(b_tensors)
    assert serves(llm, ckpts["B"])


def test_an_abort_that_lands_before_the_update_waits_is_not_lost(ckpts, b_tensors):
    """The interrupt of an abort racing an update_weights call (sent before that call began receiving) still ends
    the wait at once; the next session is not affected by it."""
    from hotswap.transfer.base import interrupt_waits
    from hotswap.transfer.shm import ShmSender

    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22, weight_transfer_config={"timeout_s": 120})
    sender = ShmSender()
    info, _ = sender.prepare(b_tensors)  # declared, never published
    llm.init_weight_transfer_engine({"backend": "shm"})
    llm.start_weight_update()
    interrupt_waits()  # as AsyncLLMEngine.abort_weight_update does, before the update below starts to wait
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted while waiting"):
        llm.update_weights(info)
    assert time.monotonic() - start < 5 and serves(llm, ckpts["A"])
    llm.start_weight_update()  # a new session: the old interrupt is spent
    llm.update_weights(sender.write(b_tensors))
    llm.finish_weight_update()
    assert serves(llm, ckpts["B"])
    sender.close()


def test_sleep_holds_requests_without_kv_and_refuses_while_a_sequence_holds_some(ckpts, tokenizer):
    """A trainer's 'pause, sleep, wake, resume' with requests queued or frozen: those without KV (queued, or frozen
    by a 'keep' pause that cleared the cache) wait through the sleep and finish with the tokens they would have
    had; a sequence that still holds KV makes sleep refuse, naming the way out."""
    llm = LLM(str(ckpts["A"]), kv_cache_memory_bytes=1 << 22)
    engine = llm.llm_engine
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", None, ids, GREEDY)
    engine.step()  # the prompts are computed: their sequences hold KV
    engine.pause("keep", clear_cache=False)
    with pytest.raises(RuntimeError, match=r"hold KV cache.*'keep' with clear_cache"):
        engine.sleep(1)
    engine.resume()
    engine.pause("keep", clear_cache=True)  # frozen, their KV dropped (recomputed on resume)
    engine.add_request("queued", None, prompts[0], GREEDY)  # arrives while paused: queued
    for level in (1, 2):
        engine.sleep(level)
    assert engine.state is EngineState.ASLEEP and len(engine.requests) == 4
    engine.wake_up()
    llm.reload_weights(weights_path=str(ckpts["A"]))  # level 2 returned the weights' memory
    engine.resume()
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
    for rid, ids in [("r0", prompts[0]), ("r1", prompts[1]), ("r2", prompts[2]), ("queued", prompts[0])]:
        assert list(finished[rid]) == hf_greedy(str(ckpts["A"]), tuple(ids), 8)[0], rid
