"""Collectives on flat buffers over a torch.distributed process group.

Thin wrappers over csrc/comm.cpp (see [Note: collective ordering] in
csrc/comm.h): each returns a handle; call ``.wait()`` before using the result.
"""
from __future__ import annotations

import pickle
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ._ext import _C

CommHandle = _C.CommHandle


def on_rank(who, msg: str) -> str:
    """``msg`` prefixed with ``[rank r/N]`` of ``who`` (anything with ``rank`` and ``world_size``):
    every error message of the library that depends on the rank says which one."""
    return f"[rank {who.rank}/{who.world_size}] {msg}"


def group_name(group: Optional[dist.ProcessGroup] = None) -> str:
    """The registered name of ``group`` (default: the world group)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group() first (torchrun sets it up)")
    if group is None:
        group = dist.group.WORLD
    return group.group_name


def reduce_scatter(input: torch.Tensor, output: torch.Tensor, *,
                   group: Optional[dist.ProcessGroup] = None, average: bool = True,
                   input_is_scratch: bool = False) -> CommHandle:
    """``output`` = this rank's chunk of the sum (mean if ``average``) of ``input`` over ranks.

    ``input_is_scratch=True`` lets the collective overwrite ``input`` (a CPU
    group whose backend is not gloo then runs an in-place all-reduce). On gloo
    it runs as point-to-point messages that leave ``input`` as it is: when
    ``output`` lies inside ``input`` the peers' chunks are received into
    scratch memory ((N-1)/N of ``input``) until ``wait()``; see csrc/comm.h."""
    return _C.reduce_scatter(group_name(group), input, output, bool(average), bool(input_is_scratch))


def all_gather(input: torch.Tensor, output: torch.Tensor, *,
               group: Optional[dist.ProcessGroup] = None) -> CommHandle:
    """``output`` = concatenation over ranks of ``input``. In place when ``input``
    is this rank's chunk of ``output`` (on gloo it then runs as point-to-point
    messages, faster than gloo's all-gather; see csrc/comm.h)."""
    return _C.all_gather(group_name(group), input, output)


def all_reduce(tensor: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None,
               average: bool = False) -> CommHandle:
    """``tensor`` = sum (mean if ``average``) of ``tensor`` over ranks, in place."""
    return _C.all_reduce(group_name(group), tensor, bool(average))


def all_gather_object(obj: Any, *, group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Every rank's ``obj`` (picklable), in group-rank order; collective.

    ``torch.distributed.all_gather_object`` hands gloo tensors that Python
    owns, and gloo's worker thread may drop the last reference to one after
    the call returned: at interpreter exit (a script whose last collective it
    was: a checkpoint save, say) that needs the GIL and aborts the process.
    On gloo this runs over this module's all-gather instead, which never
    hands the backend such a tensor (see [Note: backend views] in
    csrc/comm.cpp); other backends use torch's."""
    if group is None:
        group = dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) != "gloo":
        out = [None] * world
        dist.all_gather_object(out, obj, group=group)
        return out
    data = pickle.dumps(obj)
    lens = torch.zeros(world, dtype=torch.float64)   # exact for lengths < 2**53
    lens[rank] = len(data)
    all_gather(lens[rank:rank + 1], lens, group=group).wait()
    words = max(1, -(-int(lens.max().item()) // 8))   # the bytes travel as float64 bit patterns
    buf = torch.zeros(world * words, dtype=torch.float64)
    mine = buf[rank * words:(rank + 1) * words]
    mine.view(torch.uint8)[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    all_gather(mine, buf, group=group).wait()
    raw = buf.view(torch.uint8).numpy().tobytes()
    return [pickle.loads(raw[r * words * 8:r * words * 8 + int(lens[r])]) for r in range(world)]
