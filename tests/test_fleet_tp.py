"""A fleet of tensor-parallel replicas: two replicas of two worker processes each, in their placement groups."""

from __future__ import annotations

import pytest

from conftest import PROMPTS, hf_greedy
from hotswap import SamplingParams
from transfer_helpers import Pusher

ray = pytest.importorskip("ray")

from hotswap.fleet import Fleet  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_tensor_parallel_replicas_generate_and_take_one_broadcast(ckpts, b_tensors):
    fleet = Fleet(
        str(ckpts["A"]),
        num_replicas=2,
        tensor_parallel_size=2,
        num_cpus_per_worker=0.5,
        num_gpus_per_worker=0,
        ray_init_kwargs={"num_cpus": 2, "object_store_memory": 256 << 20},
    )
    try:
        tok = fleet.get_tokenizer()
        assert fleet.get_world_size() == 4
        bundles = [ray.util.placement_group_table(m.placement_group)["bundles"] for m in fleet.members]
        assert bundles == [{0: {"CPU": 1.0}}] * 2  # each replica's two workers reserved together
        outs = fleet.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [
            hf_greedy(str(ckpts["A"]), tuple(tok.encode(p)), 10)[0] for p in PROMPTS
        ]
        assert all(count > 0 for count in fleet.router.routed.values()) and len(fleet.router.routed) == 2
        pusher = Pusher(fleet, "torch_dist", bucket_size_bytes=1 << 20)
        try:
            assert pusher.dist.group.size() == 1 + 4  # the trainer and all four workers
            pusher.push(b_tensors)
        finally:
            pusher.close()
        assert fleet.get_weight_version() == 1 and [m.version for m in fleet.members] == [1, 1]
        outs = fleet.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [
            hf_greedy(str(ckpts["B"]), tuple(tok.encode(p)), 10)[0] for p in PROMPTS
        ]
        sums = fleet.replica_checksums()
        assert sums[0] == sums[1]
    finally:
        fleet.shutdown()
        ray.shutdown()
