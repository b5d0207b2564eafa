// One launch over many shards: the table the CUDA AdamW kernel reads and the
// per-chunk code each of its blocks runs. Torch-free, host and device.
//
// [Note: one launch] A step updates many flat shards (every bucket's or unit's
// segment, in every param group, each with its own step count and so its own
// bias correction). The CUDA kernel runs once over all of them, as apex's
// multi_tensor_apply and llm.c's AdamW do, instead of once per shard:
// * The host packs one table: a segment record per shard (its pointers,
//   kinds, its hyperparameters' index, its first chunk) followed by the
//   distinct hyperparameter sets. It is copied to the device in one
//   asynchronous copy from pinned memory, so no table size limit applies
//   (kernel arguments would cap it at a few hundred shards).
// * The shards are cut into chunks of kMultiChunk elements, numbered across
//   the table. Block b takes chunks b, b + gridDim, ...; a chunk finds its
//   segment by binary search over the first-chunk column, then runs the
//   same vectorised loop the one-shard kernel ran, for that segment's dtypes.
//   Chunks start at multiples of 8 elements, so a segment whose pointers are
//   16-byte aligned moves in 16-byte accesses in every chunk.
// * adamw_chunk is host-and-device code: the C++ tests run every chunk of a
//   table on the CPU, lane by lane, and compare with the CPU kernel bit for
//   bit, so the indexing is checked on machines without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "adamw.h"

namespace zeroshard {

constexpr int kMultiVec = 8;                 // elements per vector access (16 bytes of 16-bit data)
constexpr int64_t kMultiChunk = 8 * 256 * 2;  // elements per chunk: two vector passes of 256 threads

// One shard in the table (a plain record: copied to the device as bytes).
struct AdamWSegment {
  AdamWShard s;         // pointers, kinds, numel
  int64_t first_chunk;  // chunks of the segments before this one
  int32_t hyper;        // index into the table's hyperparameter sets
  int32_t vectorized;   // 1 if every pointer is 16-byte aligned: 8-element accesses
};

// A packed table seen at one address (host while packing, device in the kernel).
struct AdamWTable {
  const AdamWSegment* segs;
  const AdamWHyper* hypers;
  int32_t n;       // segments
  int64_t chunks;  // total chunks: the kernel's work items
};

// Bytes of a table of n segments and nh hyperparameter sets.
size_t adamw_table_bytes(int32_t n, int32_t nh);
// Packs the table into dst (adamw_table_bytes long, 8-byte aligned); returns
// the total number of chunks. hyper_of[i] in [0, nh) picks shard i's set.
int64_t pack_adamw_table(const AdamWShard* shards, const int32_t* hyper_of, int32_t n,
                         const AdamWHyper* hypers, int32_t nh, void* dst);
// The table packed at `base` (host or device address).
AdamWTable adamw_table_at(const void* base, int32_t n, int64_t chunks);

// ---- per-chunk code (host and device) ----

// How the device kernel's 16-byte accesses treat the caches: kCached as plain
// loads and stores; kStreaming marks them evict-first (ld/st.global.cs: every
// byte of a step is touched once, so none is worth keeping in L2). The host
// ignores it (memcpy either way).
enum class Access : int32_t { kCached = 0, kStreaming = 1 };

// 16 bytes from global memory (src) into registers (dst), or back.
template <Access A = Access::kCached>
ZS_HD void load16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__)
  const uint4* s = reinterpret_cast<const uint4*>(src);
  *reinterpret_cast<uint4*>(dst) = A == Access::kStreaming ? __ldcs(s) : *s;
#else
  std::memcpy(dst, src, 16);
#endif
}
template <Access A = Access::kCached>
ZS_HD void store16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__)
  uint4* d = reinterpret_cast<uint4*>(dst);
  const uint4 v = *reinterpret_cast<const uint4*>(src);
  if constexpr (A == Access::kStreaming) __stcs(d, v); else *d = v;
#else
  std::memcpy(dst, src, 16);
#endif
}

// kMultiVec elements of kind K at element index i (16-byte aligned) as floats, and back.
template <ScalarKind K, Access A = Access::kCached>
ZS_HD void load_vec(const void* base, int64_t i, float (&out)[kMultiVec]) {
  constexpr int kBytes = K == ScalarKind::kFloat32 ? 4 : 2;
  alignas(16) unsigned char tmp[kMultiVec * kBytes];
  const unsigned char* src = static_cast<const unsigned char*>(base) + i * kBytes;
#pragma unroll
  for (int k = 0; k < kMultiVec * kBytes / 16; ++k) load16<A>(tmp + 16 * k, src + 16 * k);
#pragma unroll
  for (int k = 0; k < kMultiVec; ++k) out[k] = load_as_f32(tmp, K, k);
}
template <ScalarKind K, Access A = Access::kCached>
ZS_HD void store_vec(void* base, int64_t i, const float (&in)[kMultiVec]) {
  constexpr int kBytes = K == ScalarKind::kFloat32 ? 4 : 2;
  alignas(16) unsigned char tmp[kMultiVec * kBytes];
#pragma unroll
  for (int k = 0; k < kMultiVec; ++k) store_from_f32(tmp, K, k, in[k]);
  unsigned char* dst = static_cast<unsigned char*>(base) + i * kBytes;
#pragma unroll
  for (int k = 0; k < kMultiVec * kBytes / 16; ++k) store16<A>(dst + 16 * k, tmp + 16 * k);
}

// Elements [begin, end) of one shard, lane `lane` of `lanes` (a block's
// threads): vectors of 8 strided over the lanes, then the tail element-wise.
// Returns true if a scaled gradient this lane read is non-finite.
// Not inlined on the device: each dtype pair gets its own register allocation
// (inlined, the twelve of them shared one and spilled); a call per chunk of
// 4096 elements costs nothing. Arguments by value: in registers, and not
// aliased by the stores through the shard's pointers.
#if defined(__CUDACC__)
#define ZS_HD_CALL __host__ __device__ __noinline__
#else
#define ZS_HD_CALL inline
#endif

template <ScalarKind GK, ScalarKind OK, bool HasOut, Access A = Access::kCached>
ZS_HD_CALL bool adamw_range_lanes(AdamWShard s, AdamWHyper h, bool vectorized, int64_t begin,
                             int64_t end, int lane, int lanes) {
  bool bad = false;
  int64_t tail = begin;
  if (vectorized) {
    const int64_t nvec = (end - begin) / kMultiVec;
    for (int64_t v = lane; v < nvec; v += lanes) {
      const int64_t i = begin + v * kMultiVec;
      float p[kMultiVec], g[kMultiVec], m[kMultiVec], q[kMultiVec];
      load_vec<ScalarKind::kFloat32, A>(s.param, i, p);
      load_vec<GK, A>(s.grad, i, g);
      load_vec<ScalarKind::kFloat32, A>(s.exp_avg, i, m);
      load_vec<ScalarKind::kFloat32, A>(s.exp_avg_sq, i, q);
#pragma unroll
      for (int k = 0; k < kMultiVec; ++k) {
        g[k] *= h.unscale;
        bad |= !is_finite_f32(g[k]);
        adamw_update(p[k], g[k], m[k], q[k], h);
      }
      store_vec<ScalarKind::kFloat32, A>(s.param, i, p);
      store_vec<ScalarKind::kFloat32, A>(s.exp_avg, i, m);
      store_vec<ScalarKind::kFloat32, A>(s.exp_avg_sq, i, q);
      if constexpr (HasOut) store_vec<OK, A>(s.out, i, p);
    }
    tail = begin + nvec * kMultiVec;
  }
  for (int64_t i = tail + lane; i < end; i += lanes) {
    float p = s.param[i], m = s.exp_avg[i], q = s.exp_avg_sq[i];
    const float g = load_as_f32(s.grad, GK, i) * h.unscale;
    bad |= !is_finite_f32(g);
    adamw_update(p, g, m, q, h);
    s.param[i] = p;
    s.exp_avg[i] = m;
    s.exp_avg_sq[i] = q;
    if constexpr (HasOut) store_from_f32(s.out, OK, i, p);
  }
  return bad;
}

// The segment chunk c belongs to: the last one whose first chunk is <= c
// (empty segments own no chunk and are passed over).
ZS_HD int32_t segment_of(const AdamWTable& t, int64_t c) {
  int32_t lo = 0, hi = t.n - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (t.segs[mid].first_chunk <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <ScalarKind GK, Access A>
ZS_HD bool adamw_chunk_out(const AdamWShard& s, const AdamWHyper& h, bool vec, int64_t b, int64_t e,
                           int lane, int lanes) {
  if (s.out == nullptr) return adamw_range_lanes<GK, ScalarKind::kFloat32, false, A>(s, h, vec, b, e, lane, lanes);
  switch (s.out_kind) {
    case ScalarKind::kBFloat16:
      return adamw_range_lanes<GK, ScalarKind::kBFloat16, true, A>(s, h, vec, b, e, lane, lanes);
    case ScalarKind::kFloat16:
      return adamw_range_lanes<GK, ScalarKind::kFloat16, true, A>(s, h, vec, b, e, lane, lanes);
    default:
      return adamw_range_lanes<GK, ScalarKind::kFloat32, true, A>(s, h, vec, b, e, lane, lanes);
  }
}

// Lane `lane` of `lanes` of chunk c. `scale` (1 when there is no scale tensor)
// is every set's unscale. The dtype switch runs once per
// chunk and is uniform over a block.
template <Access A = Access::kCached>
ZS_HD bool adamw_chunk(const AdamWTable& t, int64_t c, int lane, int lanes, float scale) {
  const AdamWSegment& seg = t.segs[segment_of(t, c)];
  AdamWHyper h = t.hypers[seg.hyper];
  h.unscale *= scale;
  const int64_t begin = (c - seg.first_chunk) * kMultiChunk;
  const int64_t end = begin + kMultiChunk < seg.s.numel ? begin + kMultiChunk : seg.s.numel;
  const bool vec = seg.vectorized != 0;
  switch (seg.s.grad_kind) {
    case ScalarKind::kBFloat16:
      return adamw_chunk_out<ScalarKind::kBFloat16, A>(seg.s, h, vec, begin, end, lane, lanes);
    case ScalarKind::kFloat16:
      return adamw_chunk_out<ScalarKind::kFloat16, A>(seg.s, h, vec, begin, end, lane, lanes);
    default:
      return adamw_chunk_out<ScalarKind::kFloat32, A>(seg.s, h, vec, begin, end, lane, lanes);
  }
}

// The CUDA kernel over a table whose pointers are device addresses, one
// launch on `stream` (a cudaStream_t); `scale`, `noop` and `found_inf` as in
// adamw_cuda. Returns an error string, or nullptr. Defined only in CUDA builds.
const char* adamw_cuda_multi(const AdamWTable& device_table, const float* scale, const int32_t* noop,
                             int32_t* found_inf, void* stream);

// The CUDA kernel's launch choices: its accesses' cache policy and how many
// blocks per multiprocessor its grid has. Process-wide; set only by
// `python -m benchmarks adamw`, which measures each (the defaults are what it chose).
struct AdamWLaunch {
  Access access;
  int32_t blocks_per_sm;
};
AdamWLaunch adamw_cuda_launch();
void set_adamw_cuda_launch(AdamWLaunch launch);

}  // namespace zeroshard
