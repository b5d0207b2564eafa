// Block quantization for compressed all-gathers: the wire layout, the codes'
// conversions and the per-block code the CPU and CUDA kernels share.
// Torch-free, host and device.
//
// [Note: quantized gathers] A unit's flat buffer is cut into segments at
// every rank's chunk bounds and at every tensor's start and end, so that no
// block spans two ranks or two tensors (a LayerNorm's weights near 1 beside
// a projection's near 0.02 would give the projection a step of 1/127). A
// segment of n elements travels as one "wire" record: n one-byte codes
// (padded to a multiple of 4 bytes), then one fp32 scale per block of `block`
// elements (the last block may be short); a rank's records follow each other,
// and every rank finds every other rank's codes and scales from the segment
// sizes alone (zeroshard.native.quant.segments). Each block is
// scaled by its largest magnitude: int8 codes are round-half-even(x / s),
// s = absmax / 127, in [-127, 127]; fp8 codes are e4m3fn (4 exponent bits,
// 3 mantissa bits, no infinities, largest 448) of x / s, s = absmax / 448,
// rounded to nearest even. A block of zeros has scale 0 and decodes to zeros.
// Decoding is code * s in fp32, then the destination's dtype (round to
// nearest even). Every operation is an IEEE one (no contraction), so the CPU
// and CUDA kernels agree bit for bit, and values of the form k * s with s a
// power of two and |k| <= 127 (int8) round-trip exactly.
#pragma once

#include <cstdint>

#include "adamw.h"  // ZS_HD, ScalarKind, the float conversions

namespace zeroshard {

enum class QuantKind : int32_t { kInt8 = 0, kFp8E4M3 = 1 };

ZS_HD int64_t quant_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }
ZS_HD int64_t quant_codes_bytes(int64_t n) { return (n + 3) / 4 * 4; }
// Bytes of one chunk of n elements on the wire: its codes, padded, then its scales.
ZS_HD int64_t quant_wire_bytes(int64_t n, int64_t block) {
  return quant_codes_bytes(n) + 4 * quant_blocks(n, block);
}

ZS_HD float a_nan() { return f32_from_bits(0x7FC00000u); }
ZS_HD float quant_max_code(QuantKind k) { return k == QuantKind::kInt8 ? 127.0f : 448.0f; }

// fp32 -> e4m3fn, round to nearest even, |x| clamped to 448 (NaN -> 0x7F).
ZS_HD uint8_t f32_to_e4m3(float x) {
  const uint32_t u = f32_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7F;  // NaN
  float a = f32_from_bits(u & 0x7FFFFFFFu);
  if (a > 448.0f) a = 448.0f;
  if (a < 0x1.0p-6f) {  // subnormal codes k * 2^-9 (k = 8 is the smallest normal, code 8)
    return sign | static_cast<uint8_t>(rintf(a * 512.0f));
  }
  const uint32_t b = f32_bits(a);
  int32_t e = static_cast<int32_t>(b >> 23) - 127;
  uint32_t m = (b & 0x7FFFFFu) >> 20;
  const uint32_t rest = b & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (m & 1u))) ++m;
  if (m == 8u) {
    m = 0u;
    ++e;
  }
  uint32_t code = (static_cast<uint32_t>(e + 7) << 3) | m;
  if (code > 0x7Eu) code = 0x7Eu;
  return sign | static_cast<uint8_t>(code);
}

ZS_HD float e4m3_to_f32(uint8_t c) {
  const uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
  float v;
  if ((c & 0x7Fu) == 0x7Fu) {
    v = a_nan();
  } else if (e == 0u) {
    v = static_cast<float>(m) * 0x1.0p-9f;
  } else {
    v = f32_from_bits(((e + 120u) << 23) | (m << 20));  // (1 + m/8) * 2^(e-7)
  }
  return (c & 0x80u) ? -v : v;
}

ZS_HD uint8_t quant_encode(float x, float scale, QuantKind k) {
  const float y = scale > 0.0f ? x / scale : 0.0f;
  if (k == QuantKind::kFp8E4M3) return f32_to_e4m3(y);
  float r = rintf(y);
  r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
  return static_cast<uint8_t>(static_cast<int8_t>(r));
}

ZS_HD float quant_decode(uint8_t c, float scale, QuantKind k) {
  const float v = k == QuantKind::kInt8 ? static_cast<float>(static_cast<int8_t>(c)) : e4m3_to_f32(c);
  return v * scale;
}

// One chunk of a call: `values` (fp32/bf16/fp16: quantized from, or decoded into) and its
// wire record; `first_block` numbers its blocks across the call's table.
struct QuantSegment {
  void* values;
  ScalarKind kind;
  uint8_t* wire;
  int64_t numel;
  int64_t first_block;
};

struct QuantTable {
  const QuantSegment* segs;
  int32_t n;
  int64_t blocks;  // total blocks: the kernels' work items
  int64_t block;   // elements per block
  QuantKind kind;
};

// Host-side reference over blocks [b0, b1) of segment `s` (the CPU kernels).
void quantize_cpu(const QuantSegment& s, int64_t block, QuantKind k, int64_t b0, int64_t b1);
void dequantize_cpu(const QuantSegment& s, int64_t block, QuantKind k, int64_t b0, int64_t b1);

// CUDA: one launch over every block of the table (device address `t.segs`); nullptr or
// the launch error.
const char* quant_cuda(const QuantTable& t, bool quantize, void* stream);

}  // namespace zeroshard
