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
    for (size_t k = 0; k < members.size(); ++k) {
      size[k] = round_up(specs[members[k]].numel, align);
      total += size[k];
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      if (size[x] != size[y]) return size[x] > size[y];
      return specs[members[x]].cost > specs[members[y]].cost;
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
    for (int64_t q = 0; q < world; ++q) {
      if (fill[q] + pk.size[k] > pk.target) continue;  // past the even share
      if (b < 0 || (fit == Fit::kLeastLoaded && load[q] + cost[q] < load[b] + cost[b])) b = q;
    }
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
    std::stable_sort(by_cost.begin(), by_cost.end(),
                     [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
    std::stable_sort(by_load.begin(), by_load.end(),
                     [&](int64_t x, int64_t y) { return load[x] < load[y]; });
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

// A buffer's whole tensors that hold elements, in input order, with their
// aligned sizes.
struct Members {
  std::vector<int64_t> tensors, sizes;
  int64_t total = 0;    // the sum of the sizes
  int64_t largest = 0;  // the largest size
};

// Cuts the members, in order, into about `count` runs of about equal size, none
// over `limit` elements unless one tensor is.
std::vector<std::vector<int64_t>> cut(const Members& m, int64_t count, int64_t limit) {
  const int64_t even = (m.total + count - 1) / count;
  std::vector<std::vector<int64_t>> runs;
  int64_t acc = 0;
  for (size_t k = 0; k < m.tensors.size(); ++k) {
    const int64_t size = m.sizes[k];
    if (runs.empty() || (acc > 0 && (acc + size > limit || acc + size / 2 > even))) {
      runs.emplace_back();
      acc = 0;
    }
    runs.back().push_back(m.tensors[k]);
    acc += size;
  }
  return runs;
}

// One cut of the members into buckets: its runs (a bucket each), their packings,
// the padding these leave and every rank's load after them.
struct Cut {
  std::vector<std::vector<int64_t>> runs;
  std::vector<Bins> bins;
  std::vector<int64_t> load;
  int64_t padding = 0;
};

// Cuts the members into about `count` runs and packs each, starting from the
// ranks' loads `load`.
Cut cut_and_pack(const Members& m, int64_t count, int64_t limit,
                 const std::vector<TensorSpec>& specs, int64_t align,
                 const std::vector<int64_t>& load) {
  Cut c{cut(m, count, limit), {}, load, 0};
  for (const auto& run : c.runs) {
    c.bins.push_back(pack_best(run, specs, align, c.load));
    c.padding += c.bins.back().padding;
  }
  return c;
}

// The cuts tried: from the fewest buckets the limit allows to a few more than the
// cap alone asks for; the one with the least padding wins, then the one nearest
// the cap's number. With no members, no bucket and the loads as they were.
Cut best_cut(const Members& m, const OpenBuffer& ob, const std::vector<TensorSpec>& specs,
             const std::vector<int64_t>& load) {
  Cut best{{}, {}, load, 0};
  if (m.tensors.empty()) return best;
  const int64_t world = static_cast<int64_t>(load.size());
  const int64_t limit = ob.cap + world * m.largest;
  const int64_t room = world * std::max(ob.cap / world, m.largest);
  const int64_t fewest = (m.total + limit - 1) / limit;
  const int64_t wanted = (m.total + room - 1) / room;
  const int64_t most = std::min<int64_t>(m.tensors.size(), 2 * wanted + 2);
  int64_t best_off = 0;
  for (int64_t count = fewest; count <= most; ++count) {
    Cut c = cut_and_pack(m, count, limit, specs, ob.align_elems, load);
    const int64_t off = std::abs(static_cast<int64_t>(c.runs.size()) - wanted);
    const bool better = c.padding < best.padding || (c.padding == best.padding && off < best_off);
    if (count == fewest || better) {
      best = std::move(c);
      best_off = off;
    }
  }
  return best;
}

// Enters each whole tensor of buffer `ob` in it and returns those that hold
// elements.
Members enter_members(Layout& L, const OpenBuffer& ob, const std::vector<TensorSpec>& specs) {
  Members m;
  for (int64_t i : ob.members) {
    TensorPlace& place = L.tensors[i];
    place.buffer = ob.index;
    place.numel = specs[i].numel;
    if (specs[i].numel == 0) continue;
    m.tensors.push_back(i);
    m.sizes.push_back(round_up(specs[i].numel, ob.align_elems));
    m.total += m.sizes.back();
    m.largest = std::max(m.largest, m.sizes.back());
  }
  return m;
}

// Opens a bucket at element `pos` of buffer `ob` for the whole tensors `run`,
// each where `bins` packed it (rank r's bin is the bucket's r-th shard), and
// returns the bucket's numel. Its fragments are listed by offset.
int64_t place_run(Layout& L, const OpenBuffer& ob, int64_t pos, const std::vector<int64_t>& run,
                  const Bins& bins, const std::vector<TensorSpec>& specs) {
  const int64_t bi = static_cast<int64_t>(L.buckets.size());
  L.buckets.push_back(Bucket{ob.index, pos, bins.shard * L.world_size, bins.shard, 0, {}});
  L.buffers[ob.index].buckets.push_back(bi);
  Bucket& b = L.buckets[bi];
  for (size_t k = 0; k < run.size(); ++k) {
    const int64_t i = run[k];
    const int64_t f = static_cast<int64_t>(L.fragments.size());
    const int64_t at = bins.rank_of[k] * bins.shard + bins.at[k];
    L.fragments.push_back(Fragment{i, bi, 0, at, specs[i].numel});
    b.fragments.push_back(f);
    b.data_numel += specs[i].numel;
    TensorPlace& place = L.tensors[i];
    place.offset = pos + at;
    place.fragments.push_back(f);
    place.owner = bins.rank_of[k];
  }
  std::sort(b.fragments.begin(), b.fragments.end(), [&](int64_t x, int64_t y) {
    return L.fragments[x].bucket_offset < L.fragments[y].bucket_offset;
  });
  return b.numel;
}

// Lays out the whole tensors of buffer `ob` ([Note: owner-aligned layout]): the
// best cut's runs a bucket each, then the empty tensors at the buffer's end, on
// the least loaded rank.
void place_whole(Layout& L, const OpenBuffer& ob, const std::vector<TensorSpec>& specs,
                 std::vector<int64_t>& load) {
  const Cut best = best_cut(enter_members(L, ob, specs), ob, specs, load);
  load = best.load;
  int64_t pos = 0;
  for (size_t r = 0; r < best.runs.size(); ++r)
    pos += place_run(L, ob, pos, best.runs[r], best.bins[r], specs);
  L.buffers[ob.index].numel = pos;
  for (int64_t i : ob.members) {
    if (specs[i].numel != 0) continue;
    TensorPlace& place = L.tensors[i];
    place.offset = pos;
    place.owner = std::min_element(load.begin(), load.end()) - load.begin();
  }
}

// The end of the open bucket's capacity (an element of its buffer).
int64_t bucket_end(const Layout& L, const OpenBuffer& ob) {
  return L.buckets[ob.bucket].offset + ob.cap;
}

// Opens a bucket of split tensors at the buffer's next free element.
void open_bucket(Layout& L, OpenBuffer& ob) {
  ob.bucket = static_cast<int64_t>(L.buckets.size());
  L.buckets.push_back(Bucket{ob.index, ob.pos, 0, 0, 0, {}});
  L.buffers[ob.index].buckets.push_back(ob.bucket);
}

// Validate: the arguments every tensor shares.
void check_arguments(int64_t bucket_cap_bytes, int64_t world_size, int64_t align_bytes) {
  if (world_size < 1)
    fail("world_size must be >= 1, got " + std::to_string(world_size));
  if (bucket_cap_bytes < 1)
    fail("bucket_cap_bytes must be >= 1, got " + std::to_string(bucket_cap_bytes));
  if (align_bytes < 1 || (align_bytes & (align_bytes - 1)) != 0)
    fail("align_bytes must be a power of two, got " + std::to_string(align_bytes));
}

// Validate: one tensor on its own (`who` names it).
void check_tensor(const TensorSpec& t, const std::string& who, int64_t align_bytes) {
  if (t.numel < 0)
    fail(who + " has negative numel " + std::to_string(t.numel));
  if (!(t.itemsize == 1 || t.itemsize == 2 || t.itemsize == 4 || t.itemsize == 8))
    fail(who + " has itemsize " + std::to_string(t.itemsize) +
         "; supported itemsizes are 1, 2, 4 and 8 bytes");
  if (t.itemsize > align_bytes)
    fail(who + " has itemsize " + std::to_string(t.itemsize) +
         " larger than align_bytes " + std::to_string(align_bytes));
}

// Open: the buffer of `t`'s key (`open`: key -> cursor), opened on the key's
// first tensor. A tensor must be like those its key already holds: of their
// itemsize, and whole if they are.
OpenBuffer& open_buffer(Layout& L, std::map<int64_t, OpenBuffer>& open, const TensorSpec& t,
                        const std::string& who) {
  const bool whole = t.cost >= 0;
  auto it = open.find(t.key);
  if (it == open.end()) {
    OpenBuffer ob;
    ob.index = static_cast<int64_t>(L.buffers.size());
    ob.align_elems = L.align_bytes / t.itemsize;
    ob.unit = L.world_size * ob.align_elems;
    ob.cap = std::max<int64_t>(ob.unit, L.bucket_cap_bytes / t.itemsize / ob.unit * ob.unit);
    ob.whole = whole;
    L.buffers.push_back(Buffer{t.key, t.itemsize, 0, {}, {}});
    return open.emplace(t.key, ob).first->second;
  }
  OpenBuffer& ob = it->second;
  const int64_t held = L.buffers[ob.index].itemsize;
  if (held != t.itemsize)
    fail(who + " has itemsize " + std::to_string(t.itemsize) + " but key " + std::to_string(t.key) +
         " already holds tensors of itemsize " + std::to_string(held) +
         "; give tensors of different dtypes different keys");
  if (ob.whole != whole)
    fail(who + (whole ? " is whole" : " is not whole") + " but key " + std::to_string(t.key) +
         " already holds tensors that " + (whole ? "are not" : "are") +
         "; give whole tensors their own key");
  return ob;
}

// Place: tensor `i` of a buffer of split tensors at the buffer's next aligned
// element, cut into fragments where it passes a bucket's end.
void place_split(Layout& L, OpenBuffer& ob, const TensorSpec& t, int64_t i) {
  ob.pos = round_up(ob.pos, ob.align_elems);
  TensorPlace& place = L.tensors[i];
  place.buffer = ob.index;
  place.numel = t.numel;
  if (t.numel > 0 && (ob.bucket < 0 || ob.pos >= bucket_end(L, ob))) open_bucket(L, ob);
  place.offset = ob.pos;
  for (int64_t done = 0; done < t.numel;) {
    if (ob.pos >= bucket_end(L, ob)) open_bucket(L, ob);
    Bucket& b = L.buckets[ob.bucket];
    const int64_t take = std::min(t.numel - done, bucket_end(L, ob) - ob.pos);
    const int64_t f = static_cast<int64_t>(L.fragments.size());
    L.fragments.push_back(Fragment{i, ob.bucket, done, ob.pos - b.offset, take});
    b.fragments.push_back(f);
    b.data_numel += take;
    place.fragments.push_back(f);
    ob.pos += take;
    done += take;
  }
}

// Close: a buffer of split tensors has its full buckets exactly `cap` and its
// last padded up to a multiple of the unit.
void close_buckets(Layout& L, const OpenBuffer& ob) {
  Buffer& buf = L.buffers[ob.index];
  for (int64_t bi : buf.buckets) {
    Bucket& b = L.buckets[bi];
    const bool last = bi == buf.buckets.back();
    b.numel = last ? round_up(ob.pos - b.offset, ob.unit) : ob.cap;
    b.shard_numel = b.numel / L.world_size;
    buf.numel += b.numel;
  }
}

// Close: every buffer, in the order they were opened; those of whole tensors are
// laid out now that all their tensors are known, with the ranks' loads carried
// from one to the next.
void close_buffers(Layout& L, const std::map<int64_t, OpenBuffer>& open,
                   const std::vector<TensorSpec>& specs) {
  std::vector<int64_t> load(L.world_size, 0);  // whole tensors' cost per rank, over every buffer
  for (size_t b = 0; b < L.buffers.size(); ++b) {
    const OpenBuffer& ob = open.at(L.buffers[b].key);
    if (ob.whole)
      place_whole(L, ob, specs, load);
    else
      close_buckets(L, ob);
  }
}

}  // namespace

Layout compute_layout(const std::vector<TensorSpec>& tensors,
                      int64_t bucket_cap_bytes, int64_t world_size,
                      int64_t align_bytes) {
  check_arguments(bucket_cap_bytes, world_size, align_bytes);
  Layout L;
  L.world_size = world_size;
  L.align_bytes = align_bytes;
  L.bucket_cap_bytes = bucket_cap_bytes;
  L.tensors.resize(tensors.size());
  std::map<int64_t, OpenBuffer> open;  // key -> cursor
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorSpec& t = tensors[k];
    const int64_t i = static_cast<int64_t>(k);
    const std::string who = "tensor " + std::to_string(k);
    check_tensor(t, who, align_bytes);
    OpenBuffer& ob = open_buffer(L, open, t, who);
    L.buffers[ob.index].tensors.push_back(i);
    if (ob.whole)
      ob.members.push_back(i);  // placed when the buffer closes
    else
      place_split(L, ob, t, i);
  }
  close_buffers(L, open, tensors);
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
