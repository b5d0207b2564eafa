#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <stdexcept>

#include "layout.h"

using namespace zeroshard;

namespace {

// The buckets' invariants of [Note: layout rules]: aligned, capped, fragments in order.
void check_buckets(const std::vector<TensorSpec>& specs, const Layout& L, int64_t cap_bytes) {
  for (size_t bi = 0; bi < L.buckets.size(); ++bi) {
    const Bucket& b = L.buckets[bi];
    const Buffer& buf = L.buffers[b.buffer];
    const int64_t align = L.align_bytes / buf.itemsize;
    EXPECT_EQ(b.numel, b.shard_numel * L.world_size);
    EXPECT_EQ(b.shard_numel % align, 0) << "shard of bucket " << bi << " not aligned";
    EXPECT_EQ(b.offset % align, 0);
    // a bucket of whole tensors may exceed the cap by about one (aligned) tensor per bin
    int64_t whole_slack = 0;
    for (int64_t ti : buf.tensors)
      if (specs[ti].cost >= 0) whole_slack = std::max(whole_slack, specs[ti].numel + align);
    EXPECT_LE(b.numel * buf.itemsize,
              std::max<int64_t>(cap_bytes, L.world_size * L.align_bytes) + 2 * L.world_size * whole_slack * buf.itemsize);
    int64_t covered = 0, last_end = 0;
    for (int64_t fi : b.fragments) {
      const Fragment& f = L.fragments[fi];
      EXPECT_EQ(f.bucket, static_cast<int64_t>(bi));
      EXPECT_GE(f.bucket_offset, last_end) << "fragments overlap in bucket " << bi;
      last_end = f.bucket_offset + f.numel;
      covered += f.numel;
    }
    EXPECT_LE(last_end, b.numel);
    EXPECT_EQ(covered, b.data_numel);
  }
}

// Checks every invariant of [Note: layout rules]; returns nothing, fails the test.
void check_invariants(const std::vector<TensorSpec>& specs, const Layout& L, int64_t cap_bytes) {
  ASSERT_EQ(L.tensors.size(), specs.size());
  check_buckets(specs, L, cap_bytes);
  // Every element of every tensor is in exactly one fragment, in order.
  for (size_t ti = 0; ti < specs.size(); ++ti) {
    const TensorPlace& t = L.tensors[ti];
    EXPECT_EQ(t.numel, specs[ti].numel);
    EXPECT_EQ(t.offset % (L.align_bytes / specs[ti].itemsize), 0);
    int64_t next = 0;
    for (int64_t fi : t.fragments) {
      const Fragment& f = L.fragments[fi];
      EXPECT_EQ(f.tensor, static_cast<int64_t>(ti));
      EXPECT_EQ(f.tensor_offset, next);
      // buffer position of the fragment == tensor offset + tensor_offset
      EXPECT_EQ(L.buckets[f.bucket].offset + f.bucket_offset, t.offset + f.tensor_offset);
      next += f.numel;
    }
    EXPECT_EQ(next, specs[ti].numel) << "tensor " << ti << " lost elements";
  }
  // Shards partition the data: per rank pieces, summed over ranks, cover all.
  int64_t total = 0, pieces_total = 0;
  for (const auto& s : specs) total += s.numel;
  for (int64_t r = 0; r < L.world_size; ++r)
    for (const ShardPiece& p : L.shard_pieces(r)) {
      EXPECT_LE(p.shard_offset + p.numel, L.buckets[p.bucket].shard_numel);
      pieces_total += p.numel;
    }
  EXPECT_EQ(pieces_total, total);
  // [Note: owner-aligned layout]: a whole tensor is one piece of its owner's shard
  for (size_t ti = 0; ti < specs.size(); ++ti) {
    const TensorPlace& t = L.tensors[ti];
    if (specs[ti].cost < 0) {
      EXPECT_EQ(t.owner, -1);
      continue;
    }
    ASSERT_GE(t.owner, 0);
    ASSERT_LT(t.owner, L.world_size);
    ASSERT_LE(t.fragments.size(), 1u);
    int64_t held = 0;
    for (int64_t r = 0; r < L.world_size; ++r)
      for (const ShardPiece& p : L.shard_pieces(r))
        if (p.tensor == static_cast<int64_t>(ti)) {
          EXPECT_EQ(r, t.owner) << "whole tensor " << ti << " has a piece on rank " << r;
          EXPECT_EQ(p.numel, specs[ti].numel);
          held += p.numel;
        }
    EXPECT_EQ(held, specs[ti].numel);
  }
}

// Each rank's summed cost of the whole tensors it owns.
std::vector<int64_t> loads(const std::vector<TensorSpec>& specs, const Layout& L) {
  std::vector<int64_t> load(L.world_size, 0);
  for (size_t i = 0; i < specs.size(); ++i)
    if (specs[i].cost >= 0) load[L.tensors[i].owner] += specs[i].cost;
  return load;
}

}  // namespace

TEST(Layout, SingleTensorEvenSplit) {
  const Layout L = compute_layout({{64, 4, 0}}, 1 << 20, 4);
  ASSERT_EQ(L.buckets.size(), 1u);
  EXPECT_EQ(L.buckets[0].numel, 64);
  EXPECT_EQ(L.buckets[0].shard_numel, 16);
  EXPECT_EQ(L.padding_numel(0), 0);
}

TEST(Layout, TailPaddingMakesShardsEqualAndAligned) {
  // 7 fp32 elements over 3 ranks: unit = 3 * 4 elements = 12.
  const Layout L = compute_layout({{7, 4, 0}}, 1 << 20, 3);
  ASSERT_EQ(L.buckets.size(), 1u);
  EXPECT_EQ(L.buckets[0].numel, 12);
  EXPECT_EQ(L.buckets[0].shard_numel, 4);
  EXPECT_EQ(L.padding_numel(0), 5);
  const auto p1 = L.shard_pieces(1);
  ASSERT_EQ(p1.size(), 1u);
  EXPECT_EQ(p1[0].tensor_offset, 4);
  EXPECT_EQ(p1[0].numel, 3);
  EXPECT_TRUE(L.shard_pieces(2).empty());
}

TEST(Layout, TensorsStartAligned) {
  // bf16: 8 elements per 16 bytes. Second tensor starts at 8, not 3.
  const Layout L = compute_layout({{3, 2, 0}, {5, 2, 0}}, 1 << 20, 1);
  EXPECT_EQ(L.tensors[1].offset, 8);
  EXPECT_EQ(L.buckets[0].data_numel, 8);
  EXPECT_EQ(L.buckets[0].numel, 16);
}

TEST(Layout, LargeTensorIsSplitAcrossBuckets) {
  // cap 64 bytes fp32 = 16 elements, world 2 -> unit 8: buckets of 16.
  const Layout L = compute_layout({{40, 4, 0}}, 64, 2);
  ASSERT_EQ(L.buckets.size(), 3u);
  EXPECT_EQ(L.buckets[0].numel, 16);
  EXPECT_EQ(L.buckets[1].numel, 16);
  EXPECT_EQ(L.buckets[2].numel, 8);
  ASSERT_EQ(L.tensors[0].fragments.size(), 3u);
  EXPECT_EQ(L.fragments[L.tensors[0].fragments[2]].tensor_offset, 32);
}

TEST(Layout, KeysMakeSeparateBuffersAndBucketsFollowTensorOrder) {
  const Layout L = compute_layout({{10, 4, 0}, {10, 2, 1}, {10, 4, 0}}, 1 << 20, 2);
  ASSERT_EQ(L.buffers.size(), 2u);
  EXPECT_EQ(L.buffers[0].itemsize, 4);
  EXPECT_EQ(L.buffers[1].itemsize, 2);
  EXPECT_EQ(L.tensors[2].buffer, 0);
  EXPECT_EQ(L.tensors[2].offset, 12);
  EXPECT_EQ(L.buckets[0].buffer, 0);
  EXPECT_EQ(L.buckets[1].buffer, 1);
}

TEST(Layout, EmptyTensorsHaveNoFragments) {
  const Layout L = compute_layout({{0, 4, 0}, {5, 4, 0}, {0, 4, 0}}, 1 << 20, 2);
  EXPECT_TRUE(L.tensors[0].fragments.empty());
  EXPECT_TRUE(L.tensors[2].fragments.empty());
  check_invariants({{0, 4, 0}, {5, 4, 0}, {0, 4, 0}}, L, 1 << 20);
}

TEST(Layout, TinyCapStillMakesProgress) {
  const std::vector<TensorSpec> specs{{100, 4, 0}};
  const Layout L = compute_layout(specs, 1, 3);  // cap below one unit
  EXPECT_EQ(L.buckets[0].numel, 12);
  check_invariants(specs, L, 1);
}

TEST(Layout, WholeTensorsAreNeverSplit) {
  // cap 64 bytes fp32 = 16 elements, world 2: bins of max(8, 40) -> one tensor each
  const std::vector<TensorSpec> specs{{40, 4, 0, 1}, {20, 4, 0, 1}, {7, 4, 0, 1}};
  const Layout L = compute_layout(specs, 64, 2);
  check_invariants(specs, L, 64);
  ASSERT_EQ(L.buckets.size(), 1u);
  EXPECT_EQ(L.buckets[0].shard_numel, 40);
  EXPECT_EQ(L.tensors[0].owner, 0);
  EXPECT_EQ(L.tensors[1].owner, 1);  // the less loaded rank
  EXPECT_EQ(L.tensors[2].owner, 1);  // fits beside it; rank 1 is still the less loaded
  EXPECT_EQ(L.tensors[2].offset, 40 + 20);
}

TEST(Layout, WholeTensorsBalanceCostOverBuffers) {
  // GPT blocks' four matrices (d = 8: 3d^2, d^2, 4d^2, 4d^2; cost numel * d), two param
  // groups, 3 ranks: every rank owns the same cost and the bins are full.
  std::vector<TensorSpec> specs;
  for (int block = 0; block < 6; ++block)
    for (int64_t n : {192, 64, 256, 256}) specs.push_back({n, 4, block % 2, n * 8});
  const Layout L = compute_layout(specs, 1 << 20, 3);
  check_invariants(specs, L, 1 << 20);
  const auto load = loads(specs, L);
  EXPECT_EQ(load[0], load[1]);
  EXPECT_EQ(load[1], load[2]);
  EXPECT_EQ(L.padding_numel(0) + L.padding_numel(1), 0);
}

TEST(Layout, GptMatricesPackWithoutPaddingAtTwoToFourRanks) {
  // the benchmark's GPTs (d 512 x 8 blocks, 832 x 12, 768 x 12) with the default 25 MB
  // cap, in backward order: every bucket's bins full, every rank the same cost
  for (const auto& [d, blocks] : std::vector<std::pair<int64_t, int>>{{512, 8}, {832, 12}, {768, 12}}) {
    std::vector<TensorSpec> specs;
    for (int b = 0; b < blocks; ++b)
      for (int64_t n : {4 * d * d, 4 * d * d, d * d, 3 * d * d}) specs.push_back({n, 4, 0, n * d});
    for (int64_t world = 2; world <= 4; ++world) {
      SCOPED_TRACE("d " + std::to_string(d) + " world " + std::to_string(world));
      const Layout L = compute_layout(specs, 25 << 20, world);
      check_invariants(specs, L, 25 << 20);
      EXPECT_EQ(L.padding_numel(0), 0);
      const auto load = loads(specs, L);
      EXPECT_EQ(*std::min_element(load.begin(), load.end()), *std::max_element(load.begin(), load.end()));
    }
  }
}

TEST(Layout, FirstFitPacksWhatTheCostGreedySpreads) {
  // GPT-2's matrices (d 768 x 12 blocks) over 8 ranks with 100 MB buckets: two buckets of
  // six blocks, which fill 8 bins only as {4,4,1} x 6 and {3,3,3} x 2 (in d^2)
  const int64_t d = 768;
  std::vector<TensorSpec> specs;
  for (int b = 0; b < 12; ++b)
    for (int64_t n : {4 * d * d, 4 * d * d, d * d, 3 * d * d}) specs.push_back({n, 4, 0, n * d});
  const Layout L = compute_layout(specs, 100 << 20, 8);
  check_invariants(specs, L, 100 << 20);
  EXPECT_EQ(L.padding_numel(0), 0);
  const auto load = loads(specs, L);
  EXPECT_EQ(*std::min_element(load.begin(), load.end()), *std::max_element(load.begin(), load.end()));
}

TEST(Layout, WholeAndSplitTensorsNeedTheirOwnKeys) {
  EXPECT_THROW(compute_layout({{4, 4, 0, 1}, {4, 4, 0}}, 64, 2), std::invalid_argument);
  const std::vector<TensorSpec> specs{{0, 4, 0, 0}, {9, 4, 1}, {5, 4, 0, 3}, {0, 4, 0, 0}};
  const Layout L = compute_layout(specs, 64, 2);
  check_invariants(specs, L, 64);
  EXPECT_TRUE(L.tensors[0].fragments.empty());
  EXPECT_GE(L.tensors[3].owner, 0);
}

TEST(Layout, BadInputNamesTheTensor) {
  try {
    compute_layout({{4, 4, 0}, {-1, 4, 0}}, 64, 2);
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(compute_layout({{4, 3, 0}}, 64, 2), std::invalid_argument);
  EXPECT_THROW(compute_layout({{4, 4, 0}, {4, 2, 0}}, 64, 2), std::invalid_argument);
  EXPECT_THROW(compute_layout({{4, 4, 0}}, 64, 0), std::invalid_argument);
  EXPECT_THROW(compute_layout({{4, 4, 0}}, 0, 2), std::invalid_argument);
  EXPECT_THROW(compute_layout({{4, 4, 0}}, 64, 2, 12), std::invalid_argument);
  EXPECT_THROW(compute_layout({{4, 4, 0}}, 64, 2).shard_pieces(2), std::invalid_argument);
}

TEST(Layout, RandomLayoutsKeepAllInvariants) {
  std::mt19937_64 rng(12345);
  for (int trial = 0; trial < 500; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 12);
    std::vector<TensorSpec> specs;
    for (int i = 0; i < n; ++i) {
      const int64_t key = static_cast<int64_t>(rng() % 3);
      const int64_t itemsize = key == 1 ? 2 : 4;  // one itemsize per key
      const int64_t cost = key == 2 ? static_cast<int64_t>(rng() % 1000) : -1;  // key 2: whole
      specs.push_back({static_cast<int64_t>(rng() % 3000), itemsize, key, cost});
    }
    const int64_t world = 1 + static_cast<int64_t>(rng() % 7);
    const int64_t cap = 1 + static_cast<int64_t>(rng() % 8192);
    SCOPED_TRACE("trial " + std::to_string(trial));
    check_invariants(specs, compute_layout(specs, cap, world), cap);
  }
}
