#include "layout.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>

namespace zeroshard {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// Per-buffer cursor while walking the tensors.
struct OpenBuffer {
  int64_t index;        // into Layout::buffers
  int64_t align_elems;  // tensor start alignment, in elements
  int64_t unit;         // world_size * align_elems: bucket size granularity
  int64_t cap;          // bucket capacity in elements (multiple of unit)
  int64_t pos = 0;      // next free element in the buffer
  int64_t bucket = -1;  // open bucket, -1 if none
  bool whole = false;  // its tensors are whole ([Note: owner-aligned layout])
  std::vector<int64_t> members;  // whole: its tensors, placed once all are known
};

// Where the tensors of one bucket of whole tensors go: bins[r] holds rank r's.
struct Bins {
  std::vector<int64_t> rank_of, at;  // per member: its rank, its offset in that bin
  int64_t shard = 0;                 // the fullest bin: the bucket's shard_numel
  int64_t padding = 0;               // elements of the bucket no tensor fills
};

// What both packings below start from: the members' aligned sizes, their order
// (the largest first, the costlier on a tie) and a bin's even share of the
// bucket (at least the largest member).
struct Packing {
  std::vector<int64_t> size, order;
  int64_t total = 0, target = 0;
  Packing(const std::vector<int64_t>& members, const std::vector<TensorSpec>& specs, int64_t align,
          int64_t world)
      : size(members.size()), order(members.size()) {
    for (size_t k = 0; k < members.size(); ++k) total += size[k] = round_up(specs[members[k]].numel, align);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      return size[x] != size[y] ? size[x] > size[y] : specs[members[x]].cost > specs[members[y]].cost;
    });
    target = std::max(round_up((total + world - 1) / world, align), size[order.front()]);
  }
};

enum class Fit { kLeastLoaded, kFirst };

// Packs whole tensors `members` into one bin per rank, the largest first, each
// into a bin it fits in without the bin passing an even share of the bucket (or
// its largest tensor), the emptiest bin when it fits in none:
// * kLeastLoaded: the bin of the least loaded rank (by `load`, every rank's
//   cost so far, which it adds to);
// * kFirst: the first such bin; the bins are then handed out by cost, the
//   costliest to the least loaded rank. Tensors of a few sizes (a GPT block's
//   4d^2, 3d^2 and d^2) fill bins this way that the first leaves ragged.
Bins pack_bins(const std::vector<int64_t>& members, const std::vector<TensorSpec>& specs,
               int64_t align, std::vector<int64_t>& load, Fit fit) {
  const int64_t world = static_cast<int64_t>(load.size());
  const Packing pk(members, specs, align, world);
  Bins bins{std::vector<int64_t>(members.size()), std::vector<int64_t>(members.size()), 0};
  std::vector<int64_t> fill(world, 0), cost(world, 0);
  for (int64_t k : pk.order) {
    int64_t b = -1;
    for (int64_t q = 0; q < world; ++q)
      if (fill[q] + pk.size[k] <= pk.target &&
          (b < 0 || (fit == Fit::kLeastLoaded && load[q] + cost[q] < load[b] + cost[b])))
        b = q;
    if (b < 0) b = std::min_element(fill.begin(), fill.end()) - fill.begin();
    bins.rank_of[k] = b;
    bins.at[k] = fill[b];
    fill[b] += pk.size[k];
    cost[b] += specs[members[k]].cost;
  }
  std::vector<int64_t> rank_of_bin(world);
  std::iota(rank_of_bin.begin(), rank_of_bin.end(), 0);
  if (fit == Fit::kFirst) {
    std::vector<int64_t> by_cost(rank_of_bin), by_load(rank_of_bin);
    std::stable_sort(by_cost.begin(), by_cost.end(), [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
    std::stable_sort(by_load.begin(), by_load.end(), [&](int64_t x, int64_t y) { return load[x] < load[y]; });
    for (int64_t j = 0; j < world; ++j) rank_of_bin[by_cost[j]] = by_load[j];
  }
  for (int64_t b = 0; b < world; ++b) load[rank_of_bin[b]] += cost[b];
  for (auto& r : bins.rank_of) r = rank_of_bin[r];
  bins.shard = *std::max_element(fill.begin(), fill.end());
  bins.padding = bins.shard * world - pk.total;
  return bins;
}

// The better of the two packings: the less padded, the cost-greedy on a tie.
Bins pack_best(const std::vector<int64_t>& members, const std::vector<TensorSpec>& specs,
               int64_t align, std::vector<int64_t>& load) {
  std::vector<int64_t> greedy_load(load), fit_load(load);
  Bins greedy = pack_bins(members, specs, align, greedy_load, Fit::kLeastLoaded);
  Bins fit = pack_bins(members, specs, align, fit_load, Fit::kFirst);
  if (fit.shard < greedy.shard) {
    load = fit_load;
    return fit;
  }
  load = greedy_load;
  return greedy;
}

// Cuts `tensors` (their aligned sizes `sizes`), in order, into about `count`
// runs of about equal size, none over `limit` elements unless one tensor is.
std::vector<std::vector<int64_t>> cut(const std::vector<int64_t>& tensors,
                                      const std::vector<int64_t>& sizes, int64_t count,
                                      int64_t limit) {
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  const int64_t even = (total + count - 1) / count;
  std::vector<std::vector<int64_t>> runs;
  int64_t acc = 0;
  for (size_t k = 0; k < tensors.size(); ++k) {
    if (runs.empty() || (acc > 0 && (acc + sizes[k] > limit || acc + sizes[k] / 2 > even))) {
      runs.emplace_back();
      acc = 0;
    }
    runs.back().push_back(tensors[k]);
    acc += sizes[k];
  }
  return runs;
}

// Lays out the whole tensors of buffer `ob` ([Note: owner-aligned layout]).
void place_whole(Layout& L, const OpenBuffer& ob, const std::vector<TensorSpec>& specs,
                 std::vector<int64_t>& load) {
  const int64_t world = L.world_size;
  std::vector<int64_t> nonempty, sizes;
  int64_t total = 0, largest = 0;
  for (int64_t i : ob.members) {
    TensorPlace& place = L.tensors[i];
    place.buffer = ob.index;
    place.numel = specs[i].numel;
    if (specs[i].numel == 0) continue;
    nonempty.push_back(i);
    sizes.push_back(round_up(specs[i].numel, ob.align_elems));
    total += sizes.back();
    largest = std::max(largest, sizes.back());
  }
  // the cuts tried: from the fewest buckets the limit allows to a few more than the
  // cap alone asks for; the one with the least padding wins (then the nearest to the cap's)
  // and is kept with its packings and the loads they leave
  std::vector<std::vector<int64_t>> best;
  std::vector<Bins> best_bins;
  std::vector<int64_t> best_load(load);
  if (!nonempty.empty()) {
    const int64_t limit = ob.cap + world * largest;
    const int64_t room = world * std::max(ob.cap / world, largest);
    const int64_t fewest = (total + limit - 1) / limit, wanted = (total + room - 1) / room;
    int64_t best_pad = -1, best_off = 0;
    for (int64_t count = fewest; count <= std::min<int64_t>(nonempty.size(), 2 * wanted + 2); ++count) {
      auto runs = cut(nonempty, sizes, count, limit);
      std::vector<int64_t> trial(load);
      std::vector<Bins> packed;
      int64_t pad = 0;
      for (const auto& run : runs) {
        packed.push_back(pack_best(run, specs, ob.align_elems, trial));
        pad += packed.back().padding;
      }
      const int64_t off = std::abs(static_cast<int64_t>(runs.size()) - wanted);
      if (best_pad < 0 || pad < best_pad || (pad == best_pad && off < best_off)) {
        best_pad = pad;
        best_off = off;
        best = std::move(runs);
        best_bins = std::move(packed);
        best_load = std::move(trial);
      }
    }
  }
  load = best_load;
  int64_t pos = 0;
  for (size_t r = 0; r < best.size(); ++r) {
    const std::vector<int64_t>& run = best[r];
    const Bins& bins = best_bins[r];
    const int64_t bi = static_cast<int64_t>(L.buckets.size());
    L.buckets.push_back(Bucket{ob.index, pos, bins.shard * world, bins.shard, 0, {}});
    L.buffers[ob.index].buckets.push_back(bi);
    Bucket& b = L.buckets[bi];
    for (size_t k = 0; k < run.size(); ++k) {
      const int64_t i = run[k], f = static_cast<int64_t>(L.fragments.size());
      L.fragments.push_back(Fragment{i, bi, 0, bins.rank_of[k] * bins.shard + bins.at[k], specs[i].numel});
      b.fragments.push_back(f);
      b.data_numel += specs[i].numel;
      TensorPlace& place = L.tensors[i];
      place.offset = pos + L.fragments[f].bucket_offset;
      place.fragments.push_back(f);
      place.owner = bins.rank_of[k];
    }
    std::sort(b.fragments.begin(), b.fragments.end(), [&](int64_t x, int64_t y) {
      return L.fragments[x].bucket_offset < L.fragments[y].bucket_offset;
    });
    pos += b.numel;
  }
  L.buffers[ob.index].numel = pos;
  for (int64_t i : ob.members)  // empty tensors: no fragment, the least loaded rank
    if (specs[i].numel == 0) {
      TensorPlace& place = L.tensors[i];
      place.offset = pos;
      place.owner = std::min_element(load.begin(), load.end()) - load.begin();
    }
}

}  // namespace

Layout compute_layout(const std::vector<TensorSpec>& tensors,
                      int64_t bucket_cap_bytes, int64_t world_size,
                      int64_t align_bytes) {
  if (world_size < 1)
    fail("world_size must be >= 1, got " + std::to_string(world_size));
  if (bucket_cap_bytes < 1)
    fail("bucket_cap_bytes must be >= 1, got " +
         std::to_string(bucket_cap_bytes));
  if (align_bytes < 1 || (align_bytes & (align_bytes - 1)) != 0)
    fail("align_bytes must be a power of two, got " +
         std::to_string(align_bytes));

  Layout L;
  L.world_size = world_size;
  L.align_bytes = align_bytes;
  L.bucket_cap_bytes = bucket_cap_bytes;
  L.tensors.resize(tensors.size());
  std::map<int64_t, OpenBuffer> open;  // key -> cursor
  std::vector<int64_t> whole_keys;     // in order of first use

  auto open_bucket = [&](OpenBuffer& ob) {
    Bucket b{ob.index, ob.pos, 0, 0, 0, {}};
    ob.bucket = static_cast<int64_t>(L.buckets.size());
    L.buckets.push_back(b);
    L.buffers[ob.index].buckets.push_back(ob.bucket);
  };
  auto bucket_end = [&](const OpenBuffer& ob) {
    return L.buckets[ob.bucket].offset + ob.cap;
  };

  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const std::string who = "tensor " + std::to_string(i);
    if (t.numel < 0) fail(who + " has negative numel " + std::to_string(t.numel));
    if (!(t.itemsize == 1 || t.itemsize == 2 || t.itemsize == 4 || t.itemsize == 8))
      fail(who + " has itemsize " + std::to_string(t.itemsize) +
           "; supported itemsizes are 1, 2, 4 and 8 bytes");
    if (t.itemsize > align_bytes)
      fail(who + " has itemsize " + std::to_string(t.itemsize) +
           " larger than align_bytes " + std::to_string(align_bytes));

    auto it = open.find(t.key);
    if (it == open.end()) {
      OpenBuffer ob;
      ob.index = static_cast<int64_t>(L.buffers.size());
      ob.align_elems = align_bytes / t.itemsize;
      ob.unit = world_size * ob.align_elems;
      ob.cap = std::max<int64_t>(ob.unit, bucket_cap_bytes / t.itemsize / ob.unit * ob.unit);
      ob.whole = t.cost >= 0;
      if (ob.whole) whole_keys.push_back(t.key);
      L.buffers.push_back(Buffer{t.key, t.itemsize, 0, {}, {}});
      it = open.emplace(t.key, ob).first;
    } else if (L.buffers[it->second.index].itemsize != t.itemsize) {
      fail(who + " has itemsize " + std::to_string(t.itemsize) + " but key " +
           std::to_string(t.key) + " already holds tensors of itemsize " +
           std::to_string(L.buffers[it->second.index].itemsize) +
           "; give tensors of different dtypes different keys");
    }
    OpenBuffer& ob = it->second;
    if (ob.whole != (t.cost >= 0))
      fail(who + (t.cost >= 0 ? " is whole" : " is not whole") + " but key " + std::to_string(t.key) +
           " already holds tensors that " + (t.cost >= 0 ? "are not" : "are") +
           "; give whole tensors their own key");
    L.buffers[ob.index].tensors.push_back(static_cast<int64_t>(i));
    if (ob.whole) {
      ob.members.push_back(static_cast<int64_t>(i));
      continue;
    }

    ob.pos = round_up(ob.pos, ob.align_elems);
    TensorPlace& place = L.tensors[i];
    place.buffer = ob.index;
    place.numel = t.numel;
    if (t.numel > 0 && (ob.bucket < 0 || ob.pos >= bucket_end(ob))) open_bucket(ob);
    place.offset = ob.pos;

    int64_t done = 0;
    while (done < t.numel) {
      if (ob.pos >= bucket_end(ob)) open_bucket(ob);
      Bucket& b = L.buckets[ob.bucket];
      const int64_t take = std::min(t.numel - done, bucket_end(ob) - ob.pos);
      const int64_t f = static_cast<int64_t>(L.fragments.size());
      L.fragments.push_back(Fragment{static_cast<int64_t>(i), ob.bucket, done,
                                     ob.pos - b.offset, take});
      b.fragments.push_back(f);
      b.data_numel += take;
      place.fragments.push_back(f);
      ob.pos += take;
      done += take;
    }
  }

  // Close buckets: full ones are exactly `cap`; a buffer's last one is padded
  // up to a multiple of the unit.
  std::vector<int64_t> load(world_size, 0);  // whole tensors' cost per rank, over every buffer
  for (int64_t key : whole_keys) place_whole(L, open.at(key), tensors, load);
  for (auto& [key, ob] : open) {
    if (ob.whole) continue;
    Buffer& buf = L.buffers[ob.index];
    for (int64_t bi : buf.buckets) {
      Bucket& b = L.buckets[bi];
      const bool last = bi == buf.buckets.back();
      b.numel = last ? round_up(ob.pos - b.offset, ob.unit) : ob.cap;
      b.shard_numel = b.numel / world_size;
      buf.numel += b.numel;
    }
  }
  return L;
}

std::vector<ShardPiece> Layout::shard_pieces(int64_t rank) const {
  if (rank < 0 || rank >= world_size)
    throw std::invalid_argument("rank " + std::to_string(rank) +
                                " is outside [0, world_size=" +
                                std::to_string(world_size) + ")");
  std::vector<ShardPiece> out;
  for (size_t bi = 0; bi < buckets.size(); ++bi) {
    const Bucket& b = buckets[bi];
    const int64_t lo = rank * b.shard_numel, hi = lo + b.shard_numel;
    for (int64_t fi : b.fragments) {
      const Fragment& f = fragments[fi];
      const int64_t s = std::max(lo, f.bucket_offset);
      const int64_t e = std::min(hi, f.bucket_offset + f.numel);
      if (s < e)
        out.push_back(ShardPiece{f.tensor, static_cast<int64_t>(bi),
                                 f.tensor_offset + (s - f.bucket_offset), s - lo,
                                 e - s});
    }
  }
  return out;
}

int64_t Layout::padding_numel(int64_t buffer) const {
  int64_t pad = 0;
  for (int64_t bi : buffers.at(buffer).buckets)
    pad += buckets[bi].numel - buckets[bi].data_numel;
  return pad;
}

int64_t Layout::shard_numel(int64_t buffer) const {
  return buffers.at(buffer).numel / world_size;
}

}  // namespace zeroshard
