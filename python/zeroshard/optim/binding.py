"""What a ShardedOptimizer's layouts are made with, the shard source made from it, and
what is built over each layout.

A ``Binding`` holds the optimizer's distribution options (its ``Sharding``, stage,
reduction, ``Offload``) for the first layout and every later one (a new param group,
FullyShard's units laid out again); ``make_source`` picks the stage's shard source for
the parameters ([Note: shard sources] in core/source.py): ``FlatReducer`` for plain
parameters (ZeRO-1/2), ``UnitSource`` for FullyShard's (ZeRO-3). A ``Bound`` is one
layout and what the optimizer built over it, which its parts (state dicts, new
layouts, Join) read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Set

import torch
import torch.distributed as dist

from ..comm import mesh
from ..comm.mesh import Sharding
from ..core.policies import optimizer_offload_of
from ..core.hooks import weak_hook
from ..core.source import Rebind, ShardSource
from ..offload import Offload, parse_offload
from ..zero12.buffers import BufferSync
from ..zero12.reducer import FlatReducer
from ..zero3.records import left_out, owner_of
from ..zero3.source import UnitSource
from . import hand_grads
from .grads import ReducedGrads
from .rules import FusedAdamW, TorchElementwise, add_group_keys
from .whole import WholeTensor


@dataclass(frozen=True)
class Binding:
    """What every layout of a ShardedOptimizer's parameters is made with (its first, and each
    after a new param group or a relayout): the ranks, the stage, the reduction, the offload."""

    sharding: Sharding
    stage: int
    adam: bool  # the fused AdamW keeps the state (else optimizer_class does)
    bucket_bytes: int
    reduce_dtype: Optional[torch.dtype]
    offload: Offload
    overlap_param_gather: bool
    whole: bool  # a whole-tensor optimizer: each parameter in one rank's shard
    optimizer_class: type  # the class stepping the shards (torch's AdamW for the fused one)
    optimizer_kwargs: dict  # its arguments (not the fused AdamW's)
    broadcast_buffers: bool  # stages 1/2: the module buffers' broadcast ([Note: module buffers])
    names: dict  # id(parameter) -> its name, where the optimizer was given one


def make_source(
    params: List[torch.Tensor],
    group_of: List[int],
    binding: Binding,
    names: list,
    err,
    rebind: Optional[Rebind] = None,
    param_groups=(),
) -> ShardSource:
    """FlatReducer over plain parameters (ZeRO-1/2), UnitSource over FullyShard ones;
    ``names``: the parameters' names where known (compared across ranks at stages 1/2);
    ``rebind``: the ShardedOptimizer's answers to a relayout (UnitSource); ``param_groups``:
    theirs (a group's "device_mesh": [Note: param groups over their own ranks] in comm/mesh.py)."""
    sharding, owners = binding.sharding, [owner_of(p) for p in params]
    if all(o is None for o in owners):
        if sharding.expert_modules is not None:
            raise ValueError(
                err(
                    "Sharding(expert_modules=...) is FullyShard's; at stages 1/2 give the experts "
                    "a param group of their own: {'params': [...], 'device_mesh': mesh['edp']} "
                    "(docs/experts.md)"
                )
            )
        made = sharding.groups("ShardedOptimizer")
        return FlatReducer(
            params,
            group_of,
            groups=made,
            shards=mesh.param_group_shards(param_groups, made, "ShardedOptimizer"),
            stage=binding.stage,
            adam=binding.adam,
            bucket_bytes=binding.bucket_bytes,
            reduce_dtype=binding.reduce_dtype,
            offload=binding.offload,
            overlap_param_gather=binding.overlap_param_gather,
            whole=binding.whole,
            names=names,
        )
    if any("device_mesh" in g for g in param_groups):
        raise ValueError(
            err(
                "a param group's 'device_mesh' (expert parallelism) is for ZeRO-1/2 parameters; "
                "FullyShard parameters shard over the FullyShard's ranks: give the expert modules "
                "their own with FullyShard(..., expert_modules={ExpertClass: mesh['edp']})"
            )
        )
    if binding.overlap_param_gather:
        raise ValueError(
            err(
                "overlap_param_gather is for ZeRO-1/2; FullyShard gathers each unit just before "
                "use (its prefetch= sets how far ahead)"
            )
        )
    for i, o in enumerate(owners):
        if o is None and not left_out(params[i]):
            raise ValueError(
                err(
                    f"parameter {i} (shape {tuple(params[i].shape)}) is not a FullyShard parameter but "
                    "others are; wrap the whole model in FullyShard (its root unit takes every parameter "
                    "outside the wrapped blocks), or call zeroshard.fully_shard(model) after the blocks, and "
                    "pass model.parameters()"
                )
            )
    # (names unused: FullyShard compares its parameters' names across ranks itself)
    return UnitSource(
        params, group_of, owners, sharding, binding.reduce_dtype, binding.adam, binding.offload, binding.whole, rebind
    )


def offload_policy(offload, offload_dir, offload_fraction, optimizer_class) -> Offload:
    """ShardedOptimizer's Offload policy, from the policy or its loose forms (which warn)."""
    loose = optimizer_offload_of("ShardedOptimizer", offload, offload_dir, offload_fraction)
    return parse_offload(*loose, optimizer_class)


@dataclass(eq=False)
class Bound:
    """One layout of a ShardedOptimizer's parameters and what it built over it: the shard
    source, the gradient statistics, the update rule ([Note: update rules] in optim/rules.py),
    the module buffers' broadcast ([Note: module buffers] in zero12/buffers.py) and each
    parameter's step count. Made for the first layout and again for every new one."""

    params: List[torch.Tensor]  # every parameter, in state-dict index order
    group_of: List[int]  # each one's param group
    source: ShardSource
    grads: ReducedGrads
    rule: object  # FusedAdamW, TorchElementwise or WholeTensor
    buffers: Optional[BufferSync]  # stages 1/2 with broadcast_buffers, else None
    param_steps: List[int]  # each parameter's own step count, as torch's
    trainable: List[int] = field(init=False)  # indices of those that require grad
    frozen: List[int] = field(init=False)  # and of those that did not when laid out
    held: Set[int] = field(init=False)  # id() of each: what the claimant answers from

    def __post_init__(self):
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.frozen = [i for i, p in enumerate(self.params) if not p.requires_grad]
        self.held = {id(p) for p in self.params}

    def no_gradient_anywhere(self) -> bool:
        """No backward has given any parameter a gradient since ``zero_grad()`` (on any rank:
        a backward is collective), none is running, and the script assigned none ([Note:
        gradients set by the script] in optim/hand_grads.py: taken here)."""
        src = self.source
        if src.device.type == "meta" or hand_grads.take(self.grads) or self.grads.by_hand:
            return False
        return not (src.grads_ready() or src.in_backward() or src.arrived())

    def update(self, param_groups: list, step_kwargs: dict, closure=None) -> None:
        """One update of the shards by the rule; each parameter some rank gave a gradient
        counts a step."""
        used = self.grads.used
        self.rule.update(
            self.source.segments,
            param_groups,
            used,
            self.param_steps,
            self.grads.clip_coefficient(),
            step_kwargs=step_kwargs,
            closure=closure,
        )
        for i in self.trainable:
            if used[i]:
                self.param_steps[i] += 1


def build_bound(param_groups: list, binding: Binding, err, rebind: Rebind, joining, old: Optional[Bound]) -> Bound:
    """The parameters of ``param_groups`` laid out and hooked: their shard source, gradient
    statistics, module buffers' broadcast (told ``joining``'s hooks: [Note: uneven inputs] in
    optim/join.py) and update rule; ``old``: the layout this one replaces, if any."""
    params = [p for g in param_groups for p in g["params"]]  # in state_dict index order
    group_of = [gi for gi, g in enumerate(param_groups) for _ in g["params"]]
    if not any(p.requires_grad for p in params):
        raise ValueError(err("no parameter requires grad; nothing to optimize"))
    source = make_source(
        params, group_of, binding, [binding.names.get(id(p)) for p in params], err, rebind, param_groups
    )
    known = old.buffers.module if old is not None and old.buffers is not None else None
    if known is not None:  # a new layout keeps the module the last one found
        old.buffers.release()
    grads = ReducedGrads(params, [i for i, p in enumerate(params) if p.requires_grad], source, err)
    buffers = None
    if binding.broadcast_buffers and source.stage in (1, 2):  # [Note: module buffers]
        every = source.groups.every
        buffers = BufferSync(
            params,
            every,
            dist.get_global_rank(every, 0),
            before=weak_hook(joining.iteration_begins),
            source=weak_hook(joining.buffer_source),
        )
        if known is not None:
            buffers.use(known)
    source.backward_listeners.append(weak_hook(joining.iteration_begins))
    return Bound(
        params,
        group_of,
        source,
        grads,
        _make_rule(binding, source, group_of, param_groups, err),
        buffers,
        [0] * len(params),
    )


def _make_rule(binding: Binding, source: ShardSource, group_of: List[int], param_groups: list, err):
    """The update rule over ``source`` ([Note: update rules] in optim/rules.py)."""
    if binding.adam:
        return FusedAdamW(source.storage)
    cls, kwargs = binding.optimizer_class, binding.optimizer_kwargs
    add_group_keys(cls, kwargs, param_groups)
    if binding.whole:
        return WholeTensor(cls, kwargs, source, group_of, param_groups, binding.bucket_bytes // 4, err)
    return TorchElementwise(cls, kwargs, source.segments, param_groups)
