"""A tool's torch optimizer made zeroshard's, shared by the integrations: the
optimizer a Trainer, ``configure_optimizers`` or a script built over the plain
model becomes a ``ShardedOptimizer`` with the same class (zeroshard's fused
AdamW for ``torch.optim.AdamW``), hyperparameters and param groups, at stage 3
over the ``FullyShard`` pieces of the same parameters; LR schedulers built over
the old optimizer are pointed at the new one.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch

import zeroshard

from .deepspeed.build import client_optimizer
from .policies import as_policies

# whole-tensor classes outside torch, known by (module prefix, class name): each
# parameter's update needs it whole (transformers' Adafactor factors rows and columns)
WHOLE_TENSOR_ELSEWHERE = {("transformers", "Adafactor")}


def has_params(opt) -> bool:
    """Whether ``opt`` optimizes anything (Lightning's stand-in for a None from
    ``configure_optimizers`` has no parameters)."""
    return any(len(g["params"]) for g in opt.param_groups)


def _whole_tensor_elsewhere(cls) -> bool:
    return (cls.__module__.split(".")[0], cls.__name__) in WHOLE_TENSOR_ELSEWHERE


def to_sharded(
    opt: torch.optim.Optimizer,
    options: dict,
    pieces: Optional[Dict[str, torch.Tensor]] = None,
    names: Optional[Dict[int, str]] = None,
    experts_mesh=None,
) -> "zeroshard.ShardedOptimizer":
    """A ShardedOptimizer reproducing ``opt``: its class, defaults and param groups.
    ``pieces`` (stage 3): name -> FullyShard piece, and ``names``: id of a plain
    parameter -> its name, taken before the wrap. Group entries an LR scheduler
    added (``initial_lr``, ``max_lr``, ...) are carried over too. ``options``: the
    ShardedOptimizer's sharding keywords. ``experts_mesh``: the groups of expert DTensors
    (an ep_plan's) shard over it ([Note: expert DTensors])."""
    cls, defaults, groups = client_optimizer(opt)
    if pieces is not None:
        groups = [dict(g, params=[pieces[names[id(p)]] for p in g["params"]]) for g in groups]
    if experts_mesh is not None:
        groups = [_over_experts(g, gi, experts_mesh) for gi, g in enumerate(groups)]
    kwargs = dict(options, optimizer_class=cls) if cls is not None else dict(options)
    if cls is not None and _whole_tensor_elsewhere(cls):
        kwargs["whole_tensor"] = True
    sharded = zeroshard.ShardedOptimizer(groups, **defaults, **as_policies(kwargs))
    for new, old in zip(sharded.param_groups, opt.param_groups):
        for key, value in old.items():
            if key != "params" and key not in opt.defaults and key not in new:
                new[key] = value
    return sharded


def _over_experts(group: dict, gi: int, mesh) -> dict:
    from torch.distributed.tensor import DTensor

    experts = [isinstance(p, DTensor) for p in group["params"]]
    if any(experts) and not all(experts):
        raise ValueError(
            f"param group {gi} holds expert-parallel (DTensor) and other parameters together; the "
            "experts shard over their own ranks: give them param groups of their own"
        )
    return dict(group, device_mesh=mesh) if any(experts) else group


def move_schedulers(schedulers: Iterable, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point the LR schedulers built over ``old`` at ``new``, whose groups hold the
    same learning rates (the schedulers' first step already happened on ``old``)."""
    moved = False
    for scheduler in schedulers:
        if scheduler is not None and getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new
            moved = True
    if moved:
        # A scheduler's constructor marks its optimizer's step() so that torch's schedulers can
        # check they are stepped after it; a no-op schedule (factor 1 from the start) marks the
        # new optimizer the same way, leaving its learning rates as they are.
        torch.optim.lr_scheduler.ConstantLR(new, factor=1.0, total_iters=0)
