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
as they are. The walk is collective over the model's ranks (each gather is):
every rank iterates it to the end; with ``to=r`` the others yield nothing.
Persistent buffers follow the parameters, in their own dtype.
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

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
    if any(u.ranks.own for u in fs.units):
        raise NotImplementedError(
            comm.on_rank(
                fs,
                "full_tensors of a model with expert units (their ranks hold "
                "different experts): save a checkpoint and read it whole with "
                "zeroshard.checkpoint.read_full_state_dict",
            )
        )
    keep = to is None or dist.get_rank() == to
    for u in fs.units:
        if not u.params:
            continue
        wire = {_cast(dtype, q.dtype) for q in u.params}
        gather_dtype = wire.pop() if len(wire) == 1 else torch.float32
        if u.numel * gather_dtype.itemsize <= bucket_bytes:
            yield from _whole_unit(fs, u, gather_dtype, dtype, keep)
        else:
            for q in u.params:
                yield from _one_param(fs, u, q, _cast(dtype, q.dtype), keep)
    if keep:
        for name, t in persistent_buffers(fs.module):
            yield name, t.detach()


@torch.no_grad()
def _whole_unit(fs: FullyShard, u: Unit, gather_dtype: torch.dtype, dtype, keep: bool):
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
        yield from _named(q, t.to(_cast(dtype, q.dtype)), keep)
    del flat


@torch.no_grad()
def _one_param(fs: FullyShard, u: Unit, q, dtype: torch.dtype, keep: bool):
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
    yield from _named(q, out.view(q.shape), keep)


def _named(q, t: torch.Tensor, keep: bool):
    if q.placed is not None:  # a DTensor parameter: its whole tensor, gathered over tp (collective)
        t = q.placed.wrap(t).full_tensor()
    if keep:
        for name in q.names:
            yield name, t
