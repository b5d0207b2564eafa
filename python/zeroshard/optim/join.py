"""Uneven inputs: ShardedOptimizer is a torch ``Joinable``.

[Note: uneven inputs] With ``torch.distributed.algorithms.join.Join([opt])``
around the training loop, a rank that runs out of batches leaves the loop
and waits in the context's exit, where, as long as another rank is still
training, it *shadows* one training iteration per round: the same
collectives, in the same order, as a rank that trains (as DDP's and
ZeroRedundancyOptimizer's join hooks do). Torch's Join counts the ranks still
training with one all-reduce per round; a training rank takes part in it once
per iteration (``Join.notify_join_context``), before the iteration's first
collective: the forward's buffer broadcast ([Note: module buffers]) or, for a
model without buffers, the backward's first reduction. A shadowed iteration
(``ShardedOptimizer.shadow_iteration``) is what a training iteration is with
a zero gradient on every parameter: the buffer broadcast, a backward whose
gradients are all zero (every bucket reduced in the order every rank shares,
the gradient statistics taken), and ``step()``, which updates this rank's
shard with the others' gradients and all-gathers the parameters. So every
rank, the joined ones too, ends with the parameters DDP + ``Join`` leaves
(its final broadcast from the last rank to join): the zero gradients count in
the average as DDP's joined ranks count them (divided by the whole world).
What it needs: ``step()`` once per iteration (gradient accumulation under
``no_sync()`` inside ``Join`` is refused by torch's own DDP too); stages 1 and
2 (FullyShard's gathers would need the joined rank to replay a forward).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

__all__ = ["Joinable", "JoinableOptimizer"]


class _ShadowIteration(JoinHook):
    def __init__(self, opt):
        self.opt = opt

    def main_hook(self) -> None:
        self.opt.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank stepped every iteration, so the parameters agree; the buffers become
        the last rank to join's (it ran every forward), as DDP's final sync makes them."""
        self.opt.final_buffers(is_last_joiner)


class JoinableOptimizer(Joinable):
    """ShardedOptimizer's side of torch's Join ([Note: uneven inputs])."""

    def join_hook(self, **kwargs) -> JoinHook:
        if self.stage == 3:
            raise NotImplementedError(self._err(
                "Join with FullyShard parameters is not supported yet: a rank out of batches would have to "
                "replay the units' gathers of a forward it has no input for. Give every rank the same "
                "number of batches (e.g. DistributedSampler(drop_last=True)), or train at stage 1 or 2"))
        return _ShadowIteration(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.source.groups.every      # every rank holding a copy takes part in the count

    def iteration_begins(self) -> None:
        """The first collective of a training iteration is about to be issued: take part
        in torch's Join count first (once per iteration; nothing outside a Join)."""
        if not self._join_notified:
            self._join_notified = True
            Join.notify_join_context(self)

    def _highest(self, candidate: bool) -> int:
        """The highest global rank among those for which ``candidate`` holds (collective)."""
        r = torch.tensor([dist.get_rank() if candidate else -1], device=self.device)
        dist.all_reduce(r, op=dist.ReduceOp.MAX, group=self.join_process_group)
        return int(r.item())

    def buffer_source(self, training: bool) -> int:
        """The global rank the module's buffers are broadcast from before a training forward:
        rank 0 of the group, or inside torch's Join the highest rank still training (a rank
        that joined has stale statistics), as DDP picks it (collective then)."""
        if not self._join_config.enable:
            return dist.get_global_rank(self.join_process_group, 0)
        return self._highest(training)

    def final_buffers(self, is_last_joiner: bool) -> None:
        """At the end of a Join: the buffers of the last rank to join, on every rank."""
        if self._buffers is not None and self._buffers.active:
            self._buffers.sync(self._highest(is_last_joiner))

    def shadow_iteration(self) -> None:
        """One training iteration's collectives with a zero gradient on every parameter
        (this rank has no batch left); see [Note: uneven inputs]."""
        self._join_notified = True       # (joined: this rank is not counted again)
        if self._buffers is not None:
            self._buffers.shadow()
        self.zero_grad(set_to_none=True)
        trainable = [self._params[i] for i in self._trainable if self._params[i].requires_grad]
        torch.stack([(p * 0).sum() for p in trainable]).sum().backward()
        self.step()
