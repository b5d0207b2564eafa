"""FullyShard units laid out again for a whole-tensor optimizer.

[Note: uneven chunks] A unit's flat buffer is cut into equal chunks, one per
rank, wherever its parameters fall. A whole-tensor optimizer (Muon,
Adafactor: optim/whole.py) updates each of its matrices whole, on one rank;
a matrix cut between two chunks would travel to its owner and back every
step (gradient and value in, value out), and equal chunks cannot hold whole
matrices without padding (a GPT block's four matrices, 3, 1, 4 and 4 units
of d², fill neither 2 nor 4 equal chunks). So when a whole-tensor
ShardedOptimizer is built over FullyShard parameters, each unit holding some
of them is laid out again, before anything trains:

* ``owner_chunks`` (native/layout.py) puts each of the optimizer's tensors
  inside the chunk of its owner (longest-processing-time packing on the
  update's cost, balanced over all the units together) and fills the chunks
  with the unit's other parameters toward one length. The chunks then
  differ in length (``Unit.bounds``), and the unit's all-gathers and
  reduce-scatters run over those chunks ([Note: uneven collectives]): the
  bytes they send are those of equal chunks, with no padding and no
  exchange, and each owner steps its matrices in place in its shard, as
  stages 1 and 2 do.
* The values move once: each unit's fp32 shards are all-gathered and every
  rank keeps its new chunk. The sharded parameters (what the modules and the
  optimizers hold) stay the same objects, pointing at their new pieces.
* Another ShardedOptimizer already built over a unit (AdamW over the norms
  and biases, built first) is bound again over the new layout, if it has not
  stepped yet; once anything has trained (a backward, a step) the layout is
  fixed and a whole-tensor optimizer built then is refused, naming the unit.

The other tensors fill the chunks to at least ``MIN_FILL`` elements, so on a
large job their few elements do not spread one or two to a rank over every
chunk: the unit's collectives run one broadcast (all-gather) or reduce
(reduce-scatter) per chunk that holds something ([Note: uneven collectives]),
so their host work grows with the unit's tensors, not with the world size.

The price: the chunks of one unit, so each rank's memory for it, differ (the
balance holds over the units together), and NCCL runs uneven collectives as
grouped broadcasts and reduces rather than its ring kernels.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from .. import comm
from ..native.layout import assign_owners, owner_chunks
from ..core.source import GradState
from ..core.tensor_parallel import point_at
from .records import Steppers, Unit, UnitState
from .wrap import Setup, host_or_device_zeros, layout_align, place_piece, set_grad_extent, unit_layout

# The least a chunk holding the unit's other tensors is filled to (elements): with many more
# ranks than whole tensors, the collectives then touch the owners' chunks and a few others,
# not every rank's (see the Note); a rank holds at most this many elements more than an even
# share would give it.
MIN_FILL = 1 << 16


def lay_out(
    cfg: Setup, units: List[Unit], costs: Dict[int, int], load: List[int], backward, steppers: Steppers, by: object
):
    """``lay_out_for_owners`` for a FullyShard (its UnitBackward ``backward``) and the
    whole-tensor update of stepper ``by``; the other steppers over moved units are told
    (``Stepper.relaid``: their optimizers bind again)."""

    def busy(u: Unit) -> Optional[str]:
        if backward.active or u.state != UnitState.SHARDED:
            return "a forward or backward is running"
        if backward.gatherer.steps_done or u.reduction.grad.tensor is not None or u.reduction.buffer is not None:
            return "the model has already trained (it holds gradients, or it has stepped)"
        return next((why for s in steppers.over({u.index}) if s is not by and (why := s.relayout_blocker())), None)

    moved = lay_out_for_owners(cfg, units, costs, load, busy)
    for s in steppers.over({u.index for u in moved}):
        if s is not by:
            s.relaid()


@torch.no_grad()
def lay_out_for_owners(
    cfg: Setup, units: List[Unit], costs: Dict[int, int], load: List[int], busy: Callable[[Unit], Optional[str]]
) -> List[Unit]:
    """Lay the units holding any of ``costs``' tensors (id of a sharded parameter ->
    its update cost) out so each lies inside its owner's chunk, the owners chosen by
    longest-processing-time packing within each group of ranks the units shard over:
    over every rank on top of ``load`` (each rank's cost already owned; updated), over an
    expert unit's own ranks from nothing. ``busy(u)``: why ``u`` cannot move now, or
    None. Returns the units that moved. Collective over ``cfg.group``."""
    # (each edp group of an expert unit packs the same shapes, so the same way)
    owner: Dict[int, int] = {}
    by_ranks: Dict[int, tuple] = {}
    for u in units:
        by_ranks.setdefault(id(u.ranks), (u.ranks, []))[1].extend(
            q for q in u.params if id(q.sharded) in costs and q.requires_grad and q.numel
        )
    for ranks, whole in by_ranks.values():
        room = load if not ranks.own else [0] * ranks.world
        owner.update(zip(map(id, whole), assign_owners([costs[id(q.sharded)] for q in whole], ranks.world, room)))
        for q in whole:
            room[owner[id(q)]] += costs[id(q.sharded)]
    moved = []
    for u in units:
        if not any(id(q) in owner for q in u.params):
            continue
        layout = owner_chunks(
            [q.numel for q in u.params],
            {k: owner[id(q)] for k, q in enumerate(u.params) if id(q) in owner},
            u.ranks.world,
            layout_align(cfg.param_dtype),
            MIN_FILL,
        )
        now = [u.span(r)[0] for r in range(u.ranks.world)] + [u.numel]
        if layout.offsets == [q.offset for q in u.params] and layout.bounds == now:
            continue
        why = busy(u)
        if why:
            raise RuntimeError(
                cfg.err(
                    f"a whole-tensor optimizer needs FullyShard unit '{u.name}' laid out again (each of its "
                    f"tensors inside its owner's chunk), but {why}. Build the whole-tensor ShardedOptimizer "
                    "before training (before the first forward and backward)"
                )
            )
        _move(cfg, u, layout.offsets, layout.bounds)
        moved.append(u)
    return moved


def _blocker(u: Unit, backward) -> Optional[str]:
    """Why ``u`` cannot be laid out again for its trainable parameters now, or None."""
    if backward.active or u.state != UnitState.SHARDED:
        return "a forward or backward is running"
    if backward.state == GradState.READY or u.reduction.buffer is not None:
        return "gradients wait for step()"
    if u.bounds is not None:
        return "it is laid out for a whole-tensor optimizer"
    if u.ranks.own:
        return "it is an expert unit over its own ranks (expert_modules), not laid out again yet"
    return None


def retrain(cfg: Setup, units: List[Unit], backward, steppers: Steppers, by: object) -> List[tuple]:
    """Lay out again, in equal chunks with their trainable parameters first, values kept, the
    units whose parameters' ``requires_grad`` changed since they were laid out: one frozen
    when wrapped and unfrozen since takes gradients; one frozen since leaves the gradient
    buffer and its reduce-scatter, as FSDP2's ([Note: frozen parameters] in zero3/wrap.py),
    unless an optimizer over its unit holds state (it has stepped, or loaded a checkpoint):
    then it keeps its place, reduced as zeros, since the optimizer's new layout would drop
    the frozen parameter's state, which torch keeps for when it is unfrozen.
    The steppers over them but ``by`` are told (their optimizers bind again, their state
    carried over: [Note: new parameters] in optim/regroup.py). An unfreezing the unit cannot
    take now is refused; a freezing waits (the parameter takes no gradient meanwhile, its
    range reduced as zeros). Returns the (unit, parameter record) of each parameter thawed.
    Collective over ``cfg.group``."""
    moved, thawed_all = [], []
    for u in units:
        thawed = [q for q in u.params if not q.requires_grad and q.sharded.requires_grad]
        frozen = [q for q in u.params if q.requires_grad and not q.sharded.requires_grad]
        if any(s.relayout_blocker() for s in steppers.over({u.index})):  # (an optimizer's state
            frozen = []  # of them, stepped or loaded, kept in place for an unfreezing)
        if not thawed and not frozen:
            continue
        why = _blocker(u, backward)
        if why and thawed:
            raise RuntimeError(
                cfg.err(
                    f"parameter '{thawed[0].names[0]}' of FullyShard unit '{u.name}' was frozen when the model was "
                    f"wrapped and is unfrozen now; laying the unit out again for its gradient is refused: {why}. "
                    "Unfreeze it after step() (or zero_grad()) and before the next forward, or wrap the model with "
                    "it trainable and freeze it with requires_grad_(False) until it should train"
                )
            )
        if why:
            continue
        u.retrained(thawed + frozen)
        for q in thawed + frozen:
            q.full.requires_grad_(q.requires_grad)
        offsets, shard_numel = unit_layout(cfg, u)
        _move(cfg, u, offsets, [r * shard_numel for r in range(cfg.world + 1)])
        u.bounds, u.reduction.grad.tensor = None, None  # (equal chunks; the gradients were zeroed)
        for q in u.params:
            q.sharded.grad = None  # (views of the gradient shard just dropped)
        set_grad_extent(u, cfg.world)
        moved.append(u)
        thawed_all += [(u, q) for q in thawed]
    for s in steppers.live() if moved else ():  # (any may hold the changed ones; each binds anew)
        if s is not by:
            s.relaid()
    return thawed_all


def _move(cfg: Setup, u: Unit, offsets: List[int], bounds: List[int]):
    """``u``'s parameters to ``offsets`` and its chunks to ``bounds``, values kept."""
    dev = cfg.device
    values = None
    if dev.type != "meta":
        values = torch.empty(u.numel, dtype=torch.float32, device=dev)
        comm.all_gather(
            u.shard.to(dev), values, group=u.ranks.group, bounds=u.bounds, what=f"relayout: unit '{u.name}' values"
        ).wait()
    old = [q.offset for q in u.params]
    lo, hi = bounds[u.ranks.rank], bounds[u.ranks.rank + 1]
    u.bounds, u.numel, u.shard_numel = list(bounds), bounds[-1], hi - lo
    u.shard = host_or_device_zeros(u.shard_numel, cfg.shard_device, dev)
    u.full = torch.empty(u.numel, dtype=cfg.param_dtype, device=dev)
    for q, off, was in zip(u.params, offsets, old):
        q.offset = off
        place_piece(u, q, lo, hi)
        n = q.local.numel()
        if values is not None and n:
            q.local.copy_(values[was + q.tensor_offset : was + q.tensor_offset + n])
        q.sharded.place(q.local, q.tensor_offset)
        point_at(q.full, u.full[q.offset : q.offset + q.numel].view(q.shape))
    set_grad_extent(u, u.ranks.world)  # ([Note: frozen parameters]: over the new offsets)
    if dev.type != "meta":
        u.full.untyped_storage().resize_(0)
