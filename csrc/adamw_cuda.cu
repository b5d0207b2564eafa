// CUDA AdamW: one launch over every shard of a step ([Note: one launch] in
// adamw_multi.h). Each block takes chunks of the packed table in turn and
// runs adamw_chunk on them: 8 elements per thread per pass, so every fp32
// array moves in 16-byte loads/stores and 16-bit grads/outputs in one
// 16-byte access.
#include <cuda_runtime.h>

#include <algorithm>

#include "adamw_multi.h"

namespace zeroshard {
namespace {

constexpr int kThreads = 256;
static_assert(kMultiChunk % (kThreads * kMultiVec) == 0, "a chunk is whole vector passes of one block");

template <Access A>
__global__ void __launch_bounds__(kThreads)
adamw_multi_kernel(AdamWTable t, const float* scale, const int32_t* noop, int32_t* found_inf) {
  if (noop != nullptr && *noop != 0) return;
  const float mult = scale != nullptr ? *scale : 1.0f;
  bool bad = false;
  for (int64_t c = blockIdx.x; c < t.chunks; c += gridDim.x)
    bad |= adamw_chunk<A>(t, c, static_cast<int>(threadIdx.x), kThreads, mult);
  if (bad && found_inf != nullptr) *found_inf = 1;  // benign race: all write 1
}

int multiprocessors() {
  static int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return std::max(1, n);
  }();
  return sms;
}

// Plain accesses and 16 blocks per multiprocessor (about twice as many blocks as
// fit at once): chosen by `python -m benchmarks adamw --launches`, the closest to
// copy bandwidth from large shards of the launches tried (8 and 4 blocks, evict-first
// accesses; the figures: benchmarks/history.md).
AdamWLaunch g_launch{Access::kCached, 16};

}  // namespace

AdamWLaunch adamw_cuda_launch() { return g_launch; }
void set_adamw_cuda_launch(AdamWLaunch launch) { g_launch = launch; }

const char* adamw_cuda_multi(const AdamWTable& t, const float* scale, const int32_t* noop,
                             int32_t* found_inf, void* stream) {
  if (t.chunks == 0) return nullptr;
  const AdamWLaunch launch = g_launch;
  const int64_t grid = static_cast<int64_t>(multiprocessors()) * std::max(1, launch.blocks_per_sm);
  const int blocks = static_cast<int>(std::min<int64_t>(grid, t.chunks));
  const auto s = static_cast<cudaStream_t>(stream);
  if (launch.access == Access::kStreaming)
    adamw_multi_kernel<Access::kStreaming><<<blocks, kThreads, 0, s>>>(t, scale, noop, found_inf);
  else
    adamw_multi_kernel<Access::kCached><<<blocks, kThreads, 0, s>>>(t, scale, noop, found_inf);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace zeroshard
