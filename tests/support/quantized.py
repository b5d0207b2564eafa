"""The reference of [Note: quantized gathers] (csrc/quant.h) in torch ops: what a chunk
decodes to, block by block."""

import torch


def decoded(x: torch.Tensor, block: int, kind: str) -> torch.Tensor:
    """``x`` (1-D, one rank's chunk) quantized in blocks of ``block`` and decoded, in fp32."""
    out = torch.empty(x.numel(), dtype=torch.float32)
    x = x.float()
    top = 127.0 if kind == "int8" else 448.0
    for lo in range(0, x.numel(), block):
        b = x[lo : lo + block]
        scale = b.abs().max() / top
        if scale == 0:
            out[lo : lo + block] = 0.0
            continue
        y = b / scale
        codes = y.round().clamp(-127, 127) if kind == "int8" else y.clamp(-448, 448).to(torch.float8_e4m3fn).float()
        out[lo : lo + block] = codes * scale
    return out


def decoded_segments(flat: torch.Tensor, cuts, block: int, kind: str) -> torch.Tensor:
    """``flat`` cut at ``cuts`` (sorted, from 0 to its size), each segment quantized alone."""
    return torch.cat([decoded(flat[lo:hi], block, kind) for lo, hi in zip(cuts[:-1], cuts[1:])])
