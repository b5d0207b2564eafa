"""What ``configure_optimizers`` returned, made zeroshard's: each torch optimizer
becomes a ``ShardedOptimizer`` with the same class, hyperparameters and param
groups (at stage 3 over the FullyShard pieces of the same parameters), and the
LR schedulers Lightning parsed from any of its return forms are moved onto it.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

import zeroshard

from .. import convert
from ..convert import has_params  # noqa: F401  (the strategy's)


def _check(opt) -> None:
    if isinstance(opt, zeroshard.ShardedOptimizer):
        raise TypeError(
            "configure_optimizers returned a zeroshard.ShardedOptimizer: with ZeroShardStrategy return "
            "the plain torch optimizer (e.g. torch.optim.AdamW(self.parameters(), ...)); the strategy "
            "builds the ShardedOptimizer from it at the stage it was given"
        )
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"configure_optimizers returned a {type(opt).__name__}; ZeroShardStrategy takes "
            "torch.optim.Optimizer instances (AdamW, or any elementwise torch optimizer)"
        )


def to_sharded(
    opt: torch.optim.Optimizer,
    options: dict,
    pieces: Optional[Dict[str, torch.Tensor]] = None,
    names: Optional[Dict[int, str]] = None,
) -> "zeroshard.ShardedOptimizer":
    """``configure_optimizers``' optimizer as a ShardedOptimizer (see ``integrations.convert``)."""
    _check(opt)
    return convert.to_sharded(opt, options, pieces, names)


def move_schedulers(configs: List, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point the schedulers Lightning parsed (over ``old``) at ``new``."""
    convert.move_schedulers([c.scheduler for c in configs], old, new)
