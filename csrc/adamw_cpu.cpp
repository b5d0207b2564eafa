// CPU AdamW: the shared math (adamw.h) in blocks the compiler vectorises.
// Built for several x86 ISAs at once (target_clones: AVX-512, AVX2, baseline)
// and dispatched at load time, so one binary runs everywhere at full width.
#include <algorithm>
#include <cmath>

#include "adamw.h"

namespace zeroshard {

AdamWHyper make_adamw_hyper(double lr, double beta1, double beta2, double eps,
                            double weight_decay, int64_t step) {
  AdamWHyper h;
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  h.step_size = static_cast<float>(lr / bc1);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  h.unscale = 1.0f;
  return h;
}

namespace {

constexpr int64_t kBlock = 1024;  // elements per inner (vectorised) loop

// always_inline: these must be compiled inside each target clone of adamw_cpu.
#define ZS_INLINE inline __attribute__((always_inline))

template <ScalarKind GK, ScalarKind OK, bool HasOut>
ZS_INLINE bool adamw_block(const AdamWShard& s, const AdamWHyper& hyper, int64_t i0, int64_t n) {
  const AdamWHyper h = hyper;  // a local copy: provably not aliased by the stores below
  const void* __restrict grad = s.grad;
  void* __restrict out = s.out;
  float* __restrict p = s.param + i0;
  float* __restrict m = s.exp_avg + i0;
  float* __restrict v = s.exp_avg_sq + i0;
  uint32_t bad = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float g = load_as_f32(grad, GK, i0 + j) * h.unscale;
    bad |= static_cast<uint32_t>((f32_bits(g) & 0x7F800000u) == 0x7F800000u);
    // Through locals, so each array is read once and written once per
    // element: updating p[j] and m[j] in place made the compiler store them
    // mid-update and load them again.
    float pj = p[j], mj = m[j], vj = v[j];
    adamw_update(pj, g, mj, vj, h);
    p[j] = pj;
    m[j] = mj;
    v[j] = vj;
    if constexpr (HasOut) store_from_f32(out, OK, i0 + j, pj);
  }
  return bad != 0;
}

template <ScalarKind GK, ScalarKind OK, bool HasOut>
ZS_INLINE bool adamw_range(const AdamWShard& s, const AdamWHyper& h, int64_t begin, int64_t end) {
  bool bad = false;
  for (int64_t i = begin; i < end; i += kBlock)
    bad |= adamw_block<GK, OK, HasOut>(s, h, i, std::min(kBlock, end - i));
  return bad;
}

template <ScalarKind GK>
ZS_INLINE bool dispatch_out(const AdamWShard& s, const AdamWHyper& h, int64_t b, int64_t e) {
  if (s.out == nullptr) return adamw_range<GK, ScalarKind::kFloat32, false>(s, h, b, e);
  switch (s.out_kind) {
    case ScalarKind::kBFloat16: return adamw_range<GK, ScalarKind::kBFloat16, true>(s, h, b, e);
    case ScalarKind::kFloat16: return adamw_range<GK, ScalarKind::kFloat16, true>(s, h, b, e);
    default: return adamw_range<GK, ScalarKind::kFloat32, true>(s, h, b, e);
  }
}

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
bool adamw_cpu(const AdamWShard& s, const AdamWHyper& h, int64_t begin, int64_t end) {
  switch (s.grad_kind) {
    case ScalarKind::kBFloat16: return dispatch_out<ScalarKind::kBFloat16>(s, h, begin, end);
    case ScalarKind::kFloat16: return dispatch_out<ScalarKind::kFloat16>(s, h, begin, end);
    default: return dispatch_out<ScalarKind::kFloat32>(s, h, begin, end);
  }
}

}  // namespace zeroshard
