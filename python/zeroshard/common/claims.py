"""Which ShardedOptimizer was built over a plain parameter.

[Note: construction order] DDP scripts build the optimizer over the plain
model and wrap the model afterwards (nanoGPT's ``configure_optimizers``, then
``DDP(model)``; the Hugging Face Trainer and Lightning do the same). With
FullyShard in DDP's place, the optimizer's parameters are then replaced by the
wrap. So ShardedOptimizer claims the parameters it was built over here, and
FullyShard, finding claimed parameters among those it shards, hands each
claiming optimizer its sharded parameters (``params_wrapped``): the optimizer
drops its ZeRO-1/2 layout and steps them as ZeRO-3, in the same param groups.
Once training has begun that is refused, at the wrap; a mix it cannot step
(some of its parameters wrapped, others not) is refused there too, naming
both orders that work.
"""
from __future__ import annotations

import gc
import weakref
from typing import Dict, List, Tuple

import torch

# parameter id -> (weakref to it, weakref to the optimizer that claimed it)
_CLAIMS: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}


def claim(opt, params: List[torch.Tensor]) -> None:
    """Record ``opt`` as built over ``params`` (weakly: neither is kept alive)."""
    ref = weakref.ref(opt)
    for p in params:
        _CLAIMS[id(p)] = (weakref.ref(p, lambda _, i=id(p): _CLAIMS.pop(i, None)), ref)


def claimant(p: torch.Tensor):
    """The live optimizer built over ``p``, else None."""
    e = _CLAIMS.get(id(p))
    return e[1]() if e is not None and e[0]() is p else None


def check_unclaimed(opt, params: List[torch.Tensor], err) -> None:
    """Refuse a parameter another live ShardedOptimizer was built over: both would
    reduce and update it. (An optimizer only waiting for the garbage collector
    does not count.)"""
    if not any(claimant(p) not in (None, opt) for p in params):
        return
    gc.collect()
    for i, p in enumerate(params):
        if claimant(p) not in (None, opt):
            raise ValueError(err(
                f"parameter {i} (shape {tuple(p.shape)}) is already in another live ShardedOptimizer: "
                "both would reduce and update it. Give each optimizer its own parameters (e.g. Muon "
                "over the hidden matrices, AdamW over the rest), or drop the first optimizer (del opt) "
                "before building a new one over the same model"))


def unclaim(opt) -> None:
    """Drop ``opt``'s claims: it let go of its parameters (``ShardedOptimizer.release``)."""
    for i in [i for i, (_, ref) in _CLAIMS.items() if ref() is opt]:
        _CLAIMS.pop(i, None)
