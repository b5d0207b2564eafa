#include "layout.h"

#include <algorithm>
#include <map>
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

// One bucket of whole tensors `members` at `offset` in buffer `buffer`: each
// goes, the largest first, to the bin of the least loaded rank (by `load`,
// every rank's cost so far) among those it fits in without the bin passing
// an even share of the bucket (or its largest tensor); when it fits in none,
// to the emptiest bin. Returns the bucket's numel.
int64_t pack_bucket(Layout& L, int64_t buffer, int64_t offset, int64_t align,
                    const std::vector<int64_t>& members,
                    const std::vector<TensorSpec>& specs, std::vector<int64_t>& load) {
  const int64_t world = L.world_size;
  auto size = [&](int64_t i) { return round_up(specs[i].numel, align); };
  std::vector<int64_t> order(members);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return size(x) != size(y) ? size(x) > size(y) : specs[x].cost > specs[y].cost;
  });
  int64_t total = 0;
  for (int64_t i : members) total += size(i);
  const int64_t target = std::max(round_up((total + world - 1) / world, align), size(order.front()));
  const int64_t bi = static_cast<int64_t>(L.buckets.size());
  L.buckets.push_back(Bucket{buffer, offset, 0, 0, 0, {}});
  L.buffers[buffer].buckets.push_back(bi);
  Bucket& b = L.buckets[bi];
  std::vector<int64_t> fill(world, 0), rank_of(specs.size(), -1), at(specs.size(), 0);
  for (int64_t i : order) {
    int64_t r = -1;
    for (int64_t q = 0; q < world; ++q)
      if (fill[q] + size(i) <= target && (r < 0 || load[q] < load[r])) r = q;
    if (r < 0) r = std::min_element(fill.begin(), fill.end()) - fill.begin();
    rank_of[i] = r;
    at[i] = fill[r];
    fill[r] += size(i);
    load[r] += specs[i].cost;
  }
  b.shard_numel = *std::max_element(fill.begin(), fill.end());
  b.numel = b.shard_numel * world;
  for (int64_t i : members) {  // input order within each bin
    const int64_t f = static_cast<int64_t>(L.fragments.size());
    L.fragments.push_back(Fragment{i, bi, 0, rank_of[i] * b.shard_numel + at[i], specs[i].numel});
    b.fragments.push_back(f);
    b.data_numel += specs[i].numel;
    TensorPlace& place = L.tensors[i];
    place.offset = offset + L.fragments[f].bucket_offset;
    place.fragments.push_back(f);
    place.owner = rank_of[i];
  }
  std::sort(b.fragments.begin(), b.fragments.end(), [&](int64_t x, int64_t y) {
    return L.fragments[x].bucket_offset < L.fragments[y].bucket_offset;
  });
  return b.numel;
}

// Lays out the whole tensors of buffer `ob` ([Note: owner-aligned layout]):
// cut, in order, into as few buckets as bins of `ob.cap / world` (or the
// largest tensor) allow, of about equal size, each packed by pack_bucket.
void place_whole(Layout& L, const OpenBuffer& ob, const std::vector<TensorSpec>& specs,
                 std::vector<int64_t>& load) {
  const int64_t world = L.world_size;
  std::vector<int64_t> nonempty;
  int64_t total = 0, largest = 0;
  for (int64_t i : ob.members) {
    TensorPlace& place = L.tensors[i];
    place.buffer = ob.index;
    place.numel = specs[i].numel;
    if (specs[i].numel == 0) continue;
    nonempty.push_back(i);
    total += round_up(specs[i].numel, ob.align_elems);
    largest = std::max(largest, round_up(specs[i].numel, ob.align_elems));
  }
  const int64_t room = world * std::max(ob.cap / world, largest);  // a bucket's most
  const int64_t count = (total + room - 1) / room;
  const int64_t even = count > 0 ? (total + count - 1) / count : 0;
  int64_t pos = 0;
  std::vector<int64_t> bucket;
  int64_t acc = 0;
  auto flush = [&]() {
    if (bucket.empty()) return;
    pos += pack_bucket(L, ob.index, pos, ob.align_elems, bucket, specs, load);
    bucket.clear();
    acc = 0;
  };
  for (int64_t i : nonempty) {
    const int64_t n = round_up(specs[i].numel, ob.align_elems);
    if (!bucket.empty() && (acc + n > room || acc + n / 2 > even)) flush();
    bucket.push_back(i);
    acc += n;
  }
  flush();
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
