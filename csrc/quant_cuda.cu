// The CUDA kernels of [Note: quantized gathers] (quant.h): one launch over every block of a
// table of chunks (a block of threads per quantization block), the same arithmetic as the CPU.
#include <cuda_runtime.h>

#include <algorithm>

#include "quant.h"

namespace zeroshard {
namespace {

constexpr int kThreads = 256;

__device__ int32_t segment_of(const QuantTable& t, int64_t b) {
  int32_t lo = 0, hi = t.n - 1;  // the last segment whose first block is <= b
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (t.segs[mid].first_block <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads) quantize_kernel(QuantTable t) {
  __shared__ float part[kThreads / 32];
  __shared__ int bad;
  for (int64_t g = blockIdx.x; g < t.blocks; g += gridDim.x) {
    const QuantSegment s = t.segs[segment_of(t, g)];
    const int64_t b = g - s.first_block, lo = b * t.block, hi = min(lo + t.block, s.numel);
    if (threadIdx.x == 0) bad = 0;
    float amax = 0.0f;
    bool nan = false;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      const float a = fabsf(load_as_f32(s.values, s.kind, i));
      nan |= a != a;
      amax = a > amax ? a : amax;
    }
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    __syncthreads();
    if (nan) bad = 1;
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = part[0];
    for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, part[w]);
    const float scale = bad || !is_finite_f32(amax) ? a_nan() : amax / quant_max_code(t.kind);
    float* scales = reinterpret_cast<float*>(s.wire + quant_codes_bytes(s.numel));
    if (threadIdx.x == 0) scales[b] = scale;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads)
      s.wire[i] = quant_encode(load_as_f32(s.values, s.kind, i), scale, t.kind);
    __syncthreads();  // (part and bad are reused by the next block)
  }
}

__global__ void __launch_bounds__(kThreads) dequantize_kernel(QuantTable t) {
  for (int64_t g = blockIdx.x; g < t.blocks; g += gridDim.x) {
    const QuantSegment s = t.segs[segment_of(t, g)];
    const int64_t b = g - s.first_block, lo = b * t.block, hi = min(lo + t.block, s.numel);
    const float scale = reinterpret_cast<const float*>(s.wire + quant_codes_bytes(s.numel))[b];
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads)
      store_from_f32(s.values, s.kind, i, quant_decode(s.wire[i], scale, t.kind));
  }
}

}  // namespace

const char* quant_cuda(const QuantTable& t, bool quantize, void* stream) {
  if (t.blocks == 0) return nullptr;
  const int blocks = static_cast<int>(std::min<int64_t>(t.blocks, 65535));
  const auto s = static_cast<cudaStream_t>(stream);
  if (quantize)
    quantize_kernel<<<blocks, kThreads, 0, s>>>(t);
  else
    dequantize_kernel<<<blocks, kThreads, 0, s>>>(t);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace zeroshard
