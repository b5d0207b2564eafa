"""Hybrid sharding: which ranks shard the state together and which replicate it.

[Note: hybrid sharding] With ``shard_size=S`` (or a 2-D DeviceMesh of
(replicate, shard) dimensions) the N ranks form N/S *shard groups* of S
consecutive ranks (torchrun numbers ranks node by node, so a shard group is
usually a node) and S *replica groups* of the ranks at the same position in
every shard group. State is sharded inside a shard group exactly as without
hybrid sharding over S ranks; each shard group holds a full copy. Gradients
are reduce-scattered inside the shard group, then each rank's shard is
all-reduced across its replica group (2Ψ/S elements per rank over the slow
link, instead of the whole gradient); parameters are all-gathered inside the
shard group. The per-step statistics (norms, which parameters got a
gradient) are all-reduced over every rank, each shard counted once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist


@dataclass(frozen=True)
class Groups:
    shard: dist.ProcessGroup                 # the S ranks that shard the state together
    replicate: Optional[dist.ProcessGroup]   # the ranks holding the same shard; None: no replicas
    every: dist.ProcessGroup                 # shard x replicate: what the statistics reduce over

    @property
    def replicas(self) -> int:
        return 1 if self.replicate is None else dist.get_world_size(self.replicate)

    @property
    def replica_rank(self) -> int:
        return 0 if self.replicate is None else dist.get_rank(self.replicate)


# shard_size -> (the default group they were made in, shard group, replica group); made
# again in a new default group (after destroy_process_group and a new init, as a restart does)
_made: Dict[int, Tuple[Any, dist.ProcessGroup, dist.ProcessGroup]] = {}


def groups(process_group: Optional[dist.ProcessGroup], shard_size: Optional[int], device_mesh, who: str) -> Groups:
    """The groups a front door runs over; ``who`` names it in errors."""
    who = f"[rank {dist.get_rank()}/{dist.get_world_size()}] {who}"
    if device_mesh is not None:
        if process_group is not None or shard_size is not None:
            raise ValueError(f"{who}: pass device_mesh alone (its dimensions already say which ranks shard "
                             "and which replicate), not with process_group or shard_size")
        if device_mesh.ndim != 2:
            raise ValueError(f"{who}: device_mesh must be 2-D, (replicate, shard) as FSDP2's HSDP takes it; "
                             f"got a {device_mesh.ndim}-D mesh of shape {tuple(device_mesh.shape)}")
        shard, replicate = device_mesh.get_group(1), device_mesh.get_group(0)
        return Groups(shard, replicate if dist.get_world_size(replicate) > 1 else None, dist.group.WORLD)
    if shard_size is None:
        pg = process_group if process_group is not None else dist.group.WORLD
        return Groups(pg, None, pg)
    if process_group is not None:
        raise ValueError(f"{who}: pass process_group or shard_size, not both (shard_size splits the whole "
                         "world into shard groups; for a sub-group, build a 2-D DeviceMesh over it)")
    world = dist.get_world_size()
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1 or world % shard_size:
        raise ValueError(f"{who}: shard_size must be a positive integer dividing the world size ({world}), "
                         f"got {shard_size!r}; usually the number of GPUs per node")
    if shard_size == world:
        return Groups(dist.group.WORLD, None, dist.group.WORLD)
    made = _made.get(shard_size)
    if made is None or made[0] is not dist.group.WORLD:
        made = _made[shard_size] = (dist.group.WORLD, *_make(shard_size, world))
    _, shard, replicate = made
    return Groups(shard, replicate if world // shard_size > 1 else None, dist.group.WORLD)


def _make(size: int, world: int) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's shard group (consecutive ranks) and replica group; every rank
    creates every group, in one order, as torch.distributed.new_group requires."""
    rank = dist.get_rank()
    mine = {}
    for first in range(0, world, size):
        g = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine["shard"] = g
    for pos in range(size):
        g = dist.new_group(list(range(pos, world, size)))
        if rank % size == pos:
            mine["replicate"] = g
    return mine["shard"], mine["replicate"]
