"""What ``configure_optimizers`` returned, made zeroshard's: each torch optimizer
becomes a ``ShardedOptimizer`` with the same class, hyperparameters and param
groups (at stage 3 over the FullyShard pieces of the same parameters), and the
LR schedulers Lightning parsed from any of its return forms are moved onto it.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

import zeroshard

from ..deepspeed.build import client_optimizer


def _check(opt) -> None:
    if isinstance(opt, zeroshard.ShardedOptimizer):
        raise TypeError("configure_optimizers returned a zeroshard.ShardedOptimizer: with ZeroShardStrategy return "
                        "the plain torch optimizer (e.g. torch.optim.AdamW(self.parameters(), ...)); the strategy "
                        "builds the ShardedOptimizer from it at the stage it was given")
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"configure_optimizers returned a {type(opt).__name__}; ZeroShardStrategy takes "
                        "torch.optim.Optimizer instances (AdamW, or any elementwise torch optimizer)")


def has_params(opt) -> bool:
    """Whether ``opt`` optimizes anything (Lightning's stand-in for a None from
    ``configure_optimizers`` has no parameters)."""
    return any(len(g["params"]) for g in opt.param_groups)


def to_sharded(opt: torch.optim.Optimizer, options: dict, pieces: Optional[Dict[str, torch.Tensor]] = None,
               names: Optional[Dict[int, str]] = None) -> "zeroshard.ShardedOptimizer":
    """A ShardedOptimizer reproducing ``opt``: its class (zeroshard's fused AdamW for
    ``torch.optim.AdamW``), defaults and param groups. ``pieces`` (stage 3): name ->
    FullyShard piece, and ``names``: id of a plain parameter -> its name, taken before
    the wrap. Group entries an LR scheduler added (``initial_lr``, ``max_lr``, ...) are
    carried over too. ``options``: the ShardedOptimizer's sharding keywords."""
    _check(opt)
    cls, defaults, groups = client_optimizer(opt)
    if pieces is not None:
        groups = [dict(g, params=[pieces[names[id(p)]] for p in g["params"]]) for g in groups]
    kwargs = dict(options, optimizer_class=cls) if cls is not None else dict(options)
    sharded = zeroshard.ShardedOptimizer(groups, **defaults, **kwargs)
    for new, old in zip(sharded.param_groups, opt.param_groups):
        for key, value in old.items():
            if key != "params" and key not in opt.defaults and key not in new:
                new[key] = value
    return sharded


def move_schedulers(configs: List, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point the schedulers built over ``old`` at ``new``, whose groups hold the same
    learning rates (the schedulers' first step already happened on ``old``)."""
    moved = False
    for config in configs:
        if config.scheduler.optimizer is old:
            config.scheduler.optimizer = new
            moved = True
    if moved:
        # A scheduler's constructor marks its optimizer's step() so that torch's schedulers can
        # check they are stepped after it; a no-op schedule (factor 1 from the start) marks the
        # new optimizer the same way, leaving its learning rates as they are.
        torch.optim.lr_scheduler.ConstantLR(new, factor=1.0, total_iters=0)
