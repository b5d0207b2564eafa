// The CPU kernels of [Note: quantized gathers] (quant.h): blocks [b0, b1) of one chunk.
#include <cmath>

#include "quant.h"

namespace zeroshard {

void quantize_cpu(const QuantSegment& s, int64_t block, QuantKind k, int64_t b0, int64_t b1) {
  float* scales = reinterpret_cast<float*>(s.wire + quant_codes_bytes(s.numel));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, hi = lo + block < s.numel ? lo + block : s.numel;
    float amax = 0.0f;
    bool nan = false;
    for (int64_t i = lo; i < hi; ++i) {
      const float a = fabsf(load_as_f32(s.values, s.kind, i));
      nan |= a != a;
      amax = a > amax ? a : amax;
    }
    // (a NaN or an infinity in a block makes its scale non-finite: the block decodes to NaN)
    const float scale = nan || !is_finite_f32(amax) ? a_nan() : amax / quant_max_code(k);
    scales[b] = scale;
    for (int64_t i = lo; i < hi; ++i) s.wire[i] = quant_encode(load_as_f32(s.values, s.kind, i), scale, k);
  }
}

void dequantize_cpu(const QuantSegment& s, int64_t block, QuantKind k, int64_t b0, int64_t b1) {
  const float* scales = reinterpret_cast<const float*>(s.wire + quant_codes_bytes(s.numel));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * block, hi = lo + block < s.numel ? lo + block : s.numel;
    for (int64_t i = lo; i < hi; ++i) store_from_f32(s.values, s.kind, i, quant_decode(s.wire[i], scales[b], k));
  }
}

}  // namespace zeroshard
