"""SGLang's distributed weight transport (`/init_weights_update_group` + `/update_weights_from_distributed`), as
slime, AReaL and verl's trainers drive it: an ordinary torch.distributed group that the trainer creates with
`init_method=tcp://address:port` (rank 0) and the engine's workers join at `rank_offset + tensor-parallel rank`,
gloo on CPU or NCCL on GPUs.

Each update declares `names`, `dtypes` and `shapes`; the trainer then broadcasts from rank 0 either one tensor per
name, in list order (`load_format` None), or one uint8 buffer holding them back to back (`"flattened_bucket"`).
The group is built the way those trainers build theirs (rendezvous, a store prefixed with `group_name`, then the
backend), so both sides meet on the same keys.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroup, Store

from hotswap.config import WeightTransferConfig
from hotswap.transfer.base import declared_from_info
from hotswap.transfer.torch_dist import TorchDistEngine, _root, _tensor_view, _wait
from hotswap.weights.update import WeightSource


def custom_group(
    address: str, port: int, rank: int, world: int, timeout_s: float, backend: str, group_name: str
) -> tuple[Store, ProcessGroup]:
    """(store, group): the trainer's custom process group, joined as `rank` of `world`."""
    from torch.distributed.distributed_c10d import GroupName, PrefixStore, _new_process_group_helper, _world
    from torch.distributed.rendezvous import rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(rendezvous(f"tcp://{address}:{port}", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world, rank, [], backend, prefixed, group_name=GroupName(group_name), backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    return store, group


class SglangDistEngine(TorchDistEngine):
    """Worker side (init_info: master_address, master_port, rank_offset, world_size, group_name, backend "gloo" |
    "nccl"). Joins in the background like torch_dist; an update's tensors arrive as SGLang's trainers send them."""

    def __init__(self, init_info: dict[str, Any], config: WeightTransferConfig) -> None:
        self.group_name = str(init_info.get("group_name", "weight_update_group"))
        self.dist_backend = str(init_info.get("dist_backend", "gloo"))
        if self.dist_backend not in ("gloo", "nccl"):
            raise ValueError(f"the group's backend must be 'gloo' or 'nccl', got {self.dist_backend!r}")
        info = dict(init_info)
        info.setdefault("device", "cuda" if self.dist_backend == "nccl" else "cpu")
        super().__init__(info, config)

    def _connect(
        self, address: str, port: int, rank: int, world: int, timeout_s: float, device: str
    ) -> tuple[Store, ProcessGroup]:
        return custom_group(address, port, rank, world, timeout_s, self.dist_backend, self.group_name)

    def source(self, update_info: dict[str, Any]) -> WeightSource:
        declared = declared_from_info(update_info)
        fmt = update_info.get("load_format")
        if fmt not in (None, "flattened_bucket"):
            raise ValueError(f"load_format must be None or 'flattened_bucket', got {fmt!r}")
        sizes = [torch.empty((), dtype=d).element_size() * math.prod(s) for _, d, s in declared]

        def per_name() -> Iterator[tuple[str, torch.Tensor]]:
            self._joining.join()
            self.ready()
            for name, dtype, shape in declared:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                work = self.group.broadcast([tensor], _root(0))
                self._works = [work]
                _wait(work)
                yield name, tensor
            self._works = []

        def bucket() -> Iterator[tuple[str, torch.Tensor]]:
            self._joining.join()
            self.ready()
            buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            work = self.group.broadcast([buffer], _root(0))
            self._works = [work]
            _wait(work)
            self._works = []
            offset = 0
            for (name, dtype, shape), size in zip(declared, sizes, strict=True):
                yield name, _tensor_view(buffer, offset, dtype, shape)
                offset += size

        if fmt == "flattened_bucket" and declared:
            return WeightSource(declared, bucket, description="flattened bucket")
        return WeightSource(declared, per_name, description="distributed update")

    def shutdown(self) -> None:
        group = self.group
        super().shutdown()
        if group is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group(group)  # frees the group name for a later init
            except Exception:  # already gone with its peers
                pass
