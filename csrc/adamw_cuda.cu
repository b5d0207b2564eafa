// CUDA AdamW: the shared math (adamw.h), 8 elements per thread per
// iteration so every fp32 array moves in 16-byte loads/stores and 16-bit
// grads/outputs move in one 16-byte access. One launch per flat shard.
#include <cuda_runtime.h>

#include <algorithm>

#include "adamw.h"

namespace zeroshard {
namespace {

constexpr int kVec = 8;
constexpr int kThreads = 256;

template <ScalarKind K>
struct Elem { using type = uint16_t; };
template <>
struct Elem<ScalarKind::kFloat32> { using type = float; };

// Load/store kVec elements of kind K at element index i (16-byte aligned).
template <ScalarKind K>
__device__ __forceinline__ void load_vec(const void* base, int64_t i, float (&out)[kVec]) {
  using T = typename Elem<K>::type;
  alignas(16) T tmp[kVec];
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(base) + i);
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(tmp) / 16); ++k) reinterpret_cast<uint4*>(tmp)[k] = src[k];
#pragma unroll
  for (int k = 0; k < kVec; ++k) out[k] = load_as_f32(tmp, K, k);
}
template <ScalarKind K>
__device__ __forceinline__ void store_vec(void* base, int64_t i, const float (&in)[kVec]) {
  using T = typename Elem<K>::type;
  alignas(16) T tmp[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) store_from_f32(tmp, K, k, in[k]);
  uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(base) + i);
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(tmp) / 16); ++k) dst[k] = reinterpret_cast<uint4*>(tmp)[k];
}

template <ScalarKind GK, ScalarKind OK, bool HasOut, bool Vectorized>
__global__ void __launch_bounds__(kThreads)
adamw_kernel(AdamWShard s, AdamWHyper h, const float* scale, const int32_t* noop, int32_t* found_inf) {
  if (noop != nullptr && *noop != 0) return;
  if (scale != nullptr) h.grad_scale *= *scale;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  bool bad = false;
  int64_t tail_begin = 0;
  if constexpr (Vectorized) {
    const int64_t nvec = s.numel / kVec;
    for (int64_t v = tid; v < nvec; v += stride) {
      const int64_t i = v * kVec;
      float p[kVec], g[kVec], m[kVec], q[kVec];
      load_vec<ScalarKind::kFloat32>(s.param, i, p);
      load_vec<GK>(s.grad, i, g);
      load_vec<ScalarKind::kFloat32>(s.exp_avg, i, m);
      load_vec<ScalarKind::kFloat32>(s.exp_avg_sq, i, q);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        g[k] *= h.grad_scale;
        bad |= !is_finite_f32(g[k]);
        adamw_update(p[k], g[k], m[k], q[k], h);
      }
      store_vec<ScalarKind::kFloat32>(s.param, i, p);
      store_vec<ScalarKind::kFloat32>(s.exp_avg, i, m);
      store_vec<ScalarKind::kFloat32>(s.exp_avg_sq, i, q);
      if constexpr (HasOut) store_vec<OK>(s.out, i, p);
    }
    tail_begin = nvec * kVec;
  }
  for (int64_t i = tail_begin + tid; i < s.numel; i += stride) {
    float p = s.param[i], m = s.exp_avg[i], q = s.exp_avg_sq[i];
    const float g = load_as_f32(s.grad, GK, i) * h.grad_scale;
    bad |= !is_finite_f32(g);
    adamw_update(p, g, m, q, h);
    s.param[i] = p;
    s.exp_avg[i] = m;
    s.exp_avg_sq[i] = q;
    if constexpr (HasOut) store_from_f32(s.out, OK, i, p);
  }
  if (bad && found_inf != nullptr) *found_inf = 1;  // benign race: all write 1
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int max_blocks() {
  static int blocks = [] {
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    return std::max(1, sms) * 8;  // enough resident blocks to saturate HBM
  }();
  return blocks;
}

template <ScalarKind GK, ScalarKind OK, bool HasOut>
void launch(const AdamWShard& s, const AdamWHyper& h, const float* scale, const int32_t* noop,
            int32_t* found_inf, cudaStream_t stream) {
  const bool vec = aligned16(s.param) && aligned16(s.grad) && aligned16(s.exp_avg) &&
                   aligned16(s.exp_avg_sq) && aligned16(s.out);
  const int64_t work = vec ? (s.numel / kVec + s.numel % kVec) : s.numel;
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(max_blocks(), (work + kThreads - 1) / kThreads)));
  if (vec)
    adamw_kernel<GK, OK, HasOut, true><<<blocks, kThreads, 0, stream>>>(s, h, scale, noop, found_inf);
  else
    adamw_kernel<GK, OK, HasOut, false><<<blocks, kThreads, 0, stream>>>(s, h, scale, noop, found_inf);
}

template <ScalarKind GK>
void dispatch_out(const AdamWShard& s, const AdamWHyper& h, const float* scale, const int32_t* noop,
                  int32_t* found_inf, cudaStream_t st) {
  if (s.out == nullptr) return launch<GK, ScalarKind::kFloat32, false>(s, h, scale, noop, found_inf, st);
  switch (s.out_kind) {
    case ScalarKind::kBFloat16: return launch<GK, ScalarKind::kBFloat16, true>(s, h, scale, noop, found_inf, st);
    case ScalarKind::kFloat16: return launch<GK, ScalarKind::kFloat16, true>(s, h, scale, noop, found_inf, st);
    default: return launch<GK, ScalarKind::kFloat32, true>(s, h, scale, noop, found_inf, st);
  }
}

}  // namespace

const char* adamw_cuda(const AdamWShard& s, const AdamWHyper& h, const float* scale,
                       const int32_t* noop, int32_t* found_inf, void* stream) {
  if (s.numel == 0) return nullptr;
  auto st = static_cast<cudaStream_t>(stream);
  switch (s.grad_kind) {
    case ScalarKind::kBFloat16: dispatch_out<ScalarKind::kBFloat16>(s, h, scale, noop, found_inf, st); break;
    case ScalarKind::kFloat16: dispatch_out<ScalarKind::kFloat16>(s, h, scale, noop, found_inf, st); break;
    default: dispatch_out<ScalarKind::kFloat32>(s, h, scale, noop, found_inf, st); break;
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace zeroshard
