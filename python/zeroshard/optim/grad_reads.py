"""Reading ``p.grad`` after a synced backward: the full averaged gradient, gathered.

[Note: gradient reads] After a backward, ``p.grad`` is a ``ShardedGrad``
placeholder over the reduced shards ([Note: sharded gradients]). What a
training script does to it in place (clipping, unscaling, zeroing) runs on
the shards. A *read* (``torch.equal``, ``allclose``, comparisons,
``torch.testing.assert_close``, ``abs().max()``, ``isfinite``, ``clone()``,
indexing, ``.cpu()``, arithmetic into a new tensor) gets DDP's value: the
full averaged gradient, gathered for it. That is collective: every rank of
the optimizer's group must make the same reads in the same order, as the
reads of a DDP script are (each rank reads its own ``p.grad``). A read made
on one rank alone checks in first ([Note: rank-0 code]) and fails within a
minute naming the parameter, instead of hanging. The gather is one
all-reduce of the parameter's size per read (each element is on one rank of
the shard group, zeros elsewhere); ``p.grad.full_tensor()`` (DTensor's name)
returns it explicitly, for a script that reads one gradient many times. A
placeholder's ``repr`` (what ``print`` and debuggers show) stays local: it
says what the gradient is and how to read it, and never communicates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm


def full_gradient(grads, i: int) -> torch.Tensor:
    """Parameter ``i``'s full averaged gradient (its shape, fp32, on the optimizer's
    device), as every rank of the group holds it after DDP's all-reduce (collective)."""
    src, p = grads.source, grads.params[i]
    comm.check_in(
        f"reading p.grad of parameter {i}",
        src,
        src.process_group,
        f"p.grad of parameter {i} (shape {tuple(p.shape)}) is sharded over the ranks: read it on every "
        "rank (each reads its own p.grad, as under DDP), or inside opt.no_sync() for the local values",
    )
    shape = src.full_shapes[i]  # (a DTensor parameter's local piece)
    out = torch.zeros(shape.numel(), dtype=torch.float32, device=src.device)
    coef = grads.coef
    for seg in src.segments:
        for j, a, b, t_off in seg.pieces:
            if j == i and b > a:
                piece = seg.grad[a:b].to(out.device, torch.float32)
                out[t_off : t_off + b - a] = piece * coef.to(out.device) if coef is not None else piece
    group = src.param_process_group(i)  # (a param group's own ranks: its experts')
    if dist.get_world_size(group) > 1:
        comm.all_reduce(out, group=group, what=f"p.grad read: parameter {i}").wait()
    tp = src.tensor_parallel()  # (gathered over tp: the whole gradient)
    return out.view(shape) if tp is None else tp.full(i, out.view(shape))


def read(func, args, kwargs, placeholder: type):
    """``func`` (an aten op that does not write its ``placeholder`` arguments) on the full
    gradients in place of each placeholder among ``args``/``kwargs``, cast to the
    placeholder's dtype and device (gathered in argument order: the same on every rank)."""

    def full(x):
        if isinstance(x, placeholder):
            return x.full_tensor()
        if isinstance(x, (list, tuple)):
            return type(x)(full(v) for v in x)
        return x

    return func(*full(tuple(args)), **{k: full(v) for k, v in (kwargs or {}).items()})


def writes(func) -> bool:
    """Whether ``func`` writes one of its tensor arguments (in place or into ``out=``)."""
    schema = func._schema
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
