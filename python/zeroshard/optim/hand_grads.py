"""What a training script did to ``p.grad`` between the backward and the step.

[Note: gradients set by the script] torch's optimizers step on whatever
``p.grad`` holds when ``step()`` runs: a parameter whose ``p.grad`` is None
is skipped (no update, no weight decay, its state untouched), and a
gradient assigned by hand (``p.grad = g``: computed with
``torch.autograd.grad``, by a meta-learning loop, by a reduction of the
script's own) is used as it is. Under DDP that gradient stands where the
averaged one would. After a backward zeroshard's ``p.grad`` is a
placeholder over the reduced shards ([Note: sharded gradients] in
optim/grads.py), so before the engine first reads the gradients of a step
(``step()``, its ``clip_grad_norm_``) each trainable parameter's ``p.grad``
is compared with what was placed there:

* the placeholder (or, with no synced backward since ``zero_grad()``, what
  the source keeps there between steps, or the local gradient a backward
  under ``no_sync()`` accumulated): nothing to do;
* None where a placeholder was: the parameter is skipped this step, and its
  gradient counts in no statistic (the clipping norm, the non-finite check);
* any other tensor: it is the parameter's averaged gradient. This rank's
  pieces of it are written into the gradient shards (divided by what the
  step multiplies them by), the statistics are taken again, and ``p.grad``
  becomes the placeholder over them. A step on hand-made gradients with no
  backward at all takes this path.

The ranks must agree, as DDP's replicas must to stay equal: a rank that
found something checks in (through the store, [Note: rank-0 code] in
comm/collectives.py), then the ranks compare which parameters each dropped
or assigned and a checksum of each assigned gradient; any difference is an
error naming the parameters and ranks, raised before any parameter moves.
(A rank whose script touched nothing makes no call: the ones that did fail
at the check-in's timeout, naming the ranks that did not come.) So a loop
that leaves ``p.grad`` alone pays one identity test per parameter.

Refused by name, before any parameter moves: a sparse gradient, and hand
gradients of tensor-parallel, expert-parallel or own-ranks param-group
parameters (a rank's pieces there belong to other ranks' parameters).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .. import comm
from ..core.hooks import check_dense_grad


def touched(grads) -> Tuple[List[int], Dict[int, torch.Tensor]]:
    """(parameters whose p.grad was set to None, {parameter: the tensor assigned to its
    p.grad}) since the placeholders were placed (or, without them, since zero_grad)."""
    dropped, assigned = [], {}
    src = grads.source
    backward = None  # what autograd accumulated since zero_grad (inside no_sync(): not the script's)
    for i in grads.trainable:
        g = grads.params[i].grad
        if i in grads.placed:
            placed = grads.placed[i]
            if g is placed:
                continue
            if g is None:
                dropped.append(i)
            else:
                assigned[i] = g
        elif g is not None and not src.at_rest(i, g):
            backward = set(src.arrived()) if backward is None else backward
            if i not in backward:
                assigned[i] = g
    return dropped, assigned


def _checksum(g: torch.Tensor) -> Tuple[float, float]:
    d = g.detach().double()
    return float(d.sum()), float(d.square().sum())


def _name(grads, i: int) -> str:
    return f"parameter {i} (shape {tuple(grads.params[i].shape)})"


def _agree(grads, dropped: List[int], assigned: Dict[int, torch.Tensor]) -> None:
    """Every rank of the optimizer dropped and assigned the same gradients (collective
    among the ranks that touched one: see the Note)."""
    src = grads.source
    every = src.groups.every
    if torch.distributed.get_world_size(every) == 1:
        return
    what = "step() on gradients the script set in p.grad"
    comm.check_in(
        what,
        src,
        every,
        "Set p.grad (to None, or to a tensor) on every rank alike, as under DDP, "
        "where replicas that differ stop being replicas",
    )
    mine = (sorted(dropped), {i: _checksum(g) for i, g in sorted(assigned.items())})
    everyone = comm.all_gather_object(mine, group=every, what=what)
    if all(theirs == everyone[0] for theirs in everyone):
        return
    lines = []
    for r, (d, a) in enumerate(everyone):
        lines.append(f"rank {r}: p.grad None for {d or 'none'}, assigned for {sorted(a) or 'none'}")
    differ = sorted({i for _, a in everyone for i in a if any(a.get(i) != o.get(i) for _, o in everyone)})
    raise RuntimeError(
        grads.err(
            "the ranks set p.grad differently after the backward ("
            + "; ".join(lines)
            + ")"
            + (f"; the gradients assigned to {[_name(grads, i) for i in differ]} differ across ranks" if differ else "")
            + ". An assigned p.grad is the parameter's averaged gradient, the same on every rank: average a "
            "rank's own gradient first (torch.distributed.all_reduce(g, op=ReduceOp.AVG)), and set p.grad to "
            "None on every rank or on none. No parameter was updated"
        )
    )


def _refuse(grads, dropped: List[int], assigned: Dict[int, torch.Tensor]) -> None:
    for i, g in assigned.items():
        check_dense_grad(g, lambda: _name(grads, i), grads.err)
    src = grads.source
    special = set(src.expert_placements())
    if src.tensor_parallel() is not None or not grads.slots.identity:
        special |= set(assigned) | set(dropped)
    bad = sorted(special & (set(assigned) | set(dropped)))
    if bad:
        raise RuntimeError(
            grads.err(
                f"p.grad of {[_name(grads, i) for i in bad]} was replaced or set to None after the backward, but "
                "under tensor or expert parallelism (or a param group over its own ranks) a rank's pieces of the "
                "gradient are not the whole parameter's: scale or zero it in place (p.grad.mul_(0) skips its "
                "update but not its weight decay), or change the loss instead. No parameter was updated"
            )
        )


@torch.no_grad()
def _write(grads, assigned: Dict[int, torch.Tensor]) -> None:
    """This rank's pieces of each assigned gradient into the shards, divided by what the
    step multiplies them by (the engine's pending clip)."""
    src = grads.source
    if any(not seg.has_grad for seg in src.segments):
        src.allocate_grads()
    coef = grads.coef
    for seg in src.segments:
        for i, a, b, t_off in seg.pieces:
            g = assigned.get(i)
            if g is None or b <= a:
                continue
            piece = g.detach().reshape(-1)[t_off : t_off + b - a]
            for view in seg.grad_views(a, b):
                vals = piece.to(view.device, torch.float32)
                view.copy_(vals / coef.to(view.device) if coef is not None else vals)


def take(grads) -> bool:
    """Take what the script did to ``p.grad`` (see the Note); whether anything was taken."""
    dropped, assigned = touched(grads)
    if not dropped and not assigned:
        return False
    _agree(grads, dropped, assigned)
    _refuse(grads, dropped, assigned)
    grads.settle()
    _write(grads, assigned)
    _taken(grads, dropped, list(assigned))
    return True


def _taken(grads, dropped: List[int], assigned: List[int]) -> None:
    """The ``assigned`` gradients are in the shards: which parameters step and count now,
    statistics taken again when next read, placeholders over the assigned ones."""
    had = bool(grads.placed)  # (else no backward since zero_grad: no statistics yet)
    n = len(grads.params)
    used, seen = (list(grads.used), list(grads.seen)) if had else ([False] * n, [False] * n)
    for i in dropped:
        used[i] = seen[i] = False
    for i in assigned:
        used[i] = seen[i] = True
    grads.used, grads.seen = used, seen
    grads.by_hand = grads.by_hand or not had or bool(assigned)
    uncounted = [i for i in grads.trainable if not seen[i]]
    grads.uncounted_hand = torch.tensor(uncounted, dtype=torch.long, device=grads.source.device) if uncounted else None
    grads.stale.update(dropped + assigned if had else grads.trainable)
    grads.maxabs, grads.pnorms = None, {}
    for i in assigned:
        if i not in grads.kept:
            grads.kept[i] = grads.source.resting_grad(i, None)
        grads.placed[i] = grads.placeholders[i]
        grads.params[i].grad = grads.placed[i]
    grads.hook_leaves()
