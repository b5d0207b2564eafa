"""What a ShardedOptimizer's layouts are made with, and the shard source made from it.

A ``Binding`` holds the optimizer's distribution options (its ``Sharding``, stage,
reduction, ``Offload``) for the first layout and every later one (a new param group,
FullyShard's units laid out again); ``make_source`` picks the stage's shard source for
the parameters ([Note: shard sources] in core/source.py): ``FlatReducer`` for plain
parameters (ZeRO-1/2), ``UnitSource`` for FullyShard's (ZeRO-3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ..comm import mesh
from ..comm.mesh import Sharding
from ..core.policies import optimizer_offload_of
from ..core.source import Rebind, ShardSource
from ..offload import Offload, parse_offload
from ..zero12.reducer import FlatReducer
from ..zero3.records import left_out, owner_of
from ..zero3.source import UnitSource


@dataclass(frozen=True)
class Binding:
    """What every layout of a ShardedOptimizer's parameters is made with (its first, and each
    after a new param group or a relayout): the ranks, the stage, the reduction, the offload."""
    sharding: Sharding
    stage: int
    adam: bool                      # the fused AdamW keeps the state (else optimizer_class does)
    bucket_bytes: int
    reduce_dtype: Optional[torch.dtype]
    offload: Offload
    overlap_param_gather: bool
    whole: bool                     # a whole-tensor optimizer: each parameter in one rank's shard


def make_source(params: List[torch.Tensor], group_of: List[int], binding: Binding, names: list,
                 err, rebind: Optional[Rebind] = None, param_groups=()) -> ShardSource:
    """FlatReducer over plain parameters (ZeRO-1/2), UnitSource over FullyShard ones;
    ``names``: the parameters' names where known (compared across ranks at stages 1/2);
    ``rebind``: the ShardedOptimizer's answers to a relayout (UnitSource); ``param_groups``:
    theirs (a group's "device_mesh": [Note: param groups over their own ranks] in comm/mesh.py)."""
    sharding, owners = binding.sharding, [owner_of(p) for p in params]
    if all(o is None for o in owners):
        if sharding.expert_modules is not None:
            raise ValueError(err("Sharding(expert_modules=...) is FullyShard's; at stages 1/2 give the experts "
                                 "a param group of their own: {'params': [...], 'device_mesh': mesh['edp']} "
                                 "(docs/experts.md)"))
        made = sharding.groups("ShardedOptimizer")
        return FlatReducer(params, group_of, groups=made, shards=mesh.param_group_shards(
            param_groups, made, "ShardedOptimizer"), stage=binding.stage, adam=binding.adam,
            bucket_bytes=binding.bucket_bytes, reduce_dtype=binding.reduce_dtype, offload=binding.offload,
            overlap_param_gather=binding.overlap_param_gather, whole=binding.whole, names=names)
    if any("device_mesh" in g for g in param_groups):
        raise ValueError(err("a param group's 'device_mesh' (expert parallelism) is for ZeRO-1/2 parameters; "
                             "FullyShard parameters shard over the FullyShard's ranks: give the expert modules "
                             "their own with FullyShard(..., expert_modules={ExpertClass: mesh['edp']})"))
    if binding.overlap_param_gather:
        raise ValueError(err("overlap_param_gather is for ZeRO-1/2; FullyShard gathers each unit just before "
                             "use (its prefetch= sets how far ahead)"))
    for i, o in enumerate(owners):
        if o is None and not left_out(params[i]):
            raise ValueError(err(
                f"parameter {i} (shape {tuple(params[i].shape)}) is not a FullyShard parameter but "
                "others are; wrap the whole model in FullyShard (its root unit takes every parameter "
                "outside the wrapped blocks) and pass model.parameters()"))
    # (names unused: FullyShard compares its parameters' names across ranks itself)
    return UnitSource(params, group_of, owners, sharding, binding.reduce_dtype, binding.adam,
                      binding.offload, binding.whole, rebind)


def offload_policy(offload, offload_dir, offload_fraction, optimizer_class) -> Offload:
    """ShardedOptimizer's Offload policy, from the policy or its loose forms (which warn)."""
    loose = optimizer_offload_of("ShardedOptimizer", offload, offload_dir, offload_fraction)
    return parse_offload(*loose, optimizer_class)
