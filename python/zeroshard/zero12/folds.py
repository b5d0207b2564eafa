"""The ZeRO-1 and ZeRO-2 fold policies: what a bucket's reduce-scatter reads and
where its reduced chunk goes ([Note: reduction pipeline] in core/reduction.py;
[Note: sharded optimizer policy] in zero12/reducer.py)."""

from __future__ import annotations

import enum
from typing import List, Optional, Tuple

import torch

from .flat import FlatBucket
from ..core.reduction import FoldPolicy, Reduction
from ..core.tensor_parallel import local_tensor
from ..native.layout import fill_flat, gaps


# [Note: stage-1 gradient buffer] GradFill names what the buffer holds. After
# zero_grad(set_to_none=True) (OVERWRITE) nothing in it is zeroed: p.grad is
# None, so autograd hands each parameter's first gradient over whole and
# the reducer's gradient hook copies it into the parameter's view, overwriting
# whatever was there; a bucket's launch zeroes only what no gradient reached
# (padding, parameters unused on this rank). A synced backward leaves it
# REDUCED: this rank's chunks hold the averages (the sums divided by N: [Note:
# one meaning for a gradient] in core/segments.py), the other ranks' chunks
# what the in-place reduce-scatter left there. Only a backward that adds to it
# without a zero_grad in between (gradients accumulated across synced
# backwards) needs those zeroed, and this rank's chunks multiplied back into
# sums, which the reducer's hook before each gradient does before the first
# gradient is added; zero_grad(set_to_none=False) zeroes the whole buffer. So the common loop (backward, step, zero_grad) writes every element
# once per step, as DDP does, instead of zeroing the buffer and then adding to
# it (12 MB of memset a step at 3M parameters).
class GradFill(enum.Enum):
    ACCUMULATE = "accumulate"  # every element holds a value to add to (zeros or this rank's gradients)
    OVERWRITE = "overwrite"  # stale: each gradient's first arrival copies, launch zeroes the rest
    REDUCED = "reduced"  # this rank's chunks reduced; the other ranks' chunks stale


def bucket_of(r: Reduction) -> FlatBucket:
    return r.owner


class _BucketFold(FoldPolicy):
    """What both stages' folds share: the reducer they serve, the labels of their
    collectives, and the turns of a step they are told of."""

    def __init__(self, reducer):
        self.src = reducer
        self.shard_fresh = True  # no synced backward since zero_grad: nothing reduced to add to

    def backward_started(self):
        """The first gradient of a backward is about to be taken."""

    def grad_arrived(self, i: int, p: torch.Tensor):
        """Autograd accumulated parameter ``i``'s gradient into ``p.grad``."""

    def synced(self):
        """A synced backward finished: the shards hold its reduced gradients."""
        self.shard_fresh = False

    def zeroed(self, set_to_none: bool):
        """zero_grad(set_to_none) ran."""
        self.shard_fresh = True

    def label(self, r: Reduction, what: str) -> str:
        return f"step {self.src.steps_done + 1}, {r.name} {what}"


class InPlaceFold(_BucketFold):
    """Stage 1: each bucket is reduce-scattered in place in the persistent full gradient
    buffer; this rank's chunk of it is where the step reads the reduced gradient."""

    def __init__(self, reducer):
        super().__init__(reducer)
        self.fill = GradFill.ACCUMULATE  # the gradient buffers (zeros when built)
        # hybrid, accumulating onto a synced backward: this rank's chunks as they were
        # before it, by bucket index (the replica all-reduce counts them once per replica)
        self.kept: Optional[dict] = None

    def before_grad(self, grad):
        """Before autograd adds a gradient to the buffer: a backward adding to the last
        synced backward's reduced gradient first zeroes the other ranks' chunks
        ([Note: stage-1 gradient buffer]). Hybrid: keeps this rank's chunks, counted once
        per replica by the replica all-reduce; the fold takes the extra copies off."""
        src = self.src
        if self.fill is GradFill.REDUCED:
            _zero_other_chunks(src.buckets)
            for b in src.buckets:  # the averages back to sums, which this backward adds to
                b.own(b.buffer.grads).mul_(src.divisor)
            self.fill = GradFill.ACCUMULATE
        if src.groups.replicate is not None and self.kept is None and not self.shard_fresh:
            self.kept = {b.index: b.own(b.buffer.grads).clone() for b in src.buckets}

    def grad_arrived(self, i: int, p: torch.Tensor):
        view, grad = self.src.grad_view(i), local_tensor(p.grad)
        if grad.data_ptr() != view.data_ptr():
            view.copy_(grad)  # p.grad was replaced or re-created: it holds the total
            p.grad = self.src.grad_for(i, view)

    def synced(self):
        super().synced()
        self.fill = GradFill.REDUCED
        self.kept = None

    def zeroed(self, set_to_none: bool):
        super().zeroed(set_to_none)
        self.fill = GradFill.OVERWRITE if set_to_none else GradFill.ACCUMULATE
        self.kept = None

    def reduce_input(self, r: Reduction) -> Tuple[torch.Tensor, torch.Tensor, Optional[List[int]]]:
        b, src = bucket_of(r), self.src
        buf, rank = b.buffer, b.buffer.shard.rank
        rdt = src.reduce_dtype_of(buf.dtype)
        whole = buf.grads[b.offset : b.offset + b.numel]
        if self.fill is GradFill.OVERWRITE:  # what no gradient wrote is stale: zero it
            for start, end in gaps(
                b.numel, [(f.bucket_offset, f.numel) for i, f in b.frags if i in src.arrived_since_zero]
            ):
                whole[start:end].zero_()
        whole = whole.to(rdt) if whole.dtype != rdt else whole  # reduce in rdt, store back in the grad dtype
        return whole, whole[rank * b.shard_numel : (rank + 1) * b.shard_numel], None

    def fold(self, r: Reduction):
        b, src = bucket_of(r), self.src
        own = b.own(r.grad.tensor)  # (the full gradient buffer: this rank's chunk reduced in place)
        if self.kept is not None:  # hybrid: counted once per replica (see before_grad)
            r.out.sub_(self.kept[b.index].to(r.out.dtype), alpha=src.groups.replicas - 1)
        if r.out.data_ptr() != own.data_ptr():  # (reduced in reduce_dtype: divided there, rounded once)
            own.copy_(r.out.div_(src.divisor))
        else:
            own.div_(src.divisor)
        if b.buffer.grad_mirror is not None:
            src.host_copies.copy(b.shard_of(b.buffer.grad_mirror), own)


class AddToShardFold(_BucketFold):
    """Stage 2: a bucket's gradients are copied into a recycled buffer once all have
    arrived (then freed) and reduce-scattered into the gradient shard, or into the
    buffer and then added to the shard when it already holds an earlier micro-batch."""

    def __init__(self, reducer):
        super().__init__(reducer)
        self.copies_left: dict = {}  # param index -> buckets still to copy its gradient (then freed)

    def backward_started(self):
        self.copies_left = {i: len(self.src.where[i].frags) for i in self.src.trainable}

    def reduce_input(self, r: Reduction) -> Tuple[torch.Tensor, torch.Tensor, Optional[List[int]]]:
        b, src = bucket_of(r), self.src
        buf = b.buffer
        rdt = src.reduce_dtype_of(buf.dtype)
        inp = r.buffer = src.pool.acquire(b.numel, rdt)  # (uninitialised: every element is written)
        # gradients that never arrived on this rank count as zero, as does padding
        fill_flat(
            inp,
            [
                (f.bucket_offset, _flat_range(src.params[i].grad, f.tensor_offset, f.numel))
                for i, f in b.frags
                if src.params[i].grad is not None
            ],
        )
        for i, _ in b.frags:
            self.copies_left[i] -= 1
            if self.copies_left[i] == 0:
                src.params[i].grad = None
        if r.grad.tensor is None:  # freed by zero_grad(set_to_none=True)
            # every bucket writes its whole piece of the shard: no zeroing needed
            r.grad.tensor, buf.spare_shard = buf.spare_shard, None
            if r.grad.tensor is None:
                r.grad.tensor = torch.empty(buf.shard_numel, dtype=rdt, device=src.device)
        # a shard holding nothing yet receives the sum directly; else the sum lands in
        # this rank's chunk of the buffer and the fold adds it
        out = b.shard_of(r.grad.tensor) if self.shard_fresh else b.own(inp, start=0)
        return inp, out, None

    def fold(self, r: Reduction):
        b, src = bucket_of(r), self.src
        shard = b.shard_of(r.grad.tensor)
        if r.out.data_ptr() != shard.data_ptr():
            shard.add_(r.out.div_(src.divisor))  # (the buffer's chunk: scratch)
        else:
            shard.div_(src.divisor)
        if b.buffer.grad_mirror is not None:
            src.host_copies.copy(b.shard_of(b.buffer.grad_mirror), shard)
        src.pool.release(r.buffer)
        r.buffer = None


def _flat_range(grad: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """Elements [start, start + numel) of the gradient, flattened (a DTensor's local piece's);
    as few new tensor objects as can be: this runs once per parameter every backward."""
    g = local_tensor(grad)
    if g.requires_grad:  # (a create_graph backward)
        g = g.detach()
    g = g.reshape(-1) if g.dim() != 1 else g
    return g if start == 0 and numel == g.numel() else g[start : start + numel]


@torch.no_grad()
def _zero_other_chunks(buckets: List[FlatBucket]) -> None:
    """Stage 1: zero every bucket's chunks of the gradient buffer but this rank's."""
    for b in buckets:
        rank = b.buffer.shard.rank
        whole = b.buffer.grads[b.offset : b.offset + b.numel]
        whole[: rank * b.shard_numel].zero_()
        whole[(rank + 1) * b.shard_numel :].zero_()
