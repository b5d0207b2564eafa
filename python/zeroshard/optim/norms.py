"""Gradient norms other than the 2-norm, over the sharded gradients of a ``ReducedGrads``.

The 2-norm comes from the statistics the backward took (optim/grads.py). Any other
order torch's ``vector_norm`` takes is computed here when first asked for in a step,
from this rank's pieces and one small collective: inf and -inf from each rank's
largest or smallest absolute element (gathered), 0 from the count of non-zero
elements and any other order p from the sum of ``|g|^p`` (summed over the ranks,
one replica counting under hybrid sharding). Each piece holds its averaged gradient
divided by the engine's pending clip coefficient, which scales the result.
"""

from __future__ import annotations

import math

import torch

from .. import comm


def _scale(grads):
    return 1.0 if grads.coef is None else grads.coef.abs().to(grads.source.device)


def inf_norms(grads) -> torch.Tensor:
    """Per parameter: the largest absolute element of its averaged gradient."""
    return _across_ranks(grads, _extremes(grads, "amax"), "amax") * _scale(grads)


def p_norms(grads, ord: float) -> torch.Tensor:
    """Per parameter: the norm of order ``ord`` (not 2, not inf) of its averaged gradient."""
    if ord == -math.inf:
        return _across_ranks(grads, _extremes(grads, "amin"), "amin") * _scale(grads)
    if ord == 0.0:  # how many elements are not zero
        local = grads.local_values(lambda vs: torch.stack([(g != 0).sum().float() for g in vs]))
    else:
        local = grads.local_values(lambda vs: torch.stack([g.float().abs().pow(ord).sum() for g in vs]))
        local = local * _scale(grads) ** ord
    if grads.source.groups.replica_rank != 0:  # the replicas hold equal shards: one counts
        local.zero_()
    comm.all_reduce(local, group=grads.source.groups.every, what=f"gradient norms of order {ord:g}").wait()
    grads.source.comm_elements["all_reduce"] += local.numel()
    return local if ord == 0.0 else local.pow(1.0 / ord)


def _extremes(grads, reduce: str) -> torch.Tensor:
    """Per parameter: the largest ("amax") or smallest ("amin") absolute element of this
    rank's pieces of its gradient (0, or inf, where it holds none; a parameter cut
    between two buckets may have two pieces here)."""
    out = torch.full((len(grads.params),), 0.0 if reduce == "amax" else math.inf, device=grads.source.device)
    vals, ks = [], []
    for k, (seg, a, b) in enumerate(grads.flat):
        g = seg.grad[a:b]
        if g.numel():
            vals.append(getattr(g.abs(), reduce)().float().to(out.device))
            ks.append(k)
    if vals:
        out.scatter_reduce_(0, grads.piece_index(ks), torch.stack(vals), reduce=reduce)
    return out


def _across_ranks(grads, local: torch.Tensor, reduce: str) -> torch.Tensor:
    """``local`` (a value per parameter) gathered from every rank of the shard group, then
    reduced elementwise by ``reduce`` ("amax", "amin")."""
    world, rank = grads.source.world_size, grads.source.rank
    every = local.new_zeros(world, local.numel())
    every[rank].copy_(local)
    comm.all_gather(
        every[rank].view(-1), every.view(-1), group=grads.source.process_group, what=f"gradient norms ({reduce})"
    ).wait()
    return getattr(every, reduce)(0)


class NormQueries:
    """ReducedGrads' norms: per parameter and in total, of any order."""

    def total_norm(self, ord: float) -> torch.Tensor:
        """The norm over every parameter, from the statistics the backward took (the
        2-norm: no pass over the gradients, no collective); as torch's, the norm of the
        per-parameter norms of the parameters that have a gradient."""
        if ord == 2.0:
            return self.slot_sumsq.sum().sqrt()
        if not self.slots.identity:
            raise ValueError(
                self.err(
                    f"a gradient norm of order {ord:g} over param groups sharded over their own ranks (expert "
                    "parallelism) is not supported yet: use the 2-norm (norm_type=2, clip_grad_norm_'s default)"
                )
            )
        if ord == math.inf:
            return self.inf_norms().max()
        used = [i for i in self.trainable if self.used[i]]
        every = torch.stack([self.norm(i, ord) for i in used]) if used else torch.zeros(1)
        return torch.linalg.vector_norm(every, ord)

    def norm(self, i: int, ord: float) -> torch.Tensor:
        if ord == 2.0:
            return self.sumsq[i].sqrt()
        if ord == math.inf:
            return self.inf_norms()[i]
        if ord not in self.pnorms:
            self.pnorms[ord] = p_norms(self, ord)
        return self.pnorms[ord][i]

    def norm_everywhere(self, i: int, ord: float) -> torch.Tensor:
        """``norm(i, ord)``, over parameter ``i``'s place in every group of its ranks where
        its param group has its own (optim/slots.py): each group's parameter there counted."""
        if self.slots.identity or self.slots.counts[i] == 1:
            return self.norm(i, ord)
        if ord != 2.0:
            self.total_norm(ord)  # (refused, naming what to do)
        return self.slots.summed(self.slot_sumsq)[i].sqrt()  # (device ops only: no host copy)

    def inf_norms(self) -> torch.Tensor:
        """Per parameter: the largest absolute gradient element (collective on first use per step)."""
        if self.maxabs is None:
            self.maxabs = inf_norms(self)
        return self.maxabs
