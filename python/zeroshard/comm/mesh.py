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
gradient) are all-reduced over every rank, each shard counted once. Beside a
tensor-parallel axis the 2-D mesh is the dp dimensions of a (replicate, shard,
tp) mesh: "every rank" is then the dp ranks of this tp place (``_plane``), and
the statistics go on over tp ([Note: tensor-parallel parameters]).

[Note: param groups over their own ranks] Expert parallelism puts different
experts on different ranks: the ``ep`` ranks of an expert-parallel group each
hold other experts, and the ranks holding the same experts form an
expert-data-parallel group (``edp``, world / ep ranks). A param group whose
``"device_mesh"`` is such a 1-D mesh (``mesh["edp"]``) is sharded, reduced and
gathered over that group's ranks only (``ShardGroup``); the rest over the
optimizer's own group. Under FullyShard the same holds for the unit of each
module of a class in ``expert_modules``. The groups of the mesh dimension must split the world
into disjoint groups of equal size (``color``: which one this rank is in, of
``count``). An expert's gradient is still divided by the whole data-parallel
size, not its group's: its ep peers' tokens reached it through the
all-to-all, so the sum over its group already covers the whole batch. The
per-parameter statistics give each parameter of such a group ``count``
slots, one per group, so one all-reduce over every rank still serves: each
rank reads its own group's slot, and the total norm sums every slot (each
expert counted once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """Which ranks shard the state together and which replicate it: a sharding policy.

    Args:
        process_group: the data-parallel ranks to shard over (default: the world).
        shard_size: hybrid sharding: shard over groups of this many consecutive ranks
            (usually a node's GPUs) and replicate across them ([Note: hybrid sharding]).
        device_mesh: a 1-D DeviceMesh (shard over its ranks) or a 2-D one, (replicate,
            shard) as FSDP2's HSDP takes it; alone, not with the two above.
        expert_modules: FullyShard's ``{ExpertClass: mesh["edp"]}``: each module of such
            a class is a unit sharded over that 1-D mesh's ranks (expert parallelism; at
            stages 1/2 a param group's ``"device_mesh"`` does it: docs/experts.md).
    """

    process_group: Optional[Any] = None
    shard_size: Optional[int] = None
    device_mesh: Optional[Any] = None
    expert_modules: Optional[Dict[type, Any]] = None

    def __post_init__(self):
        if self.device_mesh is not None and (self.process_group is not None or self.shard_size is not None):
            raise ValueError(
                "Sharding: pass device_mesh alone (its dimensions already say which ranks shard and "
                "which replicate), not with process_group or shard_size"
            )
        if self.shard_size is not None and self.process_group is not None:
            raise ValueError(
                "Sharding: pass process_group or shard_size, not both (shard_size splits the whole "
                "world into shard groups; for a sub-group, build a 2-D DeviceMesh over it)"
            )
        if self.shard_size is not None and (
            not isinstance(self.shard_size, int) or isinstance(self.shard_size, bool) or self.shard_size < 1
        ):
            raise ValueError(
                f"Sharding: shard_size must be a positive integer dividing the world size, got "
                f"{self.shard_size!r}; usually the number of GPUs per node"
            )
        if self.device_mesh is not None and getattr(self.device_mesh, "ndim", None) not in (1, 2):
            raise ValueError(
                f"Sharding: device_mesh must be 1-D (the ranks to shard over) or 2-D, (replicate, "
                f"shard) as FSDP2's HSDP takes it; got {self.device_mesh!r}"
            )
        if self.expert_modules is not None and not (
            isinstance(self.expert_modules, dict) and all(isinstance(c, type) for c in self.expert_modules)
        ):
            raise TypeError(
                f"Sharding: expert_modules must be a dict {{ExpertClass: mesh['edp']}}, got {self.expert_modules!r}"
            )

    def groups(self, who: str) -> "Groups":
        """The groups this policy runs over (collective the first time a shard_size is used)."""
        return groups(self.process_group, self.shard_size, self.device_mesh, who)


@dataclass(frozen=True)
class Groups:
    shard: dist.ProcessGroup  # the S ranks that shard the state together
    replicate: Optional[dist.ProcessGroup]  # the ranks holding the same shard; None: no replicas
    every: dist.ProcessGroup  # shard x replicate: what the statistics reduce over

    @property
    def replicas(self) -> int:
        return 1 if self.replicate is None else dist.get_world_size(self.replicate)

    @property
    def replica_rank(self) -> int:
        return 0 if self.replicate is None else dist.get_rank(self.replicate)


@dataclass(frozen=True, eq=False)
class ShardGroup:
    """The ranks one flat buffer is sharded over ([Note: param groups over their own
    ranks]): the optimizer's shard group (color 0 of 1) or a param group's own, one of
    ``count`` disjoint groups of equal size that make up every rank."""

    group: dist.ProcessGroup
    world: int
    rank: int  # this rank's place in it
    color: int = 0  # which of the ``count`` groups this rank's is
    count: int = 1

    @property
    def own(self) -> bool:
        """A param group's own ranks, not the optimizer's."""
        return self.count > 1


def shard_group(pg: dist.ProcessGroup) -> ShardGroup:
    return ShardGroup(pg, dist.get_world_size(pg), dist.get_rank(pg))


def param_group_shards(param_groups: List[dict], groups: Groups, who: str) -> List[Optional[ShardGroup]]:
    """Each param group's own ShardGroup (from its ``"device_mesh"``), or None for the
    optimizer's; collective over every rank (one exchange, whatever the groups)."""
    return mesh_shards(
        [g.get("device_mesh") for g in param_groups],
        groups,
        who,
        [f"param group {gi}'s 'device_mesh'" for gi in range(len(param_groups))],
    )


def mesh_shards(meshes: list, groups: Groups, who: str, labels: List[str]) -> List[Optional[ShardGroup]]:
    """The ShardGroup of each 1-D mesh in ``meshes`` (None stays None: the front door's own
    ranks), ``labels`` naming each in errors; collective over every rank (one exchange)."""
    if all(m is None for m in meshes):
        return [None] * len(meshes)
    who = f"[rank {dist.get_rank()}/{dist.get_world_size()}] {who}"
    for label, m in zip(labels, meshes):
        if m is not None and (getattr(m, "ndim", None) != 1 or not hasattr(m, "get_group")):
            raise ValueError(
                f"{who}: {label} must be a 1-D DeviceMesh (the ranks its parameters shard "
                f"over, e.g. mesh['edp'] of an (edp, ep) mesh); got {m!r}"
            )
    if groups.replicate is not None:
        first = next(label for label, m in zip(labels, meshes) if m is not None)
        raise ValueError(
            f"{who}: ranks of their own ({first}: expert parallelism) cannot be combined with "
            "hybrid sharding (shard_size= or a 2-D device_mesh) yet; drop one of them"
        )
    pgs = [None if m is None else m.get_group() for m in meshes]
    mine = [None if pg is None else tuple(dist.get_process_group_ranks(pg)) for pg in pgs]
    everyone = [mine]
    if dist.get_world_size(groups.every) > 1:
        everyone = [None] * dist.get_world_size(groups.every)
        dist.all_gather_object(everyone, mine, group=groups.every)
    world = sorted(dist.get_process_group_ranks(groups.every))
    out: List[Optional[ShardGroup]] = []
    made: Dict[Any, ShardGroup] = {}  # entries over one mesh share its ShardGroup
    for k, pg in enumerate(pgs):
        seen = [theirs[k] if k < len(theirs) else None for theirs in everyone]
        if any((s is None) != (pg is None) for s in seen):
            raise ValueError(
                f"{who}: {labels[k]} is given on some ranks but not on others; every rank must build the same"
            )
        if pg is None:
            out.append(None)
            continue
        distinct = sorted(set(seen))
        covered = sorted(r for ranks in distinct for r in ranks)
        if covered != world or len({len(d) for d in distinct}) != 1:
            raise ValueError(
                f"{who}: {labels[k]}'s groups {distinct} do not split the {len(world)} "
                "data-parallel ranks into disjoint groups of one size; build it as one dimension "
                "of a DeviceMesh over all of them, e.g. init_device_mesh(device, (world // ep, "
                "ep), mesh_dim_names=('edp', 'ep'))['edp']"
            )
        if pg not in made:
            made[pg] = ShardGroup(
                pg, dist.get_world_size(pg), dist.get_rank(pg), distinct.index(mine[k]), len(distinct)
            )
        out.append(made[pg])
    return out


# shard_size -> (the default group they were made in, shard group, replica group); made
# again in a new default group (after destroy_process_group and a new init, as a restart does)
_made: Dict[int, Tuple[Any, dist.ProcessGroup, dist.ProcessGroup]] = {}


def groups(process_group: Optional[dist.ProcessGroup], shard_size: Optional[int], device_mesh, who: str) -> Groups:
    """The groups a front door runs over; ``who`` names it in errors."""
    who = f"[rank {dist.get_rank()}/{dist.get_world_size()}] {who}"
    if device_mesh is not None:
        if process_group is not None or shard_size is not None:
            raise ValueError(
                f"{who}: pass device_mesh alone (its dimensions already say which ranks shard "
                "and which replicate), not with process_group or shard_size"
            )
        if device_mesh.ndim == 1:  # (as FSDP2's: shard over its ranks; mesh["dp"] beside a tp axis)
            pg = device_mesh.get_group()
            return Groups(pg, None, pg)
        if device_mesh.ndim != 2:
            raise ValueError(
                f"{who}: device_mesh must be 1-D (the ranks to shard over) or 2-D, (replicate, "
                f"shard) as FSDP2's HSDP takes it; got a {device_mesh.ndim}-D mesh of shape "
                f"{tuple(device_mesh.shape)}"
            )
        shard, replicate = device_mesh.get_group(1), device_mesh.get_group(0)
        every = dist.group.WORLD if device_mesh.size() == dist.get_world_size() else _plane(device_mesh, who)
        return Groups(shard, replicate if dist.get_world_size(replicate) > 1 else None, every)
    if shard_size is None:
        pg = process_group if process_group is not None else dist.group.WORLD
        return Groups(pg, None, pg)
    if process_group is not None:
        raise ValueError(
            f"{who}: pass process_group or shard_size, not both (shard_size splits the whole "
            "world into shard groups; for a sub-group, build a 2-D DeviceMesh over it)"
        )
    world = dist.get_world_size()
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1 or world % shard_size:
        raise ValueError(
            f"{who}: shard_size must be a positive integer dividing the world size ({world}), "
            f"got {shard_size!r}; usually the number of GPUs per node"
        )
    if shard_size == world:
        return Groups(dist.group.WORLD, None, dist.group.WORLD)
    made = _made.get(shard_size)
    if made is None or made[0] is not dist.group.WORLD:
        made = _made[shard_size] = (dist.group.WORLD, *_make(shard_size, world))
    _, shard, replicate = made
    return Groups(shard, replicate if world // shard_size > 1 else None, dist.group.WORLD)


# the ranks of each 2-D mesh that spans part of the world -> (the default group, their group)
_planes: Dict[Tuple[Tuple[int, ...], ...], Tuple[Any, dist.ProcessGroup]] = {}


def _plane(device_mesh, who: str) -> dist.ProcessGroup:
    """The group of a 2-D mesh's ranks where it spans part of the world (mesh["rep", "shard"]
    of a (rep, shard, tp) mesh: the data-parallel ranks of this tp place), what the
    statistics reduce over. Every rank names its plane; each distinct one is made, in one
    order on every rank (collective over the world, once per layout)."""
    mine = tuple(sorted(int(r) for r in device_mesh.mesh.flatten().tolist()))
    planes = [None] * dist.get_world_size()
    dist.all_gather_object(planes, mine)
    distinct = tuple(sorted(set(planes)))
    covered = sorted(r for plane in distinct for r in plane)
    if covered != list(range(dist.get_world_size())):
        raise ValueError(
            f"{who}: the 2-D device_mesh's ranks {list(mine)} and the other ranks' do not split the "
            f"world into disjoint groups ({list(distinct)}); build it as two dimensions of one "
            "DeviceMesh over every rank, e.g. init_device_mesh(device, (rep, shard, tp), "
            "mesh_dim_names=('rep', 'shard', 'tp'))['rep', 'shard']"
        )
    made = _planes.get(distinct)
    if made is None or made[0] is not dist.group.WORLD:
        groups_made = [dist.new_group(list(plane)) for plane in distinct]
        made = _planes[distinct] = (dist.group.WORLD, groups_made[distinct.index(mine)])
    return made[1]


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


# (the default group they were made in, the ranks of a post-forward group) -> its ShardGroup
_post_forward: Dict[Tuple[Any, Tuple[int, ...]], ShardGroup] = {}


def post_forward_group(ranks: ShardGroup, size: int) -> ShardGroup:
    """This rank's group of ``size`` consecutive ranks of its shard group ``ranks``: where a
    unit's backward gathers under ``reshard_after_forward=size`` ([Note: post-forward
    shards] in zero3/gather.py). Made once, by its own ranks only (the others make theirs)."""
    everyone = dist.get_process_group_ranks(ranks.group)
    first = ranks.rank // size * size
    block = tuple(everyone[first : first + size])
    made = _post_forward.get((dist.group.WORLD, block))
    if made is None:
        pg = dist.new_group(list(block), use_local_synchronization=True)
        made = _post_forward[(dist.group.WORLD, block)] = ShardGroup(pg, size, dist.get_rank(pg))
    return made
