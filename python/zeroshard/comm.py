"""Collectives on flat buffers over a torch.distributed process group.

Thin wrappers over csrc/comm.cpp (see [Note: collective ordering] in
csrc/comm.h): each returns a handle; call ``.wait()`` before using the result.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ._ext import _C

CommHandle = _C.CommHandle


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

    ``input_is_scratch=True`` lets the collective overwrite ``input`` (on CPU
    it then runs as a faster in-place all-reduce; see csrc/comm.h)."""
    return _C.reduce_scatter(group_name(group), input, output, bool(average), bool(input_is_scratch))


def all_gather(input: torch.Tensor, output: torch.Tensor, *,
               group: Optional[dist.ProcessGroup] = None) -> CommHandle:
    """``output`` = concatenation over ranks of ``input``. In place when ``input``
    is this rank's chunk of ``output`` (on CPU it then runs as one broadcast per
    rank, faster on gloo; see csrc/comm.h)."""
    return _C.all_gather(group_name(group), input, output)


def all_reduce(tensor: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None,
               average: bool = False) -> CommHandle:
    """``tensor`` = sum (mean if ``average``) of ``tensor`` over ranks, in place."""
    return _C.all_reduce(group_name(group), tensor, bool(average))
