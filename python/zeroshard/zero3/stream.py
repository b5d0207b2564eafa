"""Whole tensors out of a sharded model, one unit at a time: ``zeroshard.full_tensors``.

[Note: streamed whole tensors] An inference engine beside training (vLLM's or
SGLang's ``load_weights``, an evaluation copy) wants each parameter whole,
under the model's own names, without a state dict of the whole model in
memory. ``full_tensors`` walks a FullyShard model unit by unit: each unit is
all-gathered once, in the dtype asked for (the fp32 shards are cast before
the gather, so bf16 moves half the bytes), and its parameters are yielded as
views of that buffer, which is dropped when the walk moves past the unit;
a unit larger than ``bucket_mb`` is gathered parameter by parameter instead.
Memory: one unit (or one parameter) gathered, plus what the caller keeps. A
plain module (ZeRO-1/2: its parameters are whole on every rank) yields them
as they are. An expert unit (``expert_modules``: its expert-parallel ranks hold other
experts under the same local names) is gathered over its own ranks, then
each expert-parallel group's copy is broadcast from one of its ranks to
every rank, and yielded under its whole-model name (``expert_names``, which
it needs): every expert once, as in the whole model's state dict.
The walk is collective over the model's ranks (each gather is):
every rank iterates it to the end; with ``to=r`` the others yield nothing.
Persistent buffers follow the parameters, in their own dtype.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..core.regions import persistent_buffers, sharded_model_of
from .fully_shard import FullyShard
from .records import Unit


def full_tensors(
    model: nn.Module, dtype: Optional[torch.dtype] = torch.bfloat16, bucket_mb: float = 512, *, to: Optional[int] = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)``: every parameter of ``model`` whole, under the unwrapped
    model's names (tied ones under each name), in ``dtype`` (floating parameters; None:
    the model's dtype), then its persistent buffers; one FullyShard unit gathered at a
    time (or one parameter, for units over ``bucket_mb``), on every rank, or on rank
    ``to`` only (the others take part in the gathers and yield nothing). Collective:
    iterate it on every rank. A yielded tensor is valid until the walk leaves its unit:
    copy it to keep it ([Note: streamed whole tensors])."""
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"full_tensors(dtype={dtype}): give a floating dtype (or None for the model's)")
    if not bucket_mb > 0:
        raise ValueError(f"full_tensors(bucket_mb={bucket_mb}): give a size in MiB > 0")
    if isinstance(sharded_model_of(model), FullyShard):
        yield from _sharded(sharded_model_of(model), dtype, int(bucket_mb * 2**20), to)
        return
    inner = [n for n, m in model.named_modules() if isinstance(m, FullyShard)]
    if inner:
        raise TypeError(
            f"full_tensors(model): '{inner[0]}' inside it is a FullyShard model; pass the "
            "FullyShard model itself (the outermost one)"
        )
    keep = to is None or (dist.is_initialized() and dist.get_rank() == to) or (not dist.is_initialized() and to == 0)
    if not keep:
        return
    params = {id(p) for p in model.parameters()}
    for name, t in model.state_dict(keep_vars=True).items():
        t = t.detach()
        yield name, (t.to(dtype) if dtype is not None and id(t) in params and t.is_floating_point() else t)


def _cast(dtype: Optional[torch.dtype], like: torch.dtype) -> torch.dtype:
    return like if dtype is None or not like.is_floating_point else dtype


def _sharded(fs: FullyShard, dtype, bucket_bytes: int, to: Optional[int]):
    comm.check_in(
        "zeroshard.full_tensors()",
        fs,
        fs.process_group,
        "Iterate full_tensors(model, to=0) on every rank: the others yield nothing",
    )
    keep = to is None or dist.get_rank() == to
    experts = _expert_peers(fs) if any(u.ranks.own for u in fs.units) else None
    for ui, u in enumerate(fs.units):
        if not u.params:
            continue
        wire = {_cast(dtype, q.dtype) for q in u.params}
        gather_dtype = wire.pop() if len(wire) == 1 else torch.float32
        if u.numel * gather_dtype.itemsize <= bucket_bytes:
            whole = _whole_unit(fs, u, gather_dtype, dtype)
        else:
            whole = (p for q in u.params for p in _one_param(fs, u, q, _cast(dtype, q.dtype)))
        for qi, (q, t) in enumerate(whole):
            if u.ranks.own:
                yield from _across_experts(fs, experts, (ui, qi), t, keep)
            elif keep:
                yield from ((name, t) for name in q.names)
    if keep:
        for name, t in persistent_buffers(fs.module):
            yield name, t.detach()


@torch.no_grad()
def _whole_unit(fs: FullyShard, u: Unit, gather_dtype: torch.dtype, dtype):
    """``(q, whole tensor)`` for each parameter of ``u``, from one all-gather of the unit."""
    flat = torch.empty(u.numel, dtype=gather_dtype, device=fs.device)
    comm.all_gather(
        u.shard.to(fs.device, gather_dtype),
        flat,
        group=u.ranks.group,
        bounds=u.bounds,
        what=f"full_tensors: unit '{u.name}'",
    ).wait()
    for q in u.params:
        t = flat[q.offset : q.offset + q.numel].view(q.shape)
        yield q, _placed(q, t.to(_cast(dtype, q.dtype)))
    del flat


@torch.no_grad()
def _one_param(fs: FullyShard, u: Unit, q, dtype: torch.dtype):
    """Parameter ``q`` of ``u`` alone: each rank's piece of it gathered (uneven pieces)."""
    world = u.ranks.world
    starts = u.bounds if u.bounds is not None else [r * u.shard_numel for r in range(world + 1)]
    bounds = [min(max(s, q.offset), q.offset + q.numel) - q.offset for s in starts]
    out = torch.empty(q.numel, dtype=dtype, device=fs.device)
    comm.all_gather(
        q.local.to(fs.device, dtype),
        out,
        group=u.ranks.group,
        bounds=bounds,
        what=f"full_tensors: parameter '{q.names[0]}'",
    ).wait()
    yield q, _placed(q, out.view(q.shape))


def _placed(q, t: torch.Tensor) -> torch.Tensor:
    if q.placed is not None:  # a DTensor parameter: its whole tensor, gathered over tp (collective)
        t = q.placed.wrap(t).full_tensor()
    return t


def _expert_peers(fs: FullyShard) -> List[Tuple[int, dict]]:
    """For each group of ranks holding other experts (``color``), the global rank that speaks
    for it and its parameters' names in the whole model, by (unit, parameter) position: one
    exchange over every rank. Refused without ``expert_names`` (each rank's local names are
    the same names for different experts)."""
    held = iter(fs.held_regions()[0])
    names, mine = {}, None
    for ui, u in enumerate(fs.units):
        for qi, q in enumerate(u.params):
            whole = next(held).whole_name
            if u.ranks.own:
                mine = u.ranks
                if whole is None:
                    raise ValueError(
                        comm.on_rank(
                            fs,
                            f"full_tensors: expert parameter '{q.names[0]}' has no name in the whole model (each "
                            "expert-parallel rank holds other experts under the same local names): give FullyShard "
                            "expert_names=fn (a parameter's local name -> its name in the whole model)",
                        )
                    )
                names[(ui, qi)] = whole
    peers = comm.all_gather_object(
        (mine.color, mine.rank, dist.get_rank(), names), group=fs.process_group, what="full_tensors: expert names"
    )
    speakers = {color: (rank, named) for color, own_rank, rank, named in peers if own_rank == 0}
    return [speakers[c] for c in range(mine.count)]


@torch.no_grad()
def _across_experts(fs: FullyShard, peers, at: Tuple[int, int], t: torch.Tensor, keep: bool):
    """Expert parameter ``at`` (unit, parameter position) whole on this rank: the same
    position's tensor of every group of expert ranks, each broadcast from its speaker over
    every rank, yielded under that group's whole-model name."""
    for rank, named in peers:
        theirs = t if rank == dist.get_rank() else torch.empty_like(t)
        comm.broadcast_bytes(theirs, src=rank, group=fs.process_group)
        if keep:
            yield named[at], theirs
