#include "layout.h"

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
};

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
      L.buffers.push_back(Buffer{t.key, t.itemsize, 0, {}, {}});
      it = open.emplace(t.key, ob).first;
    } else if (L.buffers[it->second.index].itemsize != t.itemsize) {
      fail(who + " has itemsize " + std::to_string(t.itemsize) + " but key " +
           std::to_string(t.key) + " already holds tensors of itemsize " +
           std::to_string(L.buffers[it->second.index].itemsize) +
           "; give tensors of different dtypes different keys");
    }
    OpenBuffer& ob = it->second;
    L.buffers[ob.index].tensors.push_back(static_cast<int64_t>(i));

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
  for (auto& [key, ob] : open) {
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
