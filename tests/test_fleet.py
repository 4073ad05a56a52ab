"""A fleet of two replicas on a local Ray: routing, fleet-wide two-phase updates, replica death and restart."""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, hf_greedy
from hotswap import LLM, SamplingParams
from hotswap.fleet.router import Router, request_cost
from transfer_helpers import Pusher, free_port, torch_dist_trainer_dies_mid_stream

ray = pytest.importorskip("ray")

from hotswap.fleet import Fleet, FleetUpdateFailed  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# ---- the router, without Ray ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_router_sends_a_request_to_the_replica_with_fewest_outstanding_tokens():
    router = Router()
    router.started("a", 0, request_cost(100, 50, 1))
    assert router.pick([0, 1]) == 1
    router.started("b", 1, request_cost(10, 10, 1))
    assert router.pick([0, 1]) == 1  # 20 outstanding against 150
    router.progressed("a", 140)
    assert router.pick([0, 1]) == 0  # 10 against 20
    router.finished("a")
    router.finished("b")
    assert router.outstanding(0) == router.outstanding(1) == 0
    assert router.in_flight() == []


@pytest.mark.unit
def test_router_keeps_a_key_on_one_replica_and_moves_only_the_keys_of_one_that_left():
    router = Router()
    keys = [f"salt-{i}" for i in range(64)]
    placed = {k: router.pick([0, 1, 2], k) for k in keys}
    assert set(placed.values()) == {0, 1, 2}
    assert all(router.pick([0, 1, 2], k) == r for k, r in placed.items())
    after = {k: router.pick([0, 2], k) for k in keys}
    assert all(after[k] == r for k, r in placed.items() if r != 1)
    with pytest.raises(RuntimeError, match="no replica"):
        router.pick([], "salt-0")


@pytest.mark.unit
def test_llm_runs_one_engine_and_names_the_factory_that_builds_a_fleet(tmp_path):
    """`LLM(...)` is one engine: arguments that ask for replicas are refused before anything loads, naming
    `LLM.create`, which builds the fleet (see the fixture below)."""
    for kwargs in ({"data_parallel_size": 2}, {"distributed_executor_backend": "ray"}):
        with pytest.raises(ValueError, match=r"LLM\.create"):
            LLM(str(tmp_path), **kwargs)
    for build in (LLM, LLM.create):
        with pytest.raises(ValueError, match="distributed_executor_backend must be"):
            build(str(tmp_path), distributed_executor_backend="nccl")


# ---- a fleet of two replicas ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(ckpts):
    f = LLM.create(  # vLLM's spelling of a fleet; the fleet's own settings pass through
        str(ckpts["A"]),
        data_parallel_size=2,
        distributed_executor_backend="ray",
        num_gpus_per_worker=0,
        health_check_interval_s=0.2,
        health_check_timeout_s=10,
        ray_init_kwargs={"num_cpus": 2, "object_store_memory": 256 << 20},
        weight_transfer_config={"timeout_s": 20},
        deterministic=True,  # every replica the same bits as one engine (test_deterministic.py has the rest)
    )
    assert isinstance(f, Fleet) and f.num_replicas == 2
    yield f
    f.shutdown()
    ray.shutdown()


@pytest.fixture(autouse=True)
def _fleet_resumed(request):
    """After each test on the fleet, even a failed one: the fleet is resumed, so no later test meets a pause."""
    yield
    if "fleet" in request.fixturenames:
        fleet = request.getfixturevalue("fleet")
        if fleet.paused or fleet.pausing:
            fleet.resume_generation()
        fleet.collective_rpc(_normal_steps)


def _slow_steps(worker) -> None:
    """Every engine step of this worker takes at least 20 ms more (its logits are computed late)."""
    compute = type(worker.model).compute_logits

    def slow(hidden):
        time.sleep(0.02)
        return compute(worker.model, hidden)

    worker.model.compute_logits = slow


def _normal_steps(worker) -> None:
    worker.model.__dict__.pop("compute_logits", None)


def replica_serves(fleet: Fleet, index: int, path: Path) -> bool:
    """Whether replica `index` itself generates transformers' greedy continuations for the checkpoint at `path`."""
    tok = fleet.get_tokenizer()
    prompts = [fleet.prepare_prompt(p) for p in PROMPTS[:2]]
    ids = [f"probe-{index}-{time.monotonic_ns()}-{i}" for i in range(2)]
    outs = ray.get(fleet.members[index].actor.generate_batch.remote(prompts, [GREEDY] * 2, ids))
    return all(
        o.outputs[0].token_ids == hf_greedy(str(path), tuple(tok.encode(p)), 12)[0]
        for p, o in zip(PROMPTS[:2], outs, strict=True)
    )


def wait_routable(fleet: Fleet, count: int = 2, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while len(fleet.routable()) < count:
        assert time.monotonic() < deadline, fleet.replica_status()
        time.sleep(0.2)


def wait_replaced(fleet: Fleet, index: int, old_actor, timeout: float = 180) -> None:
    """Until replica `index` runs a new actor and every replica is routable again."""
    deadline = time.monotonic() + timeout
    while fleet.members[index].actor is old_actor or len(fleet.routable()) < len(fleet.members):
        assert time.monotonic() < deadline, fleet.replica_status()
        time.sleep(0.2)


def same_weights(fleet: Fleet) -> dict[str, str]:
    """Both replicas' checksums, asserted equal."""
    sums = fleet.replica_checksums()
    assert sums[0] == sums[1]
    return sums[0]


def test_fleet_outputs_equal_one_llm_and_requests_spread_over_both_replicas(fleet, ckpts):
    before = dict(fleet.router.routed)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    params = [greedy, seeded] * (len(PROMPTS) // 2)
    outs = fleet.generate(PROMPTS, params)
    single = LLM(str(ckpts["A"]), deterministic=True)
    try:
        expected = single.generate(PROMPTS, params, use_tqdm=False)
    finally:
        single.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].weight_versions for o in outs] == [o.outputs[0].weight_versions for o in expected]

    def exact(out):  # every logprob the request returned, as float64 (exact for the float32 values)
        rows = [*(out.prompt_logprobs or [])[1:], *(out.outputs[0].logprobs or [])]
        return torch.tensor([(t, row[t].logprob) for row in rows for t in sorted(row)], dtype=torch.float64)

    for got, want in zip(outs, expected, strict=True):  # deterministic mode: equal bit for bit
        assert torch.equal(exact(got), exact(want))
    spread = {r: fleet.router.routed.get(r, 0) - before.get(r, 0) for r in (0, 1)}
    assert spread[0] > 0 and spread[1] > 0 and sum(spread.values()) == len(PROMPTS)
    # one cache_salt: every request of it on one replica (its prefix cache), with the same outputs
    before = dict(fleet.router.routed)
    salted = fleet.generate([{"prompt_token_ids": [5, 6, 7, 8], "cache_salt": "user-1"}] * 4, GREEDY)
    moved = [fleet.router.routed.get(r, 0) - before.get(r, 0) for r in (0, 1)]
    assert sorted(moved) == [0, 4]
    assert len({tuple(o.outputs[0].token_ids) for o in salted}) == 1


def test_fleet_update_over_torch_dist_is_one_broadcast_group_and_commits_one_version(fleet, ckpts, b_tensors):
    version = fleet.get_weight_version()
    pusher = Pusher(fleet, "torch_dist", bucket_size_bytes=1 << 20)
    try:
        assert pusher.dist.group.size() == 1 + 2  # the trainer and both replicas' workers: each byte sent once
        pusher.push(b_tensors, weight_version="step-1")  # a label: the next integer, named
    finally:
        pusher.close()
    assert fleet.get_weight_version() == version + 1 and fleet.get_weight_version_label() == "step-1"
    assert [m.version for m in fleet.members] == [version + 1] * 2
    assert [r["weight_version"] for r in fleet.replica_status()] == ["step-1"] * 2
    assert replica_serves(fleet, 0, ckpts["B"]) and replica_serves(fleet, 1, ckpts["B"])
    same_weights(fleet)
    spans = [o.outputs[0].weight_versions for o in fleet.generate(PROMPTS[:4], GREEDY)]
    assert {(s[0].version, s[0].label) for s in spans} == {(version + 1, "step-1")}  # from both replicas


def test_fleet_update_over_shm_reaches_both_replicas(fleet, ckpts):
    from safetensors.torch import load_file

    a_tensors = list(load_file(str(ckpts["A"] / "model.safetensors")).items())
    pusher = Pusher(fleet, "shm")
    try:
        pusher.push(a_tensors, weight_version=10)
    finally:
        pusher.close()
    assert fleet.get_weight_version() == 10 and [m.version for m in fleet.members] == [10, 10]
    assert replica_serves(fleet, 0, ckpts["A"]) and replica_serves(fleet, 1, ckpts["A"])
    outs = fleet.generate(PROMPTS[:4], GREEDY)
    assert all(o.outputs[0].weight_versions[0].version == 10 for o in outs)
    assert fleet.update_weight_version("run7/ckpt-00042") == "run7/ckpt-00042"  # a rename: weights untouched
    outs = fleet.generate(PROMPTS[:4], GREEDY)
    spans = {(o.outputs[0].weight_versions[0].version, o.outputs[0].weight_versions[0].label) for o in outs}
    assert spans == {(10, "run7/ckpt-00042")}
    assert fleet.get_weight_version() == 10


def test_a_trainer_dying_mid_broadcast_rolls_the_whole_fleet_back(fleet, ckpts, b_tensors):
    before, version = same_weights(fleet), fleet.get_weight_version()
    ctx = multiprocessing.get_context("spawn")
    queue, go, port = ctx.Queue(), ctx.Queue(), free_port()
    trainer = ctx.Process(
        target=torch_dist_trainer_dies_mid_stream, args=(queue, go, port, b_tensors, 1 << 16, 2, fleet.get_world_size())
    )
    trainer.start()
    try:
        fleet.init_weight_transfer_engine({"backend": "torch_dist", "master_address": "127.0.0.1", "master_port": port})
        info = queue.get(timeout=60)
        fleet.start_weight_update()
        go.put(True)
        with pytest.raises(FleetUpdateFailed, match="rolled back"):
            fleet.update_weights(info)
    finally:
        trainer.join(timeout=30)
        fleet.shutdown_weight_transfer_engine()
    assert same_weights(fleet) == before
    assert fleet.get_weight_version() == version and fleet.counters["updates_failed"] >= 1
    assert replica_serves(fleet, 0, ckpts["A"]) and replica_serves(fleet, 1, ckpts["A"])


def _slow_norm_post_processing(worker) -> None:
    worker.model.model.norm.process_weights_after_loading = lambda: time.sleep(5)


def kill_after_reading(fleet: Fleet, victim, seen: dict) -> None:
    """Records replica 0's checksums (what it holds mid-change), then kills replica 1's actor."""
    seen["survivor"] = ray.get(fleet.members[0].actor.weight_checksums.remote("model"))
    ray.kill(victim)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas cannot import this test module


def test_a_replica_killed_while_receiving_rolls_the_other_back_and_comes_back_at_the_fleet_version(
    fleet, ckpts, b_tensors
):
    wait_routable(fleet)
    before, version = same_weights(fleet), fleet.get_weight_version()
    restarts = fleet.counters["replica_restarts"]
    victim, seen = fleet.members[1].actor, {}
    ray.get(victim.collective_rpc.remote(_slow_norm_post_processing, (), None))
    pusher = Pusher(fleet, "tensors")
    try:
        fleet.start_weight_update()
        killer = threading.Timer(2.0, kill_after_reading, (fleet, victim, seen))  # replica 1 post-processes
        killer.start()
        with pytest.raises(FleetUpdateFailed, match=r"replica 1 failed in update_weights.*rolled back"):
            pusher.update(b_tensors)
        killer.join()
    finally:
        pusher.close()
    assert seen["survivor"] != before  # replica 0 had taken B when replica 1 died
    assert fleet.get_weight_version() == version
    assert fleet.replica_checksums()[0] == before  # the survivor rolled back, bit for bit
    assert replica_serves(fleet, 0, ckpts["A"])
    outs = fleet.generate(PROMPTS[:4], GREEDY)  # the fleet keeps serving, on the survivor
    assert all(o.finished for o in outs)
    # the dead replica is restarted and, since the fleet's weights came from a session (no folder holds them),
    # copied from the live replica, checked against its checksums, before it takes requests again
    wait_routable(fleet)
    assert fleet.counters["replica_restarts"] == restarts + 1
    assert fleet.members[1].version == version and fleet.members[1].actor is not victim
    assert fleet.members[1].restored_from == "copy"
    assert same_weights(fleet) == before
    assert replica_serves(fleet, 1, ckpts["A"])


def test_a_replica_killed_while_preparing_a_reload_rolls_back_the_one_that_prepared(fleet, ckpts):
    wait_routable(fleet)
    before, version = same_weights(fleet), fleet.get_weight_version()
    victim, seen = fleet.members[1].actor, {}
    ray.get(victim.collective_rpc.remote(_slow_norm_post_processing, (), None))
    fleet.pause_generation("keep")
    try:
        killer = threading.Timer(2.0, kill_after_reading, (fleet, victim, seen))  # replica 1 still preparing
        killer.start()
        with pytest.raises(FleetUpdateFailed, match=r"replica 1 failed in prepare_reload.*rolled back"):
            fleet.reload_weights(str(ckpts["B"]))
        killer.join()
        assert fleet.get_weight_version() == version and fleet.counters["updates_failed"] >= 1
        assert seen["survivor"] != before  # replica 0 had prepared B
        assert fleet.replica_checksums()[0] == before  # and rolled back to A, bit for bit
    finally:
        fleet.resume_generation()
    assert replica_serves(fleet, 0, ckpts["A"])
    wait_routable(fleet)
    assert fleet.members[1].version == version and same_weights(fleet) == before


def test_fleet_reload_commits_on_both_and_a_bad_one_changes_neither(fleet, ckpts, tmp_path):
    wait_routable(fleet)
    before, version = same_weights(fleet), fleet.get_weight_version()
    with pytest.raises(ValueError, match="does not exist"):  # checked before any replica is asked
        fleet.reload_weights(str(tmp_path / "missing"))
    assert same_weights(fleet) == before and fleet.get_weight_version() == version
    bad = [("model.norm.weight", torch.ones(3))]
    with pytest.raises(ValueError, match="shape"):
        fleet.reload_weights(weights_iterator=bad)
    assert same_weights(fleet) == before
    with pytest.raises(ValueError, match="atomic"):
        fleet.update_config({"weight_transfer_config": {"atomic": False}})
    fleet.pause_generation("keep")
    try:
        fleet.reload_weights(str(ckpts["B"]))
    finally:
        fleet.resume_generation()
    assert fleet.get_weight_version() == version + 1 and [m.version for m in fleet.members] == [version + 1] * 2
    assert replica_serves(fleet, 0, ckpts["B"]) and replica_serves(fleet, 1, ckpts["B"])
    stats = fleet.stats()
    assert stats["fleet_replicas_up"] == 2 and stats["fleet_updates_committed"] >= 3


def test_an_abort_pause_ends_requests_on_every_replica_and_resume_serves_again(fleet):
    wait_routable(fleet)
    # the requests must still run when the pause lands: up to ~1000 steps (max_model_len) of 20 ms at least; on
    # fast kernels the unslowed model finished them before the health checks had seen them on both replicas
    fleet.collective_rpc(_slow_steps)
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("outs", fleet.generate(PROMPTS[:4], long)))
    worker.start()
    deadline = time.monotonic() + 60
    while (
        sum(m.status.requests if m.status else 0 for m in fleet.members) < 4
        or min(m.status.requests if m.status else 0 for m in fleet.members) == 0
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    fleet.pause_generation("abort")
    worker.join(timeout=60)
    assert fleet.is_paused()
    assert [o.outputs[0].finish_reason for o in box["outs"]] == ["abort"] * 4
    fleet.resume_generation()
    fleet.collective_rpc(_normal_steps)
    assert all(o.outputs[0].finish_reason == "length" for o in fleet.generate(PROMPTS[:2], GREEDY))


def test_generate_on_a_paused_fleet_fails_fast_and_a_stuck_replica_times_out(fleet, ckpts):
    """What used to hang: `generate` on a paused fleet waited on the replicas for ever."""
    from hotswap.errors import EngineUnavailable

    wait_routable(fleet)
    fleet.pause_generation("keep")
    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match="resume_generation"):
        fleet.generate(PROMPTS[:2], GREEDY)
    assert time.monotonic() - started < 5
    fleet.resume_generation()
    # a replica paused behind the fleet's back never returns: the call is bounded by request_timeout_s
    ray.get(fleet.members[0].actor.pause_generation.remote("keep", False), timeout=30)
    bound, fleet._request_timeout = fleet._request_timeout, 2.0
    try:
        with pytest.raises(TimeoutError, match=r"replica 0 did not return .*request_timeout_s"):
            fleet.generate(PROMPTS, GREEDY)  # spread over both replicas (fewest outstanding tokens)
    finally:
        fleet._request_timeout = bound
        ray.get(fleet.members[0].actor.resume_generation.remote(), timeout=30)
    assert all(o.outputs[0].finish_reason == "length" for o in fleet.generate(PROMPTS[:2], GREEDY))


def test_a_replica_whose_version_a_folder_holds_restarts_from_that_folder(fleet, ckpts):
    wait_routable(fleet)
    version = fleet.get_weight_version()
    assert fleet._folder == str(ckpts["B"]) and fleet._folder_current  # the reload above
    old = fleet.members[0].actor
    ray.kill(old)
    outs = fleet.generate(PROMPTS[:2], GREEDY)  # served by replica 1 meanwhile
    assert all(o.outputs[0].weight_versions[0].version == version for o in outs)
    wait_replaced(fleet, 0, old)
    assert fleet.members[0].version == version and fleet.members[0].restored_from == "folder"
    assert replica_serves(fleet, 0, ckpts["B"])
    same_weights(fleet)


def test_a_replica_that_stops_answering_is_taken_out_of_routing_and_replaced(fleet, ckpts):
    import os
    import signal

    wait_routable(fleet)
    failures, version = fleet.counters["replica_failures"], fleet.get_weight_version()
    pid = fleet.members[1].status.pid
    os.kill(pid, signal.SIGSTOP)  # alive to Ray, silent to the health check
    try:
        deadline = time.monotonic() + 60
        while fleet.members[1].state == "up":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert fleet.routable() == [0] and fleet.counters["replica_failures"] == failures + 1
        assert "health check" in (fleet.members[1].error or "")
        outs = fleet.generate(PROMPTS[:2], GREEDY)
        assert all(o.finished for o in outs)
    finally:
        os.kill(pid, signal.SIGCONT)  # a no-op once the fleet killed it
    wait_routable(fleet)
    assert fleet.members[1].status.pid != pid and fleet.members[1].version == version
    same_weights(fleet)
    assert fleet._folder_current and replica_serves(fleet, 1, Path(fleet._folder))  # the folder holds the version


def test_restarted_replicas_get_the_fleets_config_and_transport_and_a_folder_brings_back_a_dead_fleet(
    fleet, ckpts, b_tensors
):
    wait_routable(fleet)
    fleet.update_config({"weight_transfer_config": {"timeout_s": 17.0}})
    pusher = Pusher(fleet, "tensors")  # a non-group transport: restarted replicas get one too
    try:
        pusher.push(b_tensors)  # a session: no folder holds this version
        version, old = fleet.get_weight_version(), fleet.members[0].actor
        ray.kill(old)
        wait_replaced(fleet, 0, old)
        assert fleet.members[0].restored_from == "copy" and fleet.members[0].version == version
        timeouts = ray.get(
            fleet.members[0].actor.collective_rpc.remote(lambda w: w.config.weight_transfer_config.timeout_s, (), None)
        )
        assert timeouts == [17.0]
        pusher.push(b_tensors)  # the restarted replica received it over its re-created transport
        assert [m.version for m in fleet.members] == [version + 1] * 2
    finally:
        pusher.close()
    # every replica dies; the version came from a session, so nothing can restore it until a folder is given
    for member in fleet.members:
        ray.kill(member.actor)
    deadline = time.monotonic() + 60
    while fleet.routable() or not all("no live replica" in (m.error or "") for m in fleet.members):
        assert time.monotonic() < deadline, fleet.replica_status()
        time.sleep(0.2)
    assert fleet.health_problem() is not None
    fleet.reload_weights(str(ckpts["A"]))  # returns once a replica is back from the folder
    assert fleet.get_weight_version() == version + 2
    wait_routable(fleet)
    assert all(m.restored_from == "folder" for m in fleet.members)
    assert replica_serves(fleet, 0, ckpts["A"]) and replica_serves(fleet, 1, ckpts["A"])


def test_a_delta_and_a_canary_reach_every_replica(fleet, ckpts, b_tensors):
    """An xor delta on top of the fleet's version commits on both replicas exactly; one on another base is refused
    by every replica; a canary that fails on the prepared weights rolls both back."""
    from hotswap.transfer.delta import xor_delta
    from hotswap.transfer.tensors import tensors_update_info
    from hotswap.weights.checksum import tensor_sha256

    a = dict(load_a(ckpts))
    b = dict(b_tensors)
    base = fleet.get_weight_version()
    delta = [(n, xor_delta(a[n], b[n])) for n in sorted(b)]
    with pytest.raises(Exception, match="applies on top of version 'other'"):
        fleet.reload_weights(weights_iterator=delta, encoding="xor", base_version="other")
    fleet.reload_weights(weights_iterator=delta, encoding="xor", base_version=base)
    held = same_weights(fleet)
    assert all(held[n] == tensor_sha256(b[n]) for n in held)
    fleet.init_weight_transfer_engine({"backend": "tensors"})
    try:
        fleet.start_weight_update()
        fleet.update_weights(tensors_update_info(list(a.items())))
        with pytest.raises(Exception, match="canary probe 0"):
            fleet.finish_weight_update(canary={"token_ids": [[5, 6, 7, 8]], "max_nll": 0.01})
    finally:
        fleet.shutdown_weight_transfer_engine()
    assert same_weights(fleet) == held
    fleet.reload_weights(weights_iterator=list(a.items()))  # back to A for the tests after this one


def load_a(ckpts) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(str(ckpts["A"] / "model.safetensors")).items())


def test_group_abort_reaches_the_replicas_holding_the_group(fleet):
    """A group spread over both replicas is aborted by prefix in one call: every request ends with its partial
    output and finish_reason 'abort'; the other request finishes."""
    import asyncio

    from hotswap.fleet.async_fleet import AsyncFleet

    async def main():
        front = AsyncFleet(fleet)
        long = SamplingParams(temperature=1.0, seed=1, max_tokens=600, ignore_eos=True)
        short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

        async def run(rid: str, params: SamplingParams):
            return [o async for o in front.generate(PROMPTS[0], params, rid)][-1]

        tasks = {rid: asyncio.create_task(run(rid, long)) for rid in ("g::0", "g::1", "g::2", "g::3")}
        tasks["solo"] = asyncio.create_task(run("solo", short))
        deadline = time.monotonic() + 60
        while len([r for r in fleet.router.in_flight() if r.startswith("g::")]) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # tokens out on both replicas
        replicas = {fleet.router.replica_of(r) for r in tasks if r.startswith("g::")}
        aborted = await front.abort_requests(prefix="g::")
        return replicas, aborted, {rid: await task for rid, task in tasks.items()}

    replicas, aborted, finals = asyncio.run(main())
    assert replicas == {0, 1}  # the group was spread over both replicas
    assert sorted(aborted) == ["g::0", "g::1", "g::2", "g::3"]
    for rid in aborted:
        c = finals[rid].outputs[0]
        assert c.finish_reason == "abort" and len(c.token_ids) < 600
    assert finals["solo"].outputs[0].finish_reason == "length"
