// The one-launch CUDA AdamW's table and per-chunk code ([Note: one launch] in
// adamw_multi.h), run on the host lane by lane: every chunk of a table of
// awkward shards (empty, shorter than a vector, one past a chunk, misaligned,
// every dtype pair) must give the CPU kernel's results bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "adamw_multi.h"

using namespace zeroshard;

namespace {

constexpr int kNone = -1;  // no low-precision output

struct Spec {
  int64_t numel;
  ScalarKind grad;
  int out;         // a ScalarKind, or kNone
  bool misalign;   // the gradient starts 4 bytes past a 16-byte boundary
  int32_t hyper;
};

size_t bytes_of(ScalarKind k) { return k == ScalarKind::kFloat32 ? 4 : 2; }

// Storage for one shard: every array 16-byte aligned unless asked otherwise.
struct Shard {
  Spec spec;
  std::vector<unsigned char> p, g, m, v, out;
  static void* at16(std::vector<unsigned char>& b, size_t skew) {
    auto a = reinterpret_cast<uintptr_t>(b.data());
    return reinterpret_cast<void*>(((a + 15) / 16) * 16 + skew);
  }
  Shard(const Spec& s, std::mt19937& rng) : spec(s) {
    const size_t n = static_cast<size_t>(s.numel);
    for (auto* b : {&p, &g, &m, &v, &out}) b->assign(4 * n + 32, 0);
    std::normal_distribution<float> d;
    for (int64_t i = 0; i < s.numel; ++i) {
      param()[i] = d(rng);
      exp_avg()[i] = 0.1f * d(rng);
      exp_avg_sq()[i] = std::abs(0.01f * d(rng));
      store_from_f32(grad(), s.grad, i, d(rng));
    }
  }
  float* param() { return static_cast<float*>(at16(p, 0)); }
  float* exp_avg() { return static_cast<float*>(at16(m, 0)); }
  float* exp_avg_sq() { return static_cast<float*>(at16(v, 0)); }
  void* grad() { return at16(g, spec.misalign ? 4 : 0); }
  void* output() { return spec.out == kNone ? nullptr : at16(out, 0); }
  AdamWShard record() {
    return AdamWShard{param(), grad(), spec.grad, exp_avg(), exp_avg_sq(), output(),
                      spec.out == kNone ? ScalarKind::kFloat32 : static_cast<ScalarKind>(spec.out),
                      spec.numel};
  }
};

const ScalarKind F32 = ScalarKind::kFloat32, BF16 = ScalarKind::kBFloat16, F16 = ScalarKind::kFloat16;
const int OF32 = 0, OBF16 = 1, OF16 = 2;

std::vector<Spec> awkward_specs() {
  return {{0, F32, kNone, false, 0},     {1, BF16, OBF16, false, 1},  {7, F16, OF16, false, 0},
          {8, F32, OF32, false, 2},      {4095, BF16, kNone, false, 1}, {4096, F32, OBF16, true, 0},
          {4097, F16, kNone, false, 2},  {0, BF16, kNone, false, 0},  {10007, BF16, OF16, false, 1},
          {8200, F32, kNone, true, 2},   {12288, BF16, OBF16, false, 0}};
}

// (each with its own unscale, as a GradScaler's scale tensor would set every set's)
std::vector<AdamWHyper> three_sets() {
  std::vector<AdamWHyper> sets = {make_adamw_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 1),
                                  make_adamw_hyper(3e-4, 0.8, 0.99, 1e-6, 0.0, 7),
                                  make_adamw_hyper(1e-2, 0.95, 0.995, 1e-8, 0.1, 1000)};
  sets[1].unscale = 0.5f;
  sets[2].unscale = 2.0f;
  return sets;
}

// Packs `shards` into a host table (8-byte aligned storage).
AdamWTable pack(std::vector<Shard>& shards, const std::vector<AdamWHyper>& sets, std::vector<uint64_t>& storage) {
  std::vector<AdamWShard> recs;
  std::vector<int32_t> which;
  for (Shard& s : shards) {
    recs.push_back(s.record());
    which.push_back(s.spec.hyper);
  }
  const auto n = static_cast<int32_t>(recs.size()), nh = static_cast<int32_t>(sets.size());
  storage.assign(adamw_table_bytes(n, nh) / 8 + 1, 0);
  const int64_t chunks = pack_adamw_table(recs.data(), which.data(), n, sets.data(), nh, storage.data());
  return adamw_table_at(storage.data(), n, chunks);
}

std::vector<Shard> make_shards(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Shard> shards;
  for (const Spec& s : awkward_specs()) shards.emplace_back(s, rng);
  return shards;
}

void expect_same_bytes(std::vector<Shard>& a, std::vector<Shard>& b) {
  for (size_t k = 0; k < a.size(); ++k) {
    const size_t n = static_cast<size_t>(a[k].spec.numel);
    SCOPED_TRACE("shard " + std::to_string(k) + " of " + std::to_string(n) + " elements");
    ASSERT_EQ(0, std::memcmp(a[k].param(), b[k].param(), 4 * n));
    ASSERT_EQ(0, std::memcmp(a[k].exp_avg(), b[k].exp_avg(), 4 * n));
    ASSERT_EQ(0, std::memcmp(a[k].exp_avg_sq(), b[k].exp_avg_sq(), 4 * n));
    if (a[k].spec.out != kNone)
      ASSERT_EQ(0, std::memcmp(a[k].output(), b[k].output(), bytes_of(static_cast<ScalarKind>(a[k].spec.out)) * n));
  }
}

// Every chunk, every lane: what the kernel's blocks do, in any order.
bool run_table(const AdamWTable& t, int lanes, float scale) {
  bool bad = false;
  for (int64_t c = t.chunks - 1; c >= 0; --c)  // backwards: chunks are independent
    for (int lane = 0; lane < lanes; ++lane) bad |= adamw_chunk(t, c, lane, lanes, scale);
  return bad;
}

}  // namespace

TEST(AdamWTable, ChunksSegmentsAndAlignment) {
  std::vector<Shard> shards = make_shards(1);
  std::vector<uint64_t> storage;
  const AdamWTable t = pack(shards, three_sets(), storage);
  int64_t expected = 0;
  for (size_t k = 0; k < shards.size(); ++k) {
    EXPECT_EQ(t.segs[k].first_chunk, expected) << k;
    EXPECT_EQ(t.segs[k].vectorized, shards[k].spec.misalign ? 0 : 1) << k;
    EXPECT_EQ(t.segs[k].hyper, shards[k].spec.hyper) << k;
    const int64_t own = (shards[k].spec.numel + kMultiChunk - 1) / kMultiChunk;
    for (int64_t c = expected; c < expected + own; ++c) EXPECT_EQ(segment_of(t, c), static_cast<int32_t>(k)) << c;
    expected += own;
  }
  EXPECT_EQ(t.chunks, expected);
  EXPECT_EQ(0, std::memcmp(t.hypers, three_sets().data(), 3 * sizeof(AdamWHyper)));
}

TEST(AdamWTable, EveryChunkEqualsTheCpuKernelBitwise) {
  for (int lanes : {256, 3}) {
    for (float scale : {1.0f, 0.5f}) {
      SCOPED_TRACE("lanes " + std::to_string(lanes) + ", scale " + std::to_string(scale));
      std::vector<Shard> multi = make_shards(5), ref = make_shards(5);
      const std::vector<AdamWHyper> sets = three_sets();
      std::vector<uint64_t> storage;
      EXPECT_FALSE(run_table(pack(multi, sets, storage), lanes, scale));
      for (Shard& s : ref) {
        AdamWHyper h = sets[s.spec.hyper];
        h.unscale *= scale;
        EXPECT_FALSE(adamw_cpu(s.record(), h, 0, s.spec.numel));
      }
      expect_same_bytes(multi, ref);
    }
  }
}

TEST(AdamWTable, FlagsANonFiniteGradientInAnyShard) {
  for (size_t k : {1, 6, 9}) {  // a 1-element shard, a chunk's tail, a misaligned shard
    std::vector<Shard> shards = make_shards(9);
    Shard& s = shards[k];
    store_from_f32(s.grad(), s.spec.grad, s.spec.numel - 1, std::numeric_limits<float>::infinity());
    std::vector<uint64_t> storage;
    EXPECT_TRUE(run_table(pack(shards, three_sets(), storage), 256, 1.0f)) << k;
  }
}
