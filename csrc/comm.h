// Collectives on flat buffers over a torch.distributed process group created
// in Python (NCCL for CUDA tensors, gloo for CPU tensors: one code path).
//
// [Note: collective ordering]
// CUDA: the collective is issued on a dedicated stream for its role (see
// comm_stream) after an event recorded on the caller's current stream, so it
// starts only once its input is ready and overlaps whatever the caller does
// next. CommHandle::wait() makes the caller's *current* stream wait on the
// collective's completion event; it never blocks the host.
// CPU: the work runs in the backend's threads; wait() blocks until it is done
// and finishes the result there (sums a reduce-scatter's received chunks,
// applies the post-division).
// Reductions always use SUM and then divide explicitly when averaging: gloo's
// reduce-scatter ignores the reduce op (pytorch issue 162338).
//
// [Note: gloo algorithms] gloo's own reduce-scatter is an all-reduce plus a
// copy, slower than the all-reduce alone, and its all-gather is slower than
// N broadcasts. So on CPU tensors over gloo both run as point-to-point
// messages, all in flight at once: for a reduce-scatter each rank sends peer
// j the chunk j of its input and receives every peer's chunk of its own,
// summing them in wait(); for an in-place all-gather (input is this rank's
// chunk of output) each rank sends its chunk to every peer and receives
// theirs in place. Each rank then sends (N-1)/N of the buffer, the least any
// algorithm can (an all-reduce sends twice that). Measured with torch 2.15
// on 13.8 MB, 2 ranks on this project's 2-core CI machine: reduce-scatter
// 12.3 ms (summing included) against 16.0 ms for gloo's all-reduce and
// 32.9 ms for its reduce-scatter; all-gather 6.9 ms against 10.1 ms for the
// broadcasts. 3 ranks: 13.3 / 23.0 / 31.3 ms and 11.1 / 11.0 ms.
// A peer's chunk is received into the output itself when the output lies
// outside the input, else into a scratch chunk held until wait(), so a
// reduce-scatter in place takes (N-1)/N of the buffer more while in flight
// (a separate output, N-2 chunks), unless the input is scratch ([Note:
// landing in sent chunks]). Point-to-point works report completion
// only in wait(). CUDA tensors always use NCCL's own reduce-scatter and
// all-gather; other CPU backends their own collectives.
//
// [Note: reduce-scatter in pieces] That scratch is the largest transient a
// ZeRO-3 step on gloo takes (7/8 of the root unit's gradient buffer at 8
// ranks). So a reduce-scatter whose chunk is large enough runs in pieces:
// each rank's chunk is cut into at most 16 pieces of at least 4 MiB, every
// send of every piece is posted at launch, and a thread of the handle posts
// the receives of 2 pieces at a time into as many slots of scratch, sums
// each piece into the output as it lands (on that thread alone) and reposts
// the slot; wait() joins it. The scratch is then 2 pieces from each peer,
// (N-1) x 2 x max(chunk/16, 4 MiB), against (N-1) chunks in place; pieces
// are used only where that is less. Each piece costs the receiver's thread a
// turn on the cores before its slot is reposted, which on oversubscribed
// CPUs delays the peer: 256 KiB pieces made a ZeRO-3 step of a 3.4M GPT 9%
// slower (2 ranks, 2 cores), so pieces are large and only large chunks are
// cut. A piece's messages carry a tag of their own (the group's count of
// such collectives and the piece's index), so receives posted late never
// meet another collective's messages. The thread touches only non-owning
// views ([Note: backend views]); completed() reports its end.
//
// [Note: landing in sent chunks] When the caller marks the input as scratch
// (every reduce-scatter of zeroshard's own: a bucket or a unit's gradient
// buffer, dropped after the reduction) and there are more than two ranks, a
// peer's chunk needs no scratch of its own: once this rank's send of chunk
// j has left (gloo completes a send when the data is written, and writes it
// only after the receiver posted its receive), the input's chunk j is free.
// So at step k = 1 the chunk of rank - 1 lands in the output (outside the
// input) or in one scratch chunk (in place), and a thread of the handle
// waits for the send of step k - 1 before posting step k's receive into the
// chunk that send freed. Every rank's first receive is posted at launch, so
// every rank's first send completes, so every second receive gets posted,
// and so on: no cycle of waits. The scratch is one chunk in place and none
// into a separate output, at any world size, against N-1 (N-2) chunks; the
// receives of steps 2.. wait one send each, a turn of the thread that on
// oversubscribed cores comes late, which the step's benchmarks measured as
// within their noise (benchmarks/RESULTS.md). Its messages carry a tag of
// their own, as a piece's do. Summing stays in wait(), as for whole chunks.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <string>
#include <vector>

#ifdef ZEROSHARD_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#endif

namespace zeroshard {

enum class StreamRole : int { kReduceScatter = 0, kAllGather = 1, kAllReduce = 2 };

struct PieceDriver;

class CommHandle {
 public:
  CommHandle() = default;
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  ~CommHandle();
  // Idempotent. After it returns, the result may be used on the current
  // stream (CUDA) or by the host (CPU).
  void wait();
  // wait() for at most `seconds` (CPU; CUDA never blocks the host, see
  // [Note: collective ordering]). False when the time ran out: the handle is
  // then abandoned (its works and buffers are parked for the process's
  // lifetime, since the backend may still write them; a later wait() raises)
  // and the caller reports the hang. A transport failure raises as in wait().
  bool wait_for(double seconds);
  bool waited() const { return waited_; }
  // Whether the collective has finished (never blocks); a hint for freeing
  // buffers early, wait() stays required. CPU: the backend's works are done
  // (gloo's all-reduce and broadcast report it; its point-to-point messages,
  // which zeroshard's reduce-scatter and in-place all-gather use on gloo, and
  // its native reduce-scatter only in wait(); a reduce-scatter in pieces or
  // landing in sent chunks when its thread has finished). CUDA: the completion event has passed on the
  // device.
  bool completed() const;

 private:
  friend struct CommLauncher;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;  // CPU only: waited on in wait()
  at::Tensor result_;                    // divided by divisor_ after completion
  at::Tensor copy_from_;                 // CPU: copied into result_ after completion
  std::vector<at::Tensor> addends_;      // CPU: then added into result_
  double divisor_ = 1.0;
  std::vector<at::Tensor> keep_alive_;   // inputs/outputs held until wait()
  std::shared_ptr<PieceDriver> driver_;  // CPU, in pieces: the thread that receives and sums them
#ifdef ZEROSHARD_WITH_CUDA
  std::shared_ptr<at::cuda::CUDAEvent> done_;
#endif
  bool waited_ = false;
  bool abandoned_ = false;
  void finish();   // CPU: apply copy/addends/divisor, release buffers
  void abandon();
};

using Handle = std::shared_ptr<CommHandle>;

// From now on a handle dropped without wait() parks its works and buffers
// instead of waiting for them (called once a collective of this process hung
// or failed: its peers may never complete the others).
void abandon_unwaited();

// output (this rank's shard) = sum over ranks of input[rank*n : (rank+1)*n],
// divided by the world size when `average`. input.numel() == world * n.
// `input_is_scratch`: the caller does not need input afterwards, so its
// contents may be overwritten (see [Note: gloo algorithms]).
Handle reduce_scatter(const std::string& group_name, const at::Tensor& input,
                      const at::Tensor& output, bool average, bool input_is_scratch = false);
// Bytes of scratch a reduce-scatter of `chunk_numel` elements of `element_size`
// bytes per rank takes on gloo ([Note: gloo algorithms], [Note: reduce-scatter
// in pieces], [Note: landing in sent chunks]); `in_place`: the output lies
// inside the input; `input_is_scratch` as passed to reduce_scatter. 0 for world < 2.
int64_t reduce_scatter_scratch_bytes(int64_t chunk_numel, int64_t element_size, int64_t world, bool in_place,
                                     bool input_is_scratch = false);
// The smallest piece of a reduce-scatter in pieces (4 MiB; tests make it smaller
// to cut small buffers); returns the previous value.
int64_t set_reduce_scatter_piece_bytes(int64_t bytes);
// output = concat over ranks of input. output.numel() == world * input.numel().
Handle all_gather(const std::string& group_name, const at::Tensor& input,
                  const at::Tensor& output);
// [Note: uneven collectives] The same two collectives over chunks of different
// lengths: rank r's chunk of the flat tensor is [bounds[r], bounds[r + 1])
// (bounds: world + 1 non-decreasing offsets, 0 first, the flat's numel last;
// a chunk may be empty). FullyShard units laid out for whole-tensor
// optimizers use them (each matrix inside its owner's chunk). gloo: point-to-
// point messages, each rank's chunk sent to (or from) each peer once (no
// message for an empty chunk), the peers' contributions received into
// (world - 1) chunks of scratch; other backends: the list forms of
// c10d's allgather / reduce_scatter (NCCL runs uneven ones as grouped
// broadcasts / reduces).
Handle reduce_scatter_v(const std::string& group_name, const at::Tensor& input, const at::Tensor& output,
                        const std::vector<int64_t>& bounds, bool average);
Handle all_gather_v(const std::string& group_name, const at::Tensor& input, const at::Tensor& output,
                    const std::vector<int64_t>& bounds);
// tensor = sum over ranks of tensor (divided by the world size when `average`).
Handle all_reduce(const std::string& group_name, const at::Tensor& tensor, bool average);

}  // namespace zeroshard
