// [Note: quantized gathers]: the codes' conversions, the wire layout, exact round trips.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "quant.h"

using namespace zeroshard;

namespace {

// The e4m3fn code nearest to x (|x| <= 448), ties to the even code: by enumeration.
uint8_t nearest_e4m3(float x) {
  int best = -1;
  double best_err = 0;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    const double err = std::fabs(static_cast<double>(e4m3_to_f32(static_cast<uint8_t>(c))) - x);
    const bool sign_ok = (c & 0x80) == (std::signbit(x) ? 0x80 : 0);
    if (!sign_ok) continue;
    if (best < 0 || err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best);
}

std::vector<uint8_t> wire_of(int64_t n, int64_t block) { return std::vector<uint8_t>(quant_wire_bytes(n, block)); }

}  // namespace

TEST(Quant, WireLayout) {
  EXPECT_EQ(quant_wire_bytes(5, 32), 8 + 4);
  EXPECT_EQ(quant_wire_bytes(64, 32), 64 + 8);
  EXPECT_EQ(quant_wire_bytes(65, 32), 68 + 12);
  EXPECT_EQ(quant_wire_bytes(0, 32), 0);
}

TEST(Quant, E4m3CodesRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(f32_to_e4m3(e4m3_to_f32(static_cast<uint8_t>(c))), c) << c;
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1.0p-9f);
  EXPECT_EQ(e4m3_to_f32(0x08), 0x1.0p-6f);
  EXPECT_EQ(f32_to_e4m3(1000.0f), 0x7E);  // saturates
  EXPECT_EQ(f32_to_e4m3(std::nanf("")), 0x7F);
}

TEST(Quant, E4m3RoundsToNearestEven) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> mag(-12.0f, 8.7f);
  for (int i = 0; i < 20000; ++i) {
    float x = std::ldexp(1.0f + (gen() % 1000) / 1000.0f, static_cast<int>(mag(gen)));
    if (x > 448.0f) x = 448.0f;
    if (gen() & 1) x = -x;
    EXPECT_EQ(f32_to_e4m3(x), nearest_e4m3(x)) << x;
  }
  // exact ties: halfway between 1.0 (mantissa 0) and 1.125 (1) -> 1.0; between 1.125 and 1.25 -> 1.25
  EXPECT_EQ(e4m3_to_f32(f32_to_e4m3(1.0625f)), 1.0f);
  EXPECT_EQ(e4m3_to_f32(f32_to_e4m3(1.1875f)), 1.25f);
}

TEST(Quant, Int8RepresentableValuesRoundTripExactly) {
  const int64_t block = 64, n = 3 * block + 17;  // a short last block
  std::vector<float> x(n), back(n);
  std::mt19937 gen(3);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<int>(gen() % 255) - 127) * 0x1.0p-7f;
  for (int64_t b = 0; b * block < n; ++b) x[b * block] = 127 * 0x1.0p-7f;  // each block's largest: scale 2^-7
  std::vector<uint8_t> wire = wire_of(n, block);
  QuantSegment q{x.data(), ScalarKind::kFloat32, wire.data(), n, 0};
  quantize_cpu(q, block, QuantKind::kInt8, 0, quant_blocks(n, block));
  QuantSegment d{back.data(), ScalarKind::kFloat32, wire.data(), n, 0};
  dequantize_cpu(d, block, QuantKind::kInt8, 0, quant_blocks(n, block));
  EXPECT_EQ(x, back);
}

TEST(Quant, ErrorIsBoundedByHalfAStep) {
  const int64_t block = 128, n = 1000;
  std::vector<float> x(n), back(n);
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  for (float& v : x) v = nd(gen);
  for (QuantKind k : {QuantKind::kInt8, QuantKind::kFp8E4M3}) {
    std::vector<uint8_t> wire = wire_of(n, block);
    QuantSegment q{x.data(), ScalarKind::kFloat32, wire.data(), n, 0};
    quantize_cpu(q, block, k, 0, quant_blocks(n, block));
    QuantSegment d{back.data(), ScalarKind::kFloat32, wire.data(), n, 0};
    dequantize_cpu(d, block, k, 0, quant_blocks(n, block));
    for (int64_t i = 0; i < n; ++i) {
      float amax = 0;
      for (int64_t j = i / block * block; j < std::min(n, i / block * block + block); ++j)
        amax = std::max(amax, std::fabs(x[j]));
      // int8: half a step of amax/127; e4m3: 3 mantissa bits, half an ulp (2^-4 relative), or
      // half the smallest subnormal step of the block's scale
      const float bound = k == QuantKind::kInt8 ? amax / 127 * 0.5f
                                                : std::max(std::fabs(x[i]) / 16, amax / 448 * 0x1.0p-10f);
      EXPECT_LE(std::fabs(back[i] - x[i]), bound * 1.0001f) << i;
    }
  }
}

TEST(Quant, ZeroAndNonFiniteBlocks) {
  const int64_t block = 32, n = 64;
  std::vector<float> x(n, 0.0f), back(n, 1.0f);
  x[40] = std::nanf("");
  std::vector<uint8_t> wire = wire_of(n, block);
  QuantSegment q{x.data(), ScalarKind::kFloat32, wire.data(), n, 0};
  quantize_cpu(q, block, QuantKind::kInt8, 0, 2);
  QuantSegment d{back.data(), ScalarKind::kFloat32, wire.data(), n, 0};
  dequantize_cpu(d, block, QuantKind::kInt8, 0, 2);
  for (int64_t i = 0; i < 32; ++i) EXPECT_EQ(back[i], 0.0f);
  for (int64_t i = 32; i < 64; ++i) EXPECT_TRUE(std::isnan(back[i])) << i;  // a NaN poisons its block
}
