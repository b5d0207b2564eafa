"""Flat-buffer layout: which element of which bucket holds which tensor element.

The math is in C++ (csrc/layout.cpp, see [Note: layout rules] there); this
module turns torch dtypes into the itemsizes and keys it takes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import math

import torch

from .ext import _C

Layout = _C.Layout


def compute_layout(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    bucket_cap_bytes: int,
    world_size: int,
    keys: Optional[Sequence[int]] = None,
    align_bytes: int = 16,
    costs: Optional[Sequence[int]] = None,
) -> "_C.Layout":
    """Lay tensors of the given sizes and dtypes out in flat, sharded buckets.

    Tensors with the same ``(key, dtype)`` share one flat buffer (``keys``
    defaults to all zeros, so tensors are grouped by dtype alone). Tensors are
    split across buckets at the cap; every rank's shard of every bucket has
    the same length and is ``align_bytes``-aligned.

    ``costs`` (one per tensor; -1 for none) makes tensors *whole*: never split,
    each inside one rank's shard (its ``owner`` in ``Layout.tensors``), the
    owners balancing the summed cost (csrc/layout.h, [Note: owner-aligned
    layout]); a key's tensors are all whole or none is.
    """
    numels = [int(n) for n in numels]
    dtypes = list(dtypes)
    if len(dtypes) != len(numels):
        raise ValueError(f"dtypes has {len(dtypes)} entries but numels has {len(numels)}; "
                         "pass one dtype per tensor")
    keys = [0] * len(numels) if keys is None else [int(k) for k in keys]
    if len(keys) != len(numels):
        raise ValueError(f"keys has {len(keys)} entries but numels has {len(numels)}; "
                         "pass one key per tensor")
    for i, dt in enumerate(dtypes):
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"dtypes[{i}] is {dt!r}, not a torch.dtype")
    # One buffer per distinct (key, dtype), numbered in order of first use.
    buffer_ids: dict = {}
    ids = [buffer_ids.setdefault((k, dt), len(buffer_ids)) for k, dt in zip(keys, dtypes)]
    itemsizes = [dt.itemsize for dt in dtypes]
    costs = [] if costs is None else [int(c) for c in costs]
    if costs and len(costs) != len(numels):
        raise ValueError(f"costs has {len(costs)} entries but numels has {len(numels)}; "
                         "pass one cost per tensor (-1: not whole)")
    return _C.compute_layout(numels, itemsizes, ids, int(bucket_cap_bytes), int(world_size),
                             int(align_bytes), costs)


def update_cost(shape: Sequence[int]) -> int:
    """The relative cost of one whole-tensor update of a tensor of ``shape``:
    rows x cols x min(rows, cols) for a matrix (Newton-Schulz's matrix products;
    a tensor of more dimensions as (shape[0], the rest)); the size for a vector."""
    numel = math.prod(shape)
    if len(shape) < 2 or numel == 0:
        return numel
    rows = shape[0]
    cols = numel // rows
    return rows * cols * min(rows, cols)


def keep_balanced(owners: Dict[int, int], costs: Dict[int, int], world_size: int,
                  tolerance: float = 0.15) -> Dict[int, int]:
    """Of ``owners`` (tensor -> the rank that holds it whole, by chance of the layout),
    those each rank keeps: while a rank's cost exceeds the mean over the ranks of all of
    ``costs`` by more than ``tolerance``, it releases its costliest tensor (which is then
    owned where the packing of the released ones puts it). The same on every rank."""
    mean = sum(costs.values()) / world_size
    kept = dict(owners)
    for r in range(world_size):
        mine = sorted((i for i, o in owners.items() if o == r), key=lambda i: (-costs[i], i))
        load = sum(costs[i] for i in mine)
        for i in mine:
            if load <= (1 + tolerance) * mean:
                break
            del kept[i]
            load -= costs[i]
    return kept


def gaps(numel: int, covered: Sequence) -> List[Tuple[int, int]]:
    """The ``[start, end)`` ranges of ``[0, numel)`` that none of ``covered`` --
    ``(offset, length)`` pairs, none overlapping -- reaches, in order."""
    out, end = [], 0
    for offset, length in sorted(c for c in covered if c[1] > 0):
        if min(offset, numel) > end:
            out.append((end, min(offset, numel)))
        end = max(end, offset + length)
    if end < numel:
        out.append((end, numel))
    return out


def fill_flat(flat: torch.Tensor, pieces: Sequence) -> None:
    """Write ``pieces`` -- ``(offset, source)`` pairs, each source 1-D and none
    overlapping -- into ``flat`` in one pass: each source copied (cast to
    ``flat``'s dtype) at its offset, and every element no source covers
    (layout padding, tensors without a source) zeroed. Cheaper than zeroing
    the whole buffer and then adding; one foreach zero and one foreach copy, so
    a few kernel launches on CUDA rather than one per piece and per gap (a
    GPT-2 backward fills ~150 pieces)."""
    holes = [flat[start:end] for start, end in gaps(flat.numel(), [(offset, src.numel()) for offset, src in pieces])]
    if holes:
        torch._foreach_zero_(holes)
    if pieces:
        torch._foreach_copy_([flat[offset:offset + src.numel()] for offset, src in pieces], [src for _, src in pieces])
