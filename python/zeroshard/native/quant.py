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


def wire_starts(counts: Sequence[int], block: int) -> List[int]:
    """Where each chunk's wire record starts in the records of chunks of ``counts`` elements laid
    end to end, and their total (the last entry)."""
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + wire_bytes(n, block))
    return starts


def quantize_blocks_(values: torch.Tensor, wire: torch.Tensor, block: int, kind: str) -> None:
    """``values`` (fp32/bf16/fp16) block-quantized as ``kind`` ("int8" or "fp8") into ``wire``
    (uint8, ``wire_bytes(values.numel(), block)`` bytes)."""
    _C.quantize_blocks_(values, wire, block, kind)


def dequantize_blocks_(wire: torch.Tensor, values: torch.Tensor, counts: Sequence[int], block: int, kind: str) -> None:
    """The wire records of chunks of ``counts`` elements, laid end to end in ``wire``, decoded
    into ``values`` (fp32/bf16/fp16, ``sum(counts)`` elements), in one launch."""
    _C.dequantize_blocks_(wire, values, list(counts), block, kind)
