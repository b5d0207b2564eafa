// Fused AdamW over one flat shard: the shared math, the argument structs and
// the CPU kernel (the CUDA one, over many shards at once, is in adamw_multi.h).
// Torch-free: kernels see plain pointers only.
#pragma once

#include <cstdint>
#include <cmath>
#include <cstring>

#if defined(__CUDACC__)
#define ZS_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// always_inline: the CPU kernel is built once per ISA (target_clones); helpers
// must be inlined into each clone to be vectorised with it.
#define ZS_HD inline __attribute__((always_inline))
#else
#define ZS_HD inline
#endif

namespace zeroshard {

enum class ScalarKind : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Per-call constants, computed on the host in double precision exactly as
// torch.optim.AdamW computes them, then rounded to float once.
struct AdamWHyper {
  float step_size;        // lr / (1 - beta1^step)
  float one_minus_beta1;  // 1 - beta1
  float beta2;
  float one_minus_beta2;  // 1 - beta2
  float eps;
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float decay;       // 1 - lr * weight_decay
  // gradients are multiplied by this before use: 1, or GradScaler's inverse scale (the
  // launcher's `scale` tensor); the gradient itself arrives averaged, as it is
  float unscale;
};

AdamWHyper make_adamw_hyper(double lr, double beta1, double beta2, double eps,
                            double weight_decay, int64_t step);

// One flat shard. `param` is the fp32 master (or the fp32 parameter itself).
struct AdamWShard {
  float* param;
  const void* grad;
  ScalarKind grad_kind;
  float* exp_avg;
  float* exp_avg_sq;
  void* out;            // optional: updated param written in out_kind
  ScalarKind out_kind;  // kBFloat16 or kFloat16 (or kFloat32) when out != null
  int64_t numel;
};

// ---- bit-exact conversions (round to nearest even, as torch's .to()) ----
ZS_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
ZS_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
ZS_HD bool is_finite_f32(float f) { return (f32_bits(f) & 0x7F800000u) != 0x7F800000u; }

// The conversions are written with masks instead of branches or selects so
// the CPU loops that use them vectorise on every ISA (AVX2 included).
ZS_HD uint32_t mask_if(bool c) { return 0u - static_cast<uint32_t>(c); }  // all ones if c
ZS_HD uint32_t blend(uint32_t mask, uint32_t a, uint32_t b) { return (a & mask) | (b & ~mask); }

ZS_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }
ZS_HD uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  // NaN -> canonical quiet NaN, as torch does
  return static_cast<uint16_t>(blend(mask_if((u & 0x7FFFFFFFu) > 0x7F800000u), 0x7FC0u, rounded));
}

// IEEE half <-> float without hardware support (the classic exact
// float-arithmetic formulation; valid for every input including subnormals).
ZS_HD float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t bits = blend(mask_if(two_w < (1u << 27)), f32_bits(denormalized), f32_bits(normalized));
  return f32_from_bits(sign | bits);
}
ZS_HD uint16_t f32_to_f16(float f) {
  float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t exp_bits = shl1_w & 0xFF000000u;
  const uint32_t bias = blend(mask_if(exp_bits < 0x71000000u), 0x71000000u, exp_bits);
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | blend(mask_if(shl1_w > 0xFF000000u), 0x7E00u, nonsign));
}

ZS_HD float load_as_f32(const void* p, ScalarKind k, int64_t i) {
  if (k == ScalarKind::kFloat32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return k == ScalarKind::kBFloat16 ? bf16_to_f32(h) : f16_to_f32(h);
}
ZS_HD void store_from_f32(void* p, ScalarKind k, int64_t i, float v) {
  if (k == ScalarKind::kFloat32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = k == ScalarKind::kBFloat16 ? f32_to_bf16(v) : f32_to_f16(v);
  }
}

// [Note: AdamW math] The one implementation of the update, in the operation
// order of torch.optim.AdamW(foreach=False) so results agree to rounding:
//   p *= 1 - lr*wd;  m = m + (1-b1)*(g-m);  v = v*b2 + (1-b2)*g*g;
//   p = p - step_size * m / (sqrt(v) * (1/sqrt(1-b2^t)) + eps)
// One difference from torch: sqrt(v) is multiplied by the host-computed
// reciprocal of sqrt(1-b2^t) instead of divided by sqrt(1-b2^t) (at most one
// rounding apart). Division and square root share one slow unit on CPUs;
// dropping one of the two divisions makes the CPU kernel measurably faster where
// it is compute-bound (the bf16 path, and shards that fit in cache; the figure:
// benchmarks/history.md).
// `g` already carries the gradient scale.
ZS_HD void adamw_update(float& p, float g, float& m, float& v, const AdamWHyper& h) {
  p = p * h.decay;
  m = m + h.one_minus_beta1 * (g - m);
  v = v * h.beta2 + h.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) * h.inv_bc2_sqrt + h.eps;
  p = p + (-h.step_size) * (m / denom);
}

// CPU kernel over elements [begin, end). Returns true if any scaled gradient
// in the range is non-finite (the update is still applied; callers skip a
// step through `noop` in the launcher). Thread-safe over disjoint ranges.
bool adamw_cpu(const AdamWShard& s, const AdamWHyper& h, int64_t begin, int64_t end);

}  // namespace zeroshard
