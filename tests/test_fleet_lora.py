"""LoRA adapters on a fleet of two replicas: requests carry their adapter to the replica that serves them, loads
and updates land on every replica or on none (two-phase: a failure or a death on one rolls the other back), and a
restarted replica gets the fleet's adapters, at their versions, before it is routed to."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import PROMPTS
from hotswap import LLM, LoRARequest, SamplingParams
from hotswap.lora.peft_format import read_folder
from hotswap.testing import make_tiny_lora
from hotswap.transfer.tensors import tensors_update_info

ray = pytest.importorskip("ray")

from hotswap.fleet import Fleet, FleetUpdateFailed  # noqa: E402
from hotswap.fleet.async_fleet import AsyncFleet  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
LORA_KWARGS = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4}


@pytest.fixture(scope="module")
def adapters(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """For checkpoint A: "a" and "c" (rank 8, two draws of one shape: "c" is an update of "a"), "big" (rank 16,
    over the fleet's max_lora_rank)."""
    root = tmp_path_factory.mktemp("fleet_lora")
    return {
        "a": make_tiny_lora(ckpts["A"], root / "a", rank=8, seed=1),
        "c": make_tiny_lora(ckpts["A"], root / "c", rank=8, seed=3),
        "big": make_tiny_lora(ckpts["A"], root / "big", rank=16, seed=2),
    }


@pytest.fixture(scope="module")
def prompts(ckpts) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpts["A"]))
    return [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS[:2]]


@pytest.fixture(scope="module")
def expected(ckpts, adapters, prompts) -> dict[str | None, list[list[int]]]:
    """One in-process LLM's greedy tokens for the prompts: on the base model, and with adapter "a" / "c"."""
    llm = LLM(str(ckpts["A"]), **LORA_KWARGS)
    try:
        out: dict[str | None, list[list[int]]] = {}
        for name in (None, "a", "c"):
            lora = None if name is None else LoRARequest(name, 1 if name == "a" else 2, str(adapters[name]))
            outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
            out[name] = [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()
    assert out["a"] != out[None] and out["c"] != out[None] and out["a"] != out["c"]
    return out


@pytest.fixture(scope="module")
def fleet(ckpts):
    f = Fleet(
        str(ckpts["A"]),
        num_replicas=2,
        num_gpus_per_worker=0,
        health_check_interval_s=0.2,
        health_check_timeout_s=10,
        ray_init_kwargs={"num_cpus": 2, "object_store_memory": 256 << 20},
        **LORA_KWARGS,
    )
    yield f
    f.shutdown()
    ray.shutdown()


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas cannot import this test module


def served(fleet: Fleet, index: int, prompts: list[dict], lora: LoRARequest | None) -> list:
    """Replica `index`'s own outputs for the prompts (not routed)."""
    ids = [f"probe-{index}-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    return ray.get(
        fleet.members[index].actor.generate_batch.remote(prompts, [GREEDY] * len(prompts), ids, [lora] * len(prompts)),
        timeout=120,
    )


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def replica_loras(fleet: Fleet) -> list[list[dict]]:
    return [ray.get(m.actor.list_loras.remote(), timeout=60) for m in fleet.members]


def worker_uids(fleet: Fleet, indices: tuple[int, ...] = (0, 1)) -> list[list[int]]:
    """The adapter versions each replica's worker holds (committed ones, by uid)."""
    return [ray.get(fleet.members[i].actor.collective_rpc.remote(_uids, (), None), timeout=60)[0] for i in indices]


def _uids(worker) -> list[int]:
    return sorted(worker.loras.adapters)


def _failing_add_lora(worker) -> None:
    def fail(*args, **kwargs):
        raise RuntimeError("injected add_lora failure")

    worker.add_lora = fail


def _slow_add_lora(worker) -> None:
    add = type(worker).add_lora

    def slow(*args, **kwargs):
        time.sleep(5)
        return add(worker, *args, **kwargs)

    worker.add_lora = slow


def _normal_add_lora(worker) -> None:
    worker.__dict__.pop("add_lora", None)


def wait_replaced(fleet: Fleet, index: int, old_actor, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while fleet.members[index].actor is old_actor or len(fleet.routable()) < len(fleet.members):
        assert time.monotonic() < deadline, fleet.replica_status()
        time.sleep(0.2)


def test_an_adapter_a_request_names_is_loaded_on_every_replica_and_serves_as_one_llm(
    fleet, adapters, prompts, expected
):
    a = LoRARequest("a", 1, str(adapters["a"]))
    assert tokens(fleet.generate(prompts, GREEDY, lora_request=a)) == expected["a"]
    assert tokens(fleet.generate(prompts, GREEDY)) == expected[None]
    # the first use loaded it on both replicas, with its id, before the requests were routed
    lists = replica_loras(fleet)
    assert lists[0] == lists[1] and [(d["lora_name"], d["lora_int_id"], d["version"]) for d in lists[0]] == [
        ("a", 1, 1)
    ]
    assert fleet.list_loras() == lists[0]
    by_name = LoRARequest("a", 1)  # no path: served from what is loaded
    for index in (0, 1):
        assert tokens(served(fleet, index, prompts, by_name)) == expected["a"]
        assert tokens(served(fleet, index, prompts, None)) == expected[None]
    # per prompt, mixed: base and adapter rows in one call
    mixed = fleet.generate(prompts * 2, GREEDY, lora_request=[by_name, None, None, by_name])
    assert tokens(mixed) == [expected["a"][0], expected[None][1], expected[None][0], expected["a"][1]]
    with pytest.raises(ValueError, match="lora_int_id 1"):  # another id for a loaded name
        fleet.generate(prompts, GREEDY, lora_request=LoRARequest("a", 5, str(adapters["a"])))

    async def stream() -> list[int]:  # the server's front end
        engine = AsyncFleet(fleet)
        assert await engine.list_loras() == lists[0]
        last = None
        async for out in engine.generate(prompts[0], GREEDY, lora_request=by_name):
            last = out
        return last.outputs[0].token_ids

    assert asyncio.run(stream()) == expected["a"][0]


def test_a_bad_load_raises_value_error_and_changes_no_replica(fleet, adapters, tmp_path):
    before, uids = replica_loras(fleet), worker_uids(fleet)
    with pytest.raises(ValueError, match="max_lora_rank"):
        fleet.load_lora_adapter("big", str(adapters["big"]))
    with pytest.raises(ValueError, match="not a folder"):
        fleet.load_lora_adapter("nowhere", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="already loaded"):
        fleet.load_lora_adapter("a", str(adapters["c"]))
    with pytest.raises(ValueError, match="adapter_config"):  # a request's first use: the same load, refused
        fleet.generate([{"prompt_token_ids": [5, 6]}], GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    assert replica_loras(fleet) == before and worker_uids(fleet) == uids
    assert set(fleet._loras) == {"a"}


def test_a_failure_on_one_replica_while_preparing_rolls_the_other_back(fleet, adapters, prompts, expected):
    before, uids = replica_loras(fleet), worker_uids(fleet)
    ray.get(fleet.members[1].actor.collective_rpc.remote(_failing_add_lora, (), None), timeout=60)
    try:
        with pytest.raises(FleetUpdateFailed, match=r"replica 1 failed in prepare_lora_adapter.*injected"):
            fleet.load_lora_adapter("b", str(adapters["c"]))
    finally:
        ray.get(fleet.members[1].actor.collective_rpc.remote(_normal_add_lora, (), None), timeout=60)
    # replica 0 had prepared "b" on its worker: it dropped it again
    assert replica_loras(fleet) == before and worker_uids(fleet) == uids and "b" not in fleet._loras
    assert tokens(served(fleet, 0, prompts, LoRARequest("a", 1))) == expected["a"]
    assert len(fleet.routable()) == 2  # a replica that refused is no reason to restart it


def test_a_load_inplace_update_is_served_by_every_replica_on_the_next_request(fleet, adapters, prompts, expected):
    description = fleet.load_lora_adapter("a", str(adapters["c"]), load_inplace=True)
    assert (description["lora_int_id"], description["version"]) == (1, 2)
    for index in (0, 1):
        outs = served(fleet, index, prompts, LoRARequest("a", 1))
        assert tokens(outs) == expected["c"]
        assert outs[0].outputs[0].lora_versions == [(2, 0, TOKENS)]
    assert [[d["version"] for d in lst] for lst in replica_loras(fleet)] == [[2], [2]]


def test_lora_sessions_and_reloads_go_two_phase_over_the_fleet(fleet, adapters, prompts, expected):
    version = fleet.get_weight_version()
    _, a_tensors = read_folder(str(adapters["a"]))
    _, c_tensors = read_folder(str(adapters["c"]))
    fleet.init_weight_transfer_engine({"backend": "tensors"})
    try:
        fleet.start_weight_update(target="lora:a")
        fleet.update_weights(tensors_update_info(list(a_tensors.items())))
        with pytest.raises(ValueError, match="LoRA update takes neither"):
            fleet.finish_weight_update(weight_version=7)
        fleet.finish_weight_update()  # prepare_weight_update on both, then commit on both
        assert [[d["version"] for d in lst] for lst in replica_loras(fleet)] == [[3], [3]]
        for index in (0, 1):
            assert tokens(served(fleet, index, prompts, LoRARequest("a", 1))) == expected["a"]
        # a bad update on both ends the session everywhere; "a" keeps serving version 3
        fleet.start_weight_update(target="lora:a")
        bad = [(n, t.t().contiguous()) for n, t in list(a_tensors.items())[:1]]
        with pytest.raises(ValueError, match="shape"):
            fleet.update_weights(tensors_update_info(bad))
        assert fleet._session is None
    finally:
        fleet.shutdown_weight_transfer_engine()
    fleet.reload_weights(weights_path=str(adapters["c"]), target="lora:a")
    assert tokens(fleet.generate(prompts, GREEDY, lora_request=LoRARequest("a", 1))) == expected["c"]
    fleet.reload_weights(weights_iterator=list(a_tensors.items()), target="lora:a")
    with pytest.raises(ValueError, match="version 1"):  # a delta against another version: refused on both
        fleet.reload_weights(weights_iterator=list(c_tensors.items()), target="lora:a", encoding="xor", base_version=1)
    with pytest.raises(ValueError, match="no LoRA adapter named"):
        fleet.reload_weights(weights_iterator=list(c_tensors.items()), target="lora:nobody")
    lists = replica_loras(fleet)
    assert lists[0] == lists[1] and [d["version"] for d in lists[0]] == [5]
    for index in (0, 1):
        assert tokens(served(fleet, index, prompts, LoRARequest("a", 1))) == expected["a"]
    assert fleet.get_weight_version() == version  # the model's version never moved
    assert not fleet._loras["a"]["current"]  # no folder holds "a" now: a restart copies it from a live replica


def test_a_replica_that_dies_while_preparing_rolls_the_other_back_and_comes_back_with_the_adapters(
    fleet, adapters, prompts, expected
):
    before, uids = replica_loras(fleet), worker_uids(fleet)
    victim = fleet.members[1].actor
    ray.get(victim.collective_rpc.remote(_slow_add_lora, (), None), timeout=60)
    killer = threading.Timer(2.0, ray.kill, (victim,))  # replica 1 is still loading "b"
    killer.start()
    with pytest.raises(FleetUpdateFailed, match=r"replica 1 failed in prepare_lora_adapter"):
        fleet.load_lora_adapter("b", str(adapters["c"]))
    killer.join()
    assert ray.get(fleet.members[0].actor.list_loras.remote(), timeout=60) == before[0]
    assert worker_uids(fleet, (0,)) == uids[:1]  # replica 0 dropped the "b" it had prepared
    # the fleet goes on serving "a" on replica 0; replica 1 comes back with "a" copied from it, at version 5 (a
    # session and a reload from pairs changed it: no folder holds it), before it takes requests again
    assert tokens(fleet.generate(prompts, GREEDY, lora_request=LoRARequest("a", 1))) == expected["a"]
    wait_replaced(fleet, 1, victim)
    assert replica_loras(fleet) == [before[0], before[0]]
    assert tokens(served(fleet, 1, prompts, LoRARequest("a", 1))) == expected["a"]
    assert served(fleet, 1, prompts, LoRARequest("a", 1))[0].outputs[0].lora_versions == [(5, 0, TOKENS)]


def test_unload_forgets_the_adapter_on_every_replica(fleet, adapters, prompts, expected):
    config, c_tensors = read_folder(str(adapters["c"]))
    fleet.load_lora_adapter("b", tensors=c_tensors, peft_config=config, lora_int_id=7)  # from tensors
    assert [[d["lora_name"] for d in lst] for lst in replica_loras(fleet)] == [["a", "b"], ["a", "b"]]
    assert tokens(fleet.generate(prompts, GREEDY, lora_request=LoRARequest("b", 7))) == expected["c"]
    fleet.unload_lora_adapter("a")
    assert [[d["lora_name"] for d in lst] for lst in replica_loras(fleet)] == [["b"], ["b"]]
    assert set(fleet._loras) == {"b"}
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        fleet.unload_lora_adapter("a")
    with pytest.raises(ValueError, match="not loaded"):
        fleet.generate(prompts, GREEDY, lora_request=LoRARequest("a", 1))
    assert tokens(fleet.generate(prompts, GREEDY)) == expected[None]


def test_with_no_live_replica_adapters_come_back_from_where_the_fleet_loaded_them(fleet, adapters, prompts, expected):
    """Both replicas die: the first back loads "b" from the tensors the fleet loaded it from; "a", which a reload
    from pairs changed since its folder was loaded, cannot be had and is dropped; the second copies the first."""
    fleet.load_lora_adapter("a", str(adapters["c"]), lora_int_id=1)
    _, a_tensors = read_folder(str(adapters["a"]))
    fleet.reload_weights(weights_iterator=list(a_tensors.items()), target="lora:a")
    victims = [m.actor for m in fleet.members]
    for actor in victims:
        ray.kill(actor)
    for index, actor in enumerate(victims):
        wait_replaced(fleet, index, actor)
    lists = replica_loras(fleet)
    assert lists[0] == lists[1] and [(d["lora_name"], d["lora_int_id"], d["version"]) for d in lists[0]] == [
        ("b", 7, 1)
    ]
    assert set(fleet._loras) == {"b"}
    for index in (0, 1):
        assert tokens(served(fleet, index, prompts, LoRARequest("b", 7))) == expected["c"]
    assert fleet.remove_lora(7) and not fleet.remove_lora(7)
    assert replica_loras(fleet) == [[], []] and fleet.list_loras() == [] and fleet._loras == {}
