#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "adamw.h"

using namespace zeroshard;

TEST(Convert, HalfKnownValues) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);  // rounds to +inf
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -26)), 0x0000);  // rounds to zero
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::quiet_NaN()) & 0x7E00, 0x7E00);
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie -> even
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // tie -> even (up)
}

TEST(Convert, HalfRoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const bool nan = (h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0;
    if (nan) continue;
    EXPECT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7E00)));
}

TEST(Convert, BFloat16) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);      // tie -> even
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const bool nan = (h & 0x7F80) == 0x7F80 && (h & 0x007F) != 0;
    if (!nan) EXPECT_EQ(f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(h))), h);
  }
}

namespace {
struct State {
  std::vector<float> p, m, v;
  std::vector<uint16_t> out;
};
State random_state(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> d;
  State s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n), std::vector<uint16_t>(n)};
  for (int64_t i = 0; i < n; ++i) {
    s.p[i] = d(rng);
    s.m[i] = 0.1f * d(rng);
    s.v[i] = std::abs(0.01f * d(rng));
  }
  return s;
}
}  // namespace

TEST(AdamWCpu, KernelEqualsScalarMathBitwiseForAnySplit) {
  std::mt19937 rng(7);
  const int64_t n = 1009;  // prime: tails everywhere
  std::normal_distribution<float> d;
  std::vector<uint16_t> g(n);
  for (auto& x : g) x = f32_to_bf16(d(rng));
  AdamWHyper h = make_adamw_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 3);
  h.unscale = 0.5f;  // (a GradScaler's inverse scale)

  State ref = random_state(n, rng);
  State a = ref, b = ref;
  for (int64_t i = 0; i < n; ++i)
    adamw_update(ref.p[i], bf16_to_f32(g[i]) * h.unscale, ref.m[i], ref.v[i], h);

  AdamWShard sa{a.p.data(), g.data(), ScalarKind::kBFloat16, a.m.data(), a.v.data(),
                a.out.data(), ScalarKind::kFloat16, n};
  EXPECT_FALSE(adamw_cpu(sa, h, 0, n));
  AdamWShard sb{b.p.data(), g.data(), ScalarKind::kBFloat16, b.m.data(), b.v.data(), nullptr,
                ScalarKind::kFloat32, n};
  for (int64_t s = 0; s < n; s += 97) adamw_cpu(sb, h, s, std::min(n, s + 97));
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(a.p[i], ref.p[i]) << i;
    ASSERT_EQ(a.m[i], ref.m[i]) << i;
    ASSERT_EQ(a.v[i], ref.v[i]) << i;
    ASSERT_EQ(b.p[i], ref.p[i]) << i;
    ASSERT_EQ(a.out[i], f32_to_f16(a.p[i])) << i;
  }
}

TEST(AdamWCpu, MatchesDoublePrecisionAdamW) {
  std::mt19937 rng(11);
  const int64_t n = 257;
  State s = random_state(n, rng);
  std::vector<double> p(s.p.begin(), s.p.end()), m(s.m.begin(), s.m.end()), v(s.v.begin(), s.v.end());
  std::normal_distribution<float> d;
  std::vector<float> g(n);
  const double lr = 1e-2, b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.1;
  for (int step = 1; step <= 50; ++step) {
    for (auto& x : g) x = d(rng);
    const AdamWHyper h = make_adamw_hyper(lr, b1, b2, eps, wd, step);
    AdamWShard sh{s.p.data(), g.data(), ScalarKind::kFloat32, s.m.data(), s.v.data(), nullptr,
                  ScalarKind::kFloat32, n};
    adamw_cpu(sh, h, 0, n);
    for (int64_t i = 0; i < n; ++i) {
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * double(g[i]) * g[i];
      const double denom = std::sqrt(v[i]) / std::sqrt(1 - std::pow(b2, step)) + eps;
      p[i] -= lr / (1 - std::pow(b1, step)) * m[i] / denom;
    }
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(s.p[i], p[i], 1e-5 * (1 + std::abs(p[i]))) << i;
}

TEST(AdamWCpu, FlagsNonFiniteScaledGradients) {
  const int64_t n = 300;
  std::vector<float> p(n, 1), m(n, 0), v(n, 0), g(n, 1);
  AdamWShard s{p.data(), g.data(), ScalarKind::kFloat32, m.data(), v.data(), nullptr,
               ScalarKind::kFloat32, n};
  EXPECT_FALSE(adamw_cpu(s, make_adamw_hyper(1e-3, 0.9, 0.999, 1e-8, 0, 1), 0, n));
  g[277] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(adamw_cpu(s, make_adamw_hyper(1e-3, 0.9, 0.999, 1e-8, 0, 2), 0, n));
  EXPECT_FALSE(adamw_cpu(s, make_adamw_hyper(1e-3, 0.9, 0.999, 1e-8, 0, 3), 0, 277));
  g[277] = 3e38f;  // finite, but overflows once scaled
  AdamWHyper scaled = make_adamw_hyper(1e-3, 0.9, 0.999, 1e-8, 0, 4);
  scaled.unscale = 10.0f;
  EXPECT_TRUE(adamw_cpu(s, scaled, 0, n));
}
