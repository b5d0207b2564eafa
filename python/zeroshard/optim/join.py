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
(``JoinSide.shadow_iteration``) is what a training iteration is with
a zero gradient on every parameter: the buffer broadcast, a backward whose
gradients are all zero (every bucket reduced in the order every rank shares,
the gradient statistics taken), and ``step()``, which updates this rank's
shard with the others' gradients and all-gathers the parameters. So every
rank, the joined ones too, ends with the parameters DDP + ``Join`` leaves
(its final broadcast from the last rank to join): the zero gradients count in
the average as DDP's joined ranks count them (divided by the whole world).
What it needs: ``step()`` once per iteration (gradient accumulation under
``no_sync()`` inside ``Join`` is refused by torch's own DDP too).

Over FullyShard parameters (ZeRO-3) an iteration's collectives include the
forward's gathers, which only a forward makes in the right order. So inside
a Join the optimizer listens to the model's forwards (``forward_listeners``):
a training rank takes part in Join's count as its forward begins, before the
first gather, and the inputs of its last training forward are kept; a
joined rank shadows an iteration by running the model on those inputs again
and back-propagating a zero gradient from every output (``_ForwardReplay``: the
buffers and the random state are put back afterwards), then ``step()``. Its
gradient is exactly zero, as DDP's joined ranks' is. What it needs besides:
one model (a FullyShard) whose one forward and backward make an iteration,
and every rank at least one batch (a rank that trained none has no inputs
to replay: it raises, naming the fix).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from .. import comm
from ..core.hooks import weak_hook
from ..zero3.outputs import output_tensors


class _ShadowIteration(JoinHook):
    def __init__(self, side: "JoinSide"):
        self.side = side

    def main_hook(self) -> None:
        self.side.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank stepped every iteration, so the parameters agree; the buffers become
        the last rank to join's (it ran every forward), as DDP's final sync makes them."""
        self.side.final_buffers(is_last_joiner)


class JoinSide:
    """A ShardedOptimizer's side of torch's Join ([Note: uneven inputs]): its part in Join's
    count, the source rank of the buffers' broadcast, a joined rank's shadow iterations.
    The optimizer is the ``Joinable`` torch sees; its join methods ask this part."""

    def __init__(self, opt):
        self._opt = weakref.ref(opt)  # (the optimizer holds this part)
        self.notified = False  # this iteration took part in Join's count
        self.replay: Optional[_ForwardReplay] = None

    @property
    def opt(self):
        return self._opt()

    def hook(self) -> JoinHook:
        opt = self.opt
        if opt.stage == 3:
            models = opt.source.owners
            if len(models) != 1:
                raise NotImplementedError(
                    comm.on_rank(
                        opt,
                        f"Join over the parameters of {len(models)} FullyShard models: a joined rank replays one "
                        "model's forward; wrap them in one FullyShard (or give every rank the same number "
                        "of batches, e.g. DistributedSampler(drop_last=True))",
                    )
                )
            self.replay = _ForwardReplay(models[0], weak_hook(self.iteration_begins), weak_hook(self.err))
        return _ShadowIteration(self)

    def err(self, msg: str) -> str:
        return comm.on_rank(self.opt, msg)

    def next_iteration(self) -> None:
        """A step ended the iteration: the next collective begins another."""
        self.notified = False

    def iteration_begins(self) -> None:
        """The first collective of a training iteration is about to be issued: take part
        in torch's Join count first (once per iteration; nothing outside a Join)."""
        if not self.notified:
            self.notified = True
            Join.notify_join_context(self.opt)

    def _highest(self, candidate: bool) -> int:
        """The highest global rank among those for which ``candidate`` holds (collective)."""
        opt = self.opt
        r = torch.tensor([dist.get_rank() if candidate else -1], device=opt.device)
        dist.all_reduce(r, op=dist.ReduceOp.MAX, group=opt.join_process_group)
        return int(r.item())

    def buffer_source(self, training: bool) -> int:
        """The global rank the module's buffers are broadcast from before a training forward:
        rank 0 of the group, or inside torch's Join the highest rank still training (a rank
        that joined has stale statistics), as DDP picks it (collective then)."""
        opt = self.opt
        if not opt._join_config.enable:  # (torch's Joinable: whether a Join is enabled)
            return dist.get_global_rank(opt.join_process_group, 0)
        return self._highest(training)

    def final_buffers(self, is_last_joiner: bool) -> None:
        """At the end of a Join: the buffers of the last rank to join, on every rank."""
        if self.replay is not None:
            self.replay.close()
            self.replay = None
        buffers = self.opt.bound.buffers
        if buffers is not None and buffers.active:
            buffers.sync(self._highest(is_last_joiner))

    def shadow_iteration(self) -> None:
        """One training iteration's collectives with a zero gradient on every parameter
        (this rank has no batch left); see [Note: uneven inputs]."""
        opt, bound = self.opt, self.opt.bound
        self.notified = True  # (joined: this rank is not counted again)
        if bound.buffers is not None:
            bound.buffers.shadow()
        opt.zero_grad(set_to_none=True)
        if opt.stage == 3:
            self.replay.shadow()
        else:
            trainable = [bound.params[i] for i in bound.trainable if bound.params[i].requires_grad]
            torch.stack([(p * 0).sum() for p in trainable]).sum().backward()
        opt.step()


class _ForwardReplay:
    """ZeRO-3 under Join: the inputs of this rank's last training forward of ``model``, and
    that forward replayed with a zero gradient by a joined rank ([Note: uneven inputs])."""

    def __init__(self, model, begins, err):
        """``begins()``: the optimizer's part in Join's count; ``err``: its error wording."""
        self.model, self.inputs, self.begins, self.err = model, None, begins, err
        model.forward_listeners.append(self.record)

    def record(self, args: tuple, kwargs: dict) -> None:
        if self.model.training and torch.is_grad_enabled():
            self.begins()
            self.inputs = (args, kwargs)

    def shadow(self) -> None:
        if self.inputs is None:
            raise RuntimeError(
                self.err(
                    "this rank joined torch's Join without a training forward of its FullyShard model: a joined "
                    "rank replays its last batch's forward with a zero gradient (the units' gathers need one). "
                    "Give every rank at least one batch"
                )
            )
        buffers = [b.detach().clone() for b in self.model.buffers()]
        devices = [self.model.device] if self.model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            out = self.model(*self.inputs[0], **self.inputs[1])
            outs = output_tensors(out, "the model's output", self.err, strict=False)
            if not outs:
                raise RuntimeError(
                    self.err(
                        "the FullyShard model's output holds no tensor requiring grad, so "
                        "a joined rank cannot replay its backward"
                    )
                )
            torch.autograd.backward(outs, [torch.zeros_like(t) for t in outs])
        with torch.no_grad():  # (after the backward: it may read what the forward saved)
            for b, saved in zip(self.model.buffers(), buffers):
                b.copy_(saved)

    def close(self) -> None:
        """The Join ended: stop listening and drop the inputs."""
        if self.record in self.model.forward_listeners:
            self.model.forward_listeners.remove(self.record)
        self.inputs = None
