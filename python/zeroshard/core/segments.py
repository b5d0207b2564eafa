"""What the update engine updates: segments, flat ranges of a shard each updated by one
fused call, and the averaged gradient they read ([Note: one meaning for a gradient]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import torch


def squared_norms(views: List[torch.Tensor]) -> torch.Tensor:
    """Each view's squared 2-norm, in fp32: one foreach kernel on CUDA (a norm and a
    square per view cost every step two launches per parameter, ~300 at GPT-2's 148
    parameters, whose host time falls at the end of the backward), as torch's clip_grad_norm_ does."""
    return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).square()


@dataclass(kw_only=True, eq=False)
class GradShard:
    """The averaged gradient a reduction folds into: a ZeRO-3 unit's fp32 shard, a ZeRO-2
    flat buffer's shard, a ZeRO-1 flat buffer's full gradient (the step reads this rank's
    chunks of it). Owned by the ``Reduction`` record (core/reduction.py) that writes it;
    the buckets of one flat buffer reduce into one, each its own range. Each ``Segment``
    reads a range of one.

    [Note: one meaning for a gradient] Whatever the stage, the gradient a segment
    reads is the *averaged* gradient: the mean over every rank it was reduced over
    (replicas included), in the reduce dtype, as DDP's ``p.grad`` holds it
    (FullyShard's ``set_gradient_divide_factor`` changes the divisor, as FSDP2's).
    Each fold divides as it writes (zero12/folds.py, zero3/fold.py), so the update
    rules, the statistics, ``p.grad`` reads and anything later (a quantized
    reduction's error feedback, a gradient shard written to disk) take it as it is:
    no scale travels with it."""

    # the averaged gradient; None: not allocated (no backward since zero_grad(set_to_none=True))
    tensor: Optional[torch.Tensor] = None
    # a ZeRO-3 shard in host memory: {piece's offset in the shard: its squared norm}, taken on the
    # device before the copy to host by this backward's fresh reduction (None otherwise)
    sumsq: Optional[dict] = None


class SegmentPiece(NamedTuple):
    """A trainable parameter's range within a segment: [start, stop) of the segment's
    tensors, which is the flattened parameter's [offset, offset + stop - start)."""

    param: int
    start: int
    stop: int
    offset: int


class Ranges(NamedTuple):
    """A flat range's tensors one update call steps: parameter (fp32 master or fp32
    shard), averaged gradient, AdamW's two moments and the low-precision output (or None)."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: Optional[torch.Tensor]
    exp_avg_sq: Optional[torch.Tensor]
    out: Optional[torch.Tensor]


class UpdatePart(NamedTuple):
    """One flat range of a step: its param group, the step count after this step, whether
    its state is streamed from host memory or disk, and its tensors."""

    group: int
    step: int
    streamed: bool
    ranges: Ranges


@dataclass(kw_only=True)
class Segment:
    """A flat range updated by one fused AdamW call."""

    group: int  # param group index
    param: torch.Tensor  # fp32 master (or fp32 parameter) shard range
    # the averaged gradient this segment reads (its tensor allocated and freed as backward and
    # zero_grad go, [Note: one meaning for a gradient]), and the range in it
    reduced: GradShard
    grad_range: tuple  # (start, stop) in that tensor
    exp_avg: Optional[torch.Tensor] = None  # the fused AdamW's state (None for another optimizer_class)
    exp_avg_sq: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None  # low-precision parameter range to write, or None
    # each trainable parameter's range within this segment
    pieces: List[SegmentPiece] = field(default_factory=list)
    streamed: bool = False  # the state is offloaded: stepped window by window ([Note: offload])
    # ZeRO-1/2, state the CPU steps: the host copy of the gradient, refreshed as backward
    # reduces it, that the step reads ([Note: offloaded gradients] in offload/copies.py)
    mirror: Optional[torch.Tensor] = None
    # ZeRO-3, gradient shards in host memory: the shard's ``sumsq`` holds each piece's squared
    # norm, taken on the device before the copy to host
    norms_taken: bool = False

    @property
    def grad(self) -> torch.Tensor:
        """Looked up at each use: gradient shards are allocated by backward's
        reductions and freed by zero_grad(set_to_none=True)."""
        return self.reduced.tensor[self.grad_range[0] : self.grad_range[1]]

    @property
    def has_grad(self) -> bool:
        """Whether the gradient tensor is allocated (no backward since zero_grad(set_to_none=True): not)."""
        return self.reduced.tensor is not None

    def sumsq_before_copy(self, a: int, b: int) -> Optional[torch.Tensor]:
        """The squared norm of the gradient's range [a, b) (one piece), as taken on the
        device before its copy to host memory this backward; None if it was not."""
        taken = self.reduced.sumsq if self.norms_taken else None
        return None if taken is None else taken.get(self.grad_range[0] + a)

    def grad_views(self, a: int, b: int) -> List[torch.Tensor]:
        """Every copy of the gradient's range [a, b) an in-place change must reach."""
        return [self.grad[a:b]] + ([] if self.mirror is None else [self.mirror[a:b]])


def update_parts(segments: List[Segment], used: List[bool], steps: List[int]) -> List[UpdatePart]:
    """What one step updates, an UpdatePart per flat range. As torch's AdamW: a
    parameter no rank gave a gradient (``used[i]`` false) is not updated, and each
    parameter's own step count sets its bias correction. A segment whose
    parameters all step with one count is updated whole (padding included: zeros
    stay zero); otherwise piece by piece."""
    parts: List[UpdatePart] = []
    for seg in segments:
        if not seg.pieces:
            continue
        ids = [i for i, *_ in seg.pieces]
        if all(used[i] and steps[i] == steps[ids[0]] for i in ids):
            ranges = [(ids[0], 0, seg.param.numel())]
        else:
            ranges = [(i, a, b) for i, a, b, _ in seg.pieces if used[i]]
        grad = seg.grad if seg.mirror is None else seg.mirror
        for i, a, b in ranges:
            parts.append(
                UpdatePart(
                    seg.group,
                    steps[i] + 1,
                    seg.streamed,
                    Ranges(
                        seg.param[a:b],
                        grad[a:b],
                        seg.exp_avg[a:b],
                        seg.exp_avg_sq[a:b],
                        None if seg.out is None else seg.out[a:b],
                    ),
                )
            )
    return parts
