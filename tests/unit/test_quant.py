"""The block-quantization kernels of the compressed all-gathers ([Note: quantized gathers] in
csrc/quant.h) against the same arithmetic in torch ops: segments of every size (short last
blocks, empty ones) in one launch, fp32/bf16/fp16 values, int8 and fp8 codes; the wire layout
and the segments; bad arguments refused naming them."""

import pytest
import torch

import zeroshard as zs
from support.quantized import decoded
from zeroshard.native import quant


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunks_decode_as_the_reference_does(kind, dtype):
    g = torch.Generator().manual_seed(11)
    counts, block = [257, 0, 31, 1000], 64
    chunks = [torch.randn(n, generator=g).mul(0.05).to(dtype) for n in counts]
    chunks[3][64:128] = 0.0  # a block of zeros
    wire = torch.zeros(quant.record_bytes(counts, block), dtype=torch.uint8)
    quant.quantize_blocks_(torch.cat(chunks), wire, counts, block, kind)  # (every segment, one launch)
    out = torch.empty(sum(counts), dtype=dtype)
    quant.dequantize_blocks_(wire, out, counts, block, kind)
    want = torch.cat([decoded(c, block, kind) for c in chunks]).to(dtype)
    assert torch.equal(out, want)
    err = (out.float() - torch.cat(chunks).float()).abs().max().item()
    assert 0 < err < (0.05 * 5 / 127 if kind == "int8" else 0.05 * 5 / 8), err


def test_wire_layout_and_segments():
    assert quant.wire_bytes(5, 32) == 8 + 4 and quant.wire_bytes(65, 32) == 68 + 12
    assert quant.record_bytes([5, 0, 65], 32) == 92
    # ranks' chunks [0, 10), [10, 20), [20, 24); tensors [0, 3), [3, 15), [15, 24)
    assert quant.segments([0, 10, 20, 24], [0, 3, 3, 15, 15, 24]) == [[3, 7], [5, 5], [4]]
    assert quant.segments([0, 8, 8], [0, 8]) == [[8], []]  # (an empty chunk: no segment)


def test_bad_arguments_are_refused_naming_them():
    x, wire = torch.ones(40), torch.empty(quant.wire_bytes(40, 32), dtype=torch.uint8)
    with pytest.raises(ValueError, match="block is 48; give a multiple of 32"):
        quant.quantize_blocks_(x, torch.empty(quant.wire_bytes(40, 48), dtype=torch.uint8), [40], 48, "int8")
    with pytest.raises(ValueError, match="kind is 'int4'"):
        quant.quantize_blocks_(x, wire, [40], 32, "int4")
    with pytest.raises(ValueError, match="wire has 10 elements"):
        quant.quantize_blocks_(x, wire[:10], [40], 32, "int8")
    with pytest.raises(ValueError, match="values has dtype torch.int64|values has dtype Long"):
        quant.quantize_blocks_(torch.ones(40, dtype=torch.long), wire, [40], 32, "int8")
    with pytest.raises(ValueError, match="the sum of counts"):
        quant.dequantize_blocks_(wire, torch.empty(41), [40], 32, "int8")
    with pytest.raises(ValueError, match=r"counts\[1\] is -1"):
        quant.dequantize_blocks_(wire, torch.empty(40), [41, -1], 32, "int8")
    with pytest.raises(ValueError, match="gather_dtype='int4'"):
        zs.MixedPrecision(gather_dtype="int4")
    with pytest.raises(ValueError, match="gather_block_size=100"):
        zs.MixedPrecision(gather_dtype="int8", gather_block_size=100)
