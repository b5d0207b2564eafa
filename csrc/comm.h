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
// On gloo the reduce-scatter and the all-gather run as point-to-point
// messages: csrc/gloo_p2p.h ([Note: gloo algorithms]).
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
// (world - 1) chunks of scratch; other backends: one broadcast from (all-
// gather) or reduce to (reduce-scatter) each rank whose chunk is not empty,
// in one NCCL group on NCCL, so the host work grows with the chunks that
// hold something, not with the world size (torch's list forms of allgather /
// reduce_scatter issue one per rank, empty or not). The reduce-scatter's sum
// lands in `output`, which first takes this rank's chunk of `input`;
// `input` is not written.
Handle reduce_scatter_v(const std::string& group_name, const at::Tensor& input, const at::Tensor& output,
                        const std::vector<int64_t>& bounds, bool average);
Handle all_gather_v(const std::string& group_name, const at::Tensor& input, const at::Tensor& output,
                    const std::vector<int64_t>& bounds);
// tensor = sum over ranks of tensor (divided by the world size when `average`).
Handle all_reduce(const std::string& group_name, const at::Tensor& tensor, bool average);

}  // namespace zeroshard
