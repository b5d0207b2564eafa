"""Flat-buffer layout: which element of which bucket holds which tensor element.

The math is in C++ (csrc/layout.cpp, see [Note: layout rules] there); this
module turns torch dtypes into the itemsizes and keys it takes.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        raise ValueError(f"dtypes has {len(dtypes)} entries but numels has {len(numels)}; pass one dtype per tensor")
    keys = [0] * len(numels) if keys is None else [int(k) for k in keys]
    if len(keys) != len(numels):
        raise ValueError(f"keys has {len(keys)} entries but numels has {len(numels)}; pass one key per tensor")
    for i, dt in enumerate(dtypes):
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"dtypes[{i}] is {dt!r}, not a torch.dtype")
    # One buffer per distinct (key, dtype), numbered in order of first use.
    buffer_ids: dict = {}
    ids = [buffer_ids.setdefault((k, dt), len(buffer_ids)) for k, dt in zip(keys, dtypes)]
    itemsizes = [dt.itemsize for dt in dtypes]
    costs = [] if costs is None else [int(c) for c in costs]
    if costs and len(costs) != len(numels):
        raise ValueError(
            f"costs has {len(costs)} entries but numels has {len(numels)}; pass one cost per tensor (-1: not whole)"
        )
    return _C.compute_layout(numels, itemsizes, ids, int(bucket_cap_bytes), int(world_size), int(align_bytes), costs)


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


def assign_owners(costs: Sequence[int], world_size: int, load: Optional[Sequence[int]] = None) -> List[int]:
    """The owner rank of each tensor: longest-processing-time packing (the costliest
    first, each onto the least loaded rank, the lower rank on a tie), the same on
    every rank. ``load``: each rank's cost already owned (default none)."""
    load = list(load) if load is not None else [0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def keep_balanced(
    owners: Dict[int, int], costs: Dict[int, int], world_size: int, tolerance: float = 0.15
) -> Dict[int, int]:
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


def chunk_span(bounds: Optional[Sequence[int]], shard_numel: int, rank: int) -> Tuple[int, int]:
    """Rank ``rank``'s chunk ``[start, end)`` of a flat buffer cut at ``bounds`` (world + 1
    offsets), or into equal chunks of ``shard_numel`` when ``bounds`` is None."""
    if bounds is not None:
        return bounds[rank], bounds[rank + 1]
    return rank * shard_numel, (rank + 1) * shard_numel


@dataclass(frozen=True)
class ChunkLayout:
    """A flat buffer cut into one chunk per rank, of different lengths."""

    offsets: List[int]  # each tensor's offset in the flat buffer
    bounds: List[int]  # rank r's chunk is [bounds[r], bounds[r + 1]); bounds[-1]: the length


def owner_chunks(
    numels: Sequence[int], owners: Dict[int, int], world_size: int, align: int = 4, min_fill: int = 0
) -> ChunkLayout:
    """One flat buffer (a FullyShard unit) cut into chunks of different lengths so that
    each *whole* tensor (``owners``: tensor -> rank) lies inside its owner's chunk.

    The other tensors (updated elementwise) fill the chunks up to one common length
    where they can (a tensor may be cut between two neighbouring chunks), so the
    chunks are as even as the whole tensors allow. Every tensor and chunk starts at
    a multiple of ``align`` elements. The same on every rank (see [Note: uneven
    chunks] in zero3/relayout.py). ``min_fill``: the common length is at least this
    (or all of the other tensors, if fewer), so a few elements of them do not spread
    over every chunk: with many more ranks than whole tensors, only the owners' chunks
    and about (their elements / min_fill) others then hold anything."""
    n = world_size

    def up(x: int) -> int:
        return -(-x // align) * align

    owners = {i: r for i, r in owners.items() if numels[i] > 0}
    mine: List[List[int]] = [[] for _ in range(n)]
    size = [0] * n
    for i, r in owners.items():
        mine[r].append(i)
        size[r] += up(numels[i])
    rest = [i for i in range(len(numels)) if i not in owners]
    stream = sum(up(numels[i]) for i in rest)
    lo, hi = 0, up(max(size) + stream)  # the common length the fill reaches
    while lo < hi:
        mid = (lo + hi) // 2 // align * align
        if sum(max(0, mid - s) for s in size) >= stream:
            hi = mid
        else:
            lo = mid + align
    level = max(lo, up(min(min_fill, stream)))
    offsets = [0] * len(numels)
    bounds, pos, k, carry_end = [0], 0, 0, 0  # carry_end: the end of a tensor cut at the last bound
    for r in range(n):
        start, last = pos, r == n - 1
        if carry_end > start and not mine[r] and not last and carry_end > start + level:
            pos = start + level  # a long tensor crosses this chunk too
            bounds.append(pos)
            continue
        pos = max(pos, carry_end)
        for i in sorted(mine[r]):
            offsets[i] = pos
            pos += up(numels[i])
        end = max(start + level, pos)
        while k < len(rest) and (pos < end or last):
            i = rest[k]
            offsets[i], k = pos, k + 1
            if pos + up(numels[i]) > end and not last:
                carry_end, pos = pos + up(numels[i]), end  # cut: its rest opens the next chunk
                break
            pos += up(numels[i])
        bounds.append(pos)
    return ChunkLayout(offsets, bounds)


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
        torch._foreach_copy_(
            [flat[offset : offset + src.numel()] for offset, src in pieces], [src for _, src in pieces]
        )
