// Flat-buffer layout: a pure function from tensor sizes to buckets and shards.
//
// [Note: layout rules]
// * Tensors are grouped into flat buffers by `key` (the caller's policy:
//   ShardedOptimizer uses one key per (param group, dtype), so that every
//   buffer holds one dtype and one set of hyperparameters). Buffers are
//   independent; buckets are numbered in the order they are opened while
//   walking the tensors, so bucket 0 holds the first tensors given.
// * Every tensor starts at an element offset aligned to `align_bytes`
//   (16 by default), so a view of it in the flat buffer is vector-aligned.
// * A bucket holds at most `bucket_cap_bytes`, rounded down to a multiple of
//   world_size * align; a tensor that does not fit in the rest of a bucket is
//   SPLIT across buckets (it becomes several fragments). This keeps every
//   communication buffer within the cap whatever the largest tensor is.
// * A bucket's numel is a multiple of world_size * align_elems, so every
//   rank's shard of every bucket has the same length and starts 16-byte
//   aligned. Only the last bucket of a buffer has tail padding; alignment
//   gaps between tensors are padding too. Padding is zero and is reported.
// * Rank r's shard of bucket b is [b.offset + r * b.shard_numel,
//   b.offset + (r + 1) * b.shard_numel) in buffer coordinates.
//
// [Note: owner-aligned layout]
// A tensor with `cost >= 0` is WHOLE: an optimizer updates it whole, on one
// rank (Muon's Newton-Schulz, Adafactor's factors; python/zeroshard/optim/
// whole.py). It is never split: it lies entirely inside one rank's shard of
// one bucket, and that rank is its `owner`, so the stage's own
// reduce-scatter hands the owner its whole gradient and the parameter
// all-gather carries its update back, with no other collective.
// * A key's tensors are all whole or none is.
// * A key's whole tensors are cut, in input order, into runs of about equal
//   size (a bucket each), none over cap + world_size x the largest tensor;
//   of the numbers of buckets tried (from the fewest that limit allows to
//   about twice what the cap alone asks for), the one whose buckets pack with
//   the least padding wins, then the one nearest the cap's.
// * In each bucket, the largest tensor first, each goes to the bin of the
//   rank with the least update cost so far (over every key; the lower rank
//   on a tie) among those it fits in without passing an even share of the
//   bucket; if none, to the emptiest bin. So the owners' costs stay balanced
//   and, for tensors of even sizes, the bins full. Where first-fit into bins
//   of that share (the costliest bin then to the least loaded rank) leaves
//   less padding, it is used instead.
// * A bucket's shard_numel is its fullest bin (aligned), so a bucket may
//   exceed the cap by about one tensor per bin; its padding is the bins'
//   unused tails. (ShardedOptimizer gives whole tensors of at most the cap
//   only, so its buckets stay within (world_size + 1) x the cap.) A bucket's
//   fragments are listed by offset. Whole buckets are numbered after the
//   others.
#pragma once

#include <cstdint>
#include <vector>

namespace zeroshard {

struct TensorSpec {
  int64_t numel;
  int64_t itemsize;  // bytes per element: 1, 2, 4 or 8
  int64_t key;       // tensors with equal keys share a flat buffer
  int64_t cost = -1;  // >= 0: whole, owned by one rank ([Note: owner-aligned layout])
};

// A contiguous piece of one tensor that lies inside one bucket.
struct Fragment {
  int64_t tensor;         // index into the input list
  int64_t bucket;         // index into Layout::buckets
  int64_t tensor_offset;  // first element of the piece within the tensor
  int64_t bucket_offset;  // first element of the piece within the bucket
  int64_t numel;
};

struct Bucket {
  int64_t buffer;       // index into Layout::buffers
  int64_t offset;       // first element within the buffer
  int64_t numel;        // padded size: world_size * shard_numel
  int64_t shard_numel;  // elements each rank owns
  int64_t data_numel;   // elements that belong to tensors (numel - padding)
  std::vector<int64_t> fragments;  // indices into Layout::fragments, in order
};

struct Buffer {
  int64_t key;
  int64_t itemsize;
  int64_t numel;  // padded total: sum of its buckets
  std::vector<int64_t> buckets;  // indices into Layout::buckets, in order
  std::vector<int64_t> tensors;  // indices of its tensors, in order
};

struct TensorPlace {
  int64_t buffer;
  int64_t offset;  // first element within the buffer
  int64_t numel;
  std::vector<int64_t> fragments;  // indices into Layout::fragments, in order
  int64_t owner = -1;  // whole tensors: the rank whose shard holds all of it; else -1
};

// The part of one tensor that one rank owns in one bucket.
struct ShardPiece {
  int64_t tensor;
  int64_t bucket;
  int64_t tensor_offset;  // first element within the tensor
  int64_t shard_offset;   // first element within this rank's shard of the bucket
  int64_t numel;
};

struct Layout {
  int64_t world_size = 1;
  int64_t align_bytes = 16;
  int64_t bucket_cap_bytes = 0;
  std::vector<Buffer> buffers;
  std::vector<Bucket> buckets;
  std::vector<TensorPlace> tensors;
  std::vector<Fragment> fragments;

  // Elements of bucket `bucket` owned by `rank`, clipped to tensor data.
  std::vector<ShardPiece> shard_pieces(int64_t rank) const;
  // Padding elements in a buffer (inter-tensor gaps and tail).
  int64_t padding_numel(int64_t buffer) const;
  // Elements one rank owns across all buckets of a buffer.
  int64_t shard_numel(int64_t buffer) const;
};

// Throws std::invalid_argument (naming the offending tensor index or
// argument) on bad input: numel < 0, itemsize not in {1,2,4,8} or larger
// than align_bytes, one key used with two itemsizes, world_size < 1,
// bucket_cap_bytes < 1, align_bytes not a power of two, a key with whole and
// split tensors.
Layout compute_layout(const std::vector<TensorSpec>& tensors,
                      int64_t bucket_cap_bytes, int64_t world_size,
                      int64_t align_bytes = 16);

}  // namespace zeroshard
