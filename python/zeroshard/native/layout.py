"""Flat-buffer layout: which element of which bucket holds which tensor element.

The math is in C++ (csrc/layout.cpp, see [Note: layout rules] there); this
module turns torch dtypes into the itemsizes and keys it takes.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

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
) -> "_C.Layout":
    """Lay tensors of the given sizes and dtypes out in flat, sharded buckets.

    Tensors with the same ``(key, dtype)`` share one flat buffer (``keys``
    defaults to all zeros, so tensors are grouped by dtype alone). Tensors are
    split across buckets at the cap; every rank's shard of every bucket has
    the same length and is ``align_bytes``-aligned.
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
    return _C.compute_layout(numels, itemsizes, ids, int(bucket_cap_bytes), int(world_size),
                             int(align_bytes))


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
    the whole buffer and then adding."""
    for start, end in gaps(flat.numel(), [(offset, src.numel()) for offset, src in pieces]):
        flat[start:end].zero_()
    for offset, src in pieces:
        flat[offset:offset + src.numel()].copy_(src)
