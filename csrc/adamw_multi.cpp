// Packing the one-launch AdamW table (adamw_multi.h, [Note: one launch]).
#include "adamw_multi.h"

#include <cstring>

namespace zeroshard {
namespace {
bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }
}  // namespace

size_t adamw_table_bytes(int32_t n, int32_t nh) {
  return static_cast<size_t>(n) * sizeof(AdamWSegment) + static_cast<size_t>(nh) * sizeof(AdamWHyper);
}

int64_t pack_adamw_table(const AdamWShard* shards, const int32_t* hyper_of, int32_t n,
                         const AdamWHyper* hypers, int32_t nh, void* dst) {
  auto* segs = static_cast<AdamWSegment*>(dst);
  int64_t chunks = 0;
  for (int32_t i = 0; i < n; ++i) {
    const AdamWShard& s = shards[i];
    const bool vec = aligned16(s.param) && aligned16(s.grad) && aligned16(s.exp_avg) &&
                     aligned16(s.exp_avg_sq) && aligned16(s.out);
    segs[i] = AdamWSegment{s, chunks, hyper_of[i], vec ? 1 : 0};
    chunks += (s.numel + kMultiChunk - 1) / kMultiChunk;
  }
  std::memcpy(segs + n, hypers, static_cast<size_t>(nh) * sizeof(AdamWHyper));
  return chunks;
}

AdamWTable adamw_table_at(const void* base, int32_t n, int64_t chunks) {
  const auto* segs = static_cast<const AdamWSegment*>(base);
  return AdamWTable{segs, reinterpret_cast<const AdamWHyper*>(segs + n), n, chunks};
}

}  // namespace zeroshard
