"""Who was built over a plain parameter, and what is told when it is replaced.

[Note: construction order] DDP scripts build the optimizer over the plain
model and wrap the model afterwards (nanoGPT's ``configure_optimizers``, then
``DDP(model)``; the Hugging Face Trainer and Lightning do the same). With
FullyShard in DDP's place, the optimizer's parameters are then replaced by the
wrap. So a ShardedOptimizer *claims* the parameters it was built over: it
enters the live claimants here, each answering ``holds(p)`` from its own param
groups. FullyShard knows no optimizer: before it shards a module it asks which
of the module's parameters a claimant holds, and after the wrap it tells each
such claimant which sharded parameter replaced which plain one
(``Claimant.params_replaced``). The optimizer then drops its ZeRO-1/2 layout
and steps them as ZeRO-3, in the same param groups, or raises, and the wrap
stops with that error: once training has begun, and for a mix it cannot step
(some of its parameters wrapped, others not), naming both orders that work.
The same claimants refuse a second optimizer over parameters a live one holds.
"""

from __future__ import annotations

import gc
import weakref
from typing import List, Optional, Protocol, Sequence, Tuple

import torch


class Claimant(Protocol):
    """What a claimant of plain parameters answers (a ShardedOptimizer's ``regrouping``):
    ``opt``, the optimizer it claims them for."""

    opt: object

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the parameters it steps."""

    def params_replaced(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each (plain, sharded) pair: a wrap replaced ``plain`` by ``sharded``. Raises
        ValueError or RuntimeError, saying why, when it cannot step the sharded ones."""


# the live claimants (weakly: a claimant only waiting for the garbage collector drops out)
_LIVE: "weakref.WeakSet[Claimant]" = weakref.WeakSet()


def claim(claimant: Claimant) -> None:
    """Enter ``claimant`` among the live ones (weakly): it holds its parameters from now on."""
    _LIVE.add(claimant)


def claimant(p: torch.Tensor) -> Optional[Claimant]:
    """The live claimant holding ``p``, else None."""
    return next((c for c in list(_LIVE) if c.holds(p)), None)


def check_unclaimed(opt: Claimant, params: List[torch.Tensor], err) -> None:
    """Refuse a parameter another live ShardedOptimizer was built over: both would
    reduce and update it. (An optimizer only waiting for the garbage collector
    does not count.)"""
    if not any(claimant_other(p, opt) for p in params):
        return
    gc.collect()
    for i, p in enumerate(params):
        if claimant_other(p, opt):
            raise ValueError(
                err(
                    f"parameter {i} (shape {tuple(p.shape)}) is already in another live ShardedOptimizer: "
                    "both would reduce and update it. Give each optimizer its own parameters (e.g. Muon "
                    "over the hidden matrices, AdamW over the rest), or drop the first optimizer (del opt) "
                    "before building a new one over the same model"
                )
            )


def claimant_other(p: torch.Tensor, opt: Claimant) -> bool:
    """Whether a live claimant other than ``opt`` holds ``p``."""
    return any(c is not opt and c.holds(p) for c in list(_LIVE))


def unclaim(claimant: Claimant) -> None:
    """``claimant`` let go of its parameters (``ShardedOptimizer.release``)."""
    _LIVE.discard(claimant)
