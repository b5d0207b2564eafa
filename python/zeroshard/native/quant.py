"""Block quantization for compressed all-gathers (csrc/quant.h, csrc/quant_ops.cpp):
[Note: quantized gathers]."""

from __future__ import annotations

from typing import List, Sequence

import torch

from .ext import _C


def wire_bytes(numel: int, block: int) -> int:
    """Bytes of one chunk of ``numel`` elements on the wire: its one-byte codes, padded to a
    multiple of 4, then one fp32 scale per block of ``block`` elements."""
    return _C.quant_wire_bytes(numel, block)


def segments(bounds: Sequence[int], cuts: Sequence[int]) -> List[List[int]]:
    """Each rank's segments, as element counts: rank r's chunk ``[bounds[r], bounds[r + 1])``
    cut wherever ``cuts`` (the tensors' starts and ends in the flat buffer) fall inside it,
    so that no block of the quantization spans two tensors (whose magnitudes may differ by
    orders: a LayerNorm's weight and a projection's) or two ranks."""
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        inside = sorted({lo, hi} | {c for c in cuts if lo < c < hi})
        out.append([b - a for a, b in zip(inside[:-1], inside[1:]) if b > a])
    return out


def record_bytes(counts: Sequence[int], block: int) -> int:
    """Bytes of the wire records of segments of ``counts`` elements, laid end to end."""
    return sum(wire_bytes(n, block) for n in counts)


def quantize_blocks_(values: torch.Tensor, wire: torch.Tensor, counts: Sequence[int], block: int, kind: str) -> None:
    """The segments of ``counts`` elements laid end to end in ``values`` (fp32/bf16/fp16),
    block-quantized as ``kind`` ("int8" or "fp8") into their wire records, laid end to end
    in ``wire`` (uint8, ``record_bytes(counts, block)`` bytes), in one launch."""
    _C.quantize_blocks_(values, wire, list(counts), block, kind)


def dequantize_blocks_(wire: torch.Tensor, values: torch.Tensor, counts: Sequence[int], block: int, kind: str) -> None:
    """The wire records of segments of ``counts`` elements, laid end to end in ``wire``,
    decoded into ``values`` (fp32/bf16/fp16, ``sum(counts)`` elements), in one launch."""
    _C.dequantize_blocks_(wire, values, list(counts), block, kind)
