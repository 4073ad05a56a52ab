"""Replicas that join and leave a running fleet (`add_replicas` / `remove_replicas`, and their admin routes), and a
standalone server that joins a live one (`hotswap serve --join`)."""

from __future__ import annotations

import re
import sys
import threading
import time

import httpx
import pytest

from conftest import PROMPTS
from hotswap import SamplingParams
from hotswap.entrypoints.client import AdminClient
from hotswap.testing import make_tiny_lora
from server_helpers import running_server
from transfer_helpers import Pusher

ray = pytest.importorskip("ray")

from test_fleet import _normal_steps, _slow_steps, replica_serves  # noqa: E402

from hotswap.fleet import Fleet  # noqa: E402

pytestmark = pytest.mark.timeout(600)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas cannot import this test module


@pytest.fixture(scope="module")
def fleet(ckpts):
    f = Fleet(
        str(ckpts["A"]),
        num_replicas=1,
        num_gpus_per_worker=0,
        health_check_interval_s=0.2,
        health_check_timeout_s=10,
        ray_init_kwargs={"num_cpus": 2, "object_store_memory": 256 << 20},
        weight_transfer_config={"timeout_s": 20},
    )
    yield f
    f.shutdown()
    ray.shutdown()


class Traffic:
    """Generates batches on the fleet in a thread until stopped: every output is kept, every error raised at the
    end."""

    def __init__(self, fleet: Fleet, params: SamplingParams = GREEDY) -> None:
        self.fleet, self.params, self.outs, self.errors = fleet, params, [], []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.outs += self.fleet.generate(PROMPTS[:4], self.params)
            except Exception as err:  # kept for the test to raise
                self.errors.append(err)
                return

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)
        assert not self.thread.is_alive() and not self.errors, self.errors
        assert self.outs and all(
            o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == self.params.max_tokens
            for o in self.outs
        )


def test_a_replica_added_after_a_run_of_pushes_serves_the_fleets_version_with_equal_checksums(fleet, ckpts, b_tensors):
    from safetensors.torch import load_file

    a_tensors = list(load_file(str(ckpts["A"] / "model.safetensors")).items())
    fleet.update_config({"weight_transfer_config": {"timeout_s": 17.0}})
    pusher = Pusher(fleet, "tensors")  # a transport the new replica must get too
    try:
        for step, tensors in enumerate((b_tensors, a_tensors, b_tensors), start=1):
            pusher.push(tensors, weight_version=f"step-{step}")  # sessions: no folder holds the version
        version = fleet.get_weight_version()
        with Traffic(fleet) as traffic:
            started = time.monotonic()
            assert fleet.add_replicas(1) == [1]
            joined = time.monotonic() - started
            deadline = time.monotonic() + 60
            while fleet.router.routed.get(1, 0) == 0:  # requests reach the new replica
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert {o.outputs[0].weight_versions[0].label for o in traffic.outs} == {"step-3"}
        new = fleet.members[1]
        assert new.state == "up" and new.restored_from == "copy" and new.version == version
        sums = fleet.replica_checksums()
        assert sums[0] == sums[1] and len(sums[1]) > 0
        assert [r["weight_version"] for r in fleet.replica_status()] == ["step-3", "step-3"]
        assert replica_serves(fleet, 1, ckpts["B"])
        timeouts = ray.get(
            new.actor.collective_rpc.remote(lambda w: w.config.weight_transfer_config.timeout_s, (), None)
        )
        assert timeouts == [17.0]
        assert fleet.num_replicas == 2 and fleet.counters["replicas_added"] == 1
        pusher.push(a_tensors, weight_version="step-4")  # an update after the join includes the new replica
    finally:
        pusher.close()
    assert [m.version for m in fleet.members] == [version + 1] * 2
    assert replica_serves(fleet, 1, ckpts["A"])
    print(f"\nreplica 1 joined in {joined:.1f} s (weights copied, {len(sums[1])} checksums equal)")


def test_a_replica_removed_mid_run_leaves_routing_at_once_and_finishes_its_requests(fleet):
    assert fleet.routable() == [0, 1]
    ray.get(fleet.members[1].actor.collective_rpc.remote(_slow_steps, (), None))  # its requests run for a while
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    box: dict = {}
    batch = threading.Thread(target=lambda: box.setdefault("outs", fleet.generate(PROMPTS[:4], long)))
    with Traffic(fleet) as traffic:
        batch.start()
        deadline = time.monotonic() + 60
        while fleet.router.requests_on(1) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        done = threading.Thread(target=lambda: box.setdefault("removed", fleet.remove_replicas(indices=[1])))
        done.start()
        deadline = time.monotonic() + 10
        while fleet.routable() != [0]:  # out of routing at once, while its requests still run
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert fleet.router.requests_on(1) > 0 and fleet.members[1].leaving
        routed = fleet.router.routed.get(1, 0)
        done.join(timeout=120)
        batch.join(timeout=120)
        assert fleet.router.routed.get(1, 0) == routed  # nothing new was routed to it
    assert box["removed"] == [1] and fleet.members[1].state == "removed"
    assert [o.outputs[0].finish_reason for o in box["outs"]] == ["length"] * 4  # none cut
    assert all(len(o.outputs[0].token_ids) == 60 for o in box["outs"])
    assert len(traffic.outs) > 0 and fleet.num_replicas == 1
    assert [r["state"] for r in fleet.replica_status()] == ["up", "removed"]
    fleet.collective_rpc(_normal_steps)


def test_an_add_while_a_session_is_open_waits_for_it_and_joins_at_the_committed_version(fleet, ckpts, b_tensors):
    pusher = Pusher(fleet, "tensors")
    box: dict = {}
    try:
        fleet.start_weight_update()
        pusher.update(b_tensors)
        adding = threading.Thread(target=lambda: box.setdefault("added", fleet.add_replicas(1)))
        adding.start()
        deadline = time.monotonic() + 120
        while len(fleet.members) < 3 or fleet.members[2].actor is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ray.get(fleet.members[2].actor.status.remote(), timeout=120)  # loaded: now it waits for the session
        time.sleep(1.0)
        assert adding.is_alive() and fleet.members[2].state == "joining" and fleet.routable() == [0]
        fleet.finish_weight_update(weight_version="during-join")
        adding.join(timeout=120)
    finally:
        pusher.close()
    assert box["added"] == [2]
    assert fleet.get_weight_version_label() == "during-join" and fleet.routable() == [0, 2]
    assert fleet.members[2].version == fleet.version and fleet.members[2].restored_from == "copy"
    sums = fleet.replica_checksums()
    assert sums[0] == sums[2]
    assert replica_serves(fleet, 2, ckpts["B"])


def test_removing_the_last_replica_is_refused_and_the_admin_routes_add_and_remove(fleet):
    from fastapi.testclient import TestClient

    from hotswap.entrypoints.server.app import create_app
    from hotswap.fleet.async_fleet import AsyncFleet

    with pytest.raises(ValueError, match="would leave none"):
        fleet.remove_replicas(2)
    with pytest.raises(ValueError, match=r"no replica \[1\]"):
        fleet.remove_replicas(indices=[1])  # removed already
    with pytest.raises(ValueError, match="not both"):
        fleet.remove_replicas(1, [0])
    client = TestClient(create_app(AsyncFleet(fleet), "A", admin_key="k", allowed_hosts=None))  # no lifespan
    admin = {"Authorization": "Bearer k"}
    assert client.post("/fleet/add_replicas", json={"n": 0}, headers=admin).status_code == 400
    answer = client.post("/fleet/remove_replicas", json={"n": 1, "drain_timeout_s": 30}, headers=admin)
    assert answer.status_code == 200 and answer.json()["removed"] == [2]  # the newest goes first
    refused = client.post("/fleet/remove_replicas", json={"n": 1}, headers=admin)
    assert refused.status_code == 400 and "would leave none" in refused.json()["error"]["message"]
    status = client.get("/fleet_status", headers=admin).json()
    assert [r["state"] for r in status["replicas"]] == ["up", "removed", "removed"]
    assert fleet.routable() == [0] and all(o.finished for o in fleet.generate(PROMPTS[:2], GREEDY))


# ---- a standalone server joining a live one -----------------------------------------------------------------


@pytest.mark.unit
def test_the_state_stream_carries_every_dtype_and_shape_bit_for_bit():
    import asyncio

    import torch

    from hotswap.entrypoints.server import join

    tensors = {
        "w": torch.randn(3, 4),
        "bf": torch.randn(5).to(torch.bfloat16),
        "scalar": torch.tensor(7),
        "empty": torch.empty(0, 2),
        "strided": torch.randn(4, 3).t(),
        "mask": torch.tensor([True, False]),
    }
    snapshot = {
        "meta": {"kind": "state"},
        "states": [tensors],
        "loras": [{"lora_name": "x", "tensors": {"lora_A.weight": torch.ones(2, 3)}}],
    }
    data = b"".join(join._frames(snapshot))

    async def chunks():  # boundaries that cut headers and tensors anywhere
        for i in range(0, len(data), 7):
            yield data[i : i + 7]

    async def read():
        reader = join._Reader(chunks())
        got = {"meta": await reader.header()}
        while (header := await reader.header())["kind"] != "end":
            got[header["name"]] = join._tensor(header, await reader.read(header["nbytes"]))
        return got, header

    got, end = asyncio.run(read())
    assert got["meta"] == {"kind": "state"} and end["tensors"] == len(tensors) + 1
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape and torch.equal(got[name], tensor)
    assert torch.equal(got["lora_A.weight"], torch.ones(2, 3))


@pytest.mark.slow
def test_a_server_joining_a_live_one_mid_run_copies_its_version_and_answers_503_until_caught_up(
    ckpts, b_tensors, tmp_path
):
    import subprocess

    adapter = make_tiny_lora(ckpts["A"], tmp_path / "lora", rank=8, seed=1)
    lora = ("--enable-lora", "--max-lora-rank", "8")
    admin_headers = {"Authorization": "Bearer k"}
    with running_server(str(ckpts["A"]), "--admin-key", "k", "--served-model-name", "A", *lora) as live:
        admin = AdminClient(live, admin_key="k")
        try:
            admin.load_lora_adapter("a", str(adapter))
            from safetensors.torch import load_file

            a_tensors = list(load_file(str(ckpts["A"] / "model.safetensors")).items())
            admin.push_weights(b_tensors, backend="shm", weight_version="step-1")
            admin.push_weights(a_tensors, backend="shm", weight_version="step-2")
            token = admin._call("POST", "/start_weight_update")["session_token"]  # an update in flight
            log = tmp_path / "joiner.log"
            with open(log, "w") as out:
                joiner = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "hotswap",
                        "serve",
                        str(ckpts["A"]),
                        "--port",
                        "0",
                        "--admin-key",
                        "k",
                        "--served-model-name",
                        "A",
                        "--join",
                        live,
                        *lora,
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            try:
                deadline = time.monotonic() + 120
                base = None
                while base is None:
                    assert time.monotonic() < deadline and joiner.poll() is None, log.read_text()
                    found = re.search(r"serving .* on (http://\S+:\d+)", log.read_text())
                    base = found.group(1) if found else None
                    time.sleep(0.1)
                health = None
                while health is None or health.status_code != 503:  # up, not ready: the update is open
                    assert time.monotonic() < deadline and joiner.poll() is None, log.read_text()
                    try:
                        health = httpx.get(f"{base}/health", timeout=5)
                    except httpx.HTTPError:
                        time.sleep(0.1)
                assert "catching up" in health.json()["reason"]
                body = {"model": "A", "prompt": "hello", "max_tokens": 4}
                refused = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
                assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
                time.sleep(1.0)
                assert httpx.get(f"{base}/health", timeout=5).status_code == 503  # still waiting for the update
                info = admin._shm.write(b_tensors) if admin._shm is not None else None
                if info is None:
                    raise AssertionError("the shm sender is set up by push_weights")
                admin._call("POST", "/update_weights", {"update_info": info, "session_token": token})
                finished = time.monotonic()
                admin._call("POST", "/finish_weight_update", {"weight_version": "step-3", "session_token": token})
                while httpx.get(f"{base}/health", timeout=5).status_code != 200:
                    assert time.monotonic() < deadline and joiner.poll() is None, log.read_text()
                    time.sleep(0.1)
                caught_up = time.monotonic() - finished
                joined = AdminClient(base, admin_key="k")
                try:
                    assert joined.get_weight_version() == admin.get_weight_version() == "step-3"
                    theirs, mine = admin.checksums(), joined.checksums()
                    assert mine == theirs and len(mine) > 0
                    assert "weights from copy" in log.read_text()
                    for model in ("A", "a"):  # the base model and the copied adapter answer alike
                        body = {
                            "model": model,
                            "prompt": PROMPTS[0],
                            "max_tokens": 8,
                            "temperature": 0,
                            "ignore_eos": True,
                            "return_token_ids": True,
                        }
                        outs = [
                            httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
                            for url in (live, base)
                        ]
                        assert outs[0]["token_ids"] == outs[1]["token_ids"]
                        assert outs[1]["weight_versions"][0][0] == "step-3"
                    loras = [httpx.get(f"{url}/v1/models", timeout=30).json()["data"] for url in (live, base)]
                    assert [m["id"] for m in loras[0]] == [m["id"] for m in loras[1]]
                    assert httpx.get(f"{base}/export_state", headers=admin_headers, timeout=30).status_code == 200
                finally:
                    joined.close()
            finally:
                joiner.terminate()
                joiner.wait(timeout=30)
            # a version a folder holds: a second joiner reloads the folder, checked against the live checksums
            admin.reload_weights(str(ckpts["B"]), weight_version="step-4")
            log2 = tmp_path / "joiner2.log"
            with running_server(
                str(ckpts["A"]), "--admin-key", "k", "--served-model-name", "A", "--join", live, *lora, log=log2
            ) as second:
                joined = AdminClient(second, admin_key="k")
                try:
                    assert joined.get_weight_version() == "step-4"
                    assert joined.checksums() == admin.checksums()
                finally:
                    joined.close()
                assert "weights from folder" in log2.read_text()
        finally:
            admin.close()
    print(f"\njoiner caught up {caught_up:.1f} s after the live update finished; {len(mine)} checksums equal")
