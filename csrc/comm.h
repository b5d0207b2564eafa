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
// and applies the post-division there (gloo copies reduce-scatter results into
// the output inside wait()).
// Reductions always use SUM and then divide explicitly when averaging: gloo's
// reduce-scatter ignores the reduce op (pytorch issue 162338).
//
// [Note: gloo algorithms] gloo's own reduce-scatter is an all-reduce plus a
// copy, slower than the all-reduce alone (measured with torch 2.15, 13 MB
// over 2 ranks: 17.7 ms against 12.4 ms), and its all-gather is slower than
// one broadcast per rank of that rank's chunk, issued together (9.5 ms
// against 7.3 ms; 17.4 against 10.8 ms over 3 ranks: each rank then sends
// only its own chunk, where an all-reduce sends twice the buffer). So on CPU
// tensors: a reduce-scatter whose input the caller marks as scratch is an
// in-place all-reduce of the input followed by a copy of this rank's chunk,
// and an in-place all-gather (input is this rank's chunk of output) is N
// broadcasts, rank r's chunk from rank r, in flight at once. CUDA tensors
// always use NCCL's own reduce-scatter and all-gather.
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

class CommHandle {
 public:
  CommHandle() = default;
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  ~CommHandle();
  // Idempotent. After it returns, the result may be used on the current
  // stream (CUDA) or by the host (CPU).
  void wait();
  bool waited() const { return waited_; }
  // Whether the collective has finished (never blocks); a hint for freeing
  // buffers early, wait() stays required. CPU: the backend's work is done
  // (gloo's native reduce-scatter reports it only in wait(); its all-reduce,
  // which the scratch and in-place paths use, does). CUDA: the completion
  // event has passed on the device.
  bool completed() const;

 private:
  friend struct CommLauncher;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;  // CPU only: waited on in wait()
  at::Tensor result_;                    // divided by divisor_ after completion
  at::Tensor copy_from_;                 // CPU: copied into result_ after completion
  double divisor_ = 1.0;
  std::vector<at::Tensor> keep_alive_;   // inputs/outputs held until wait()
#ifdef ZEROSHARD_WITH_CUDA
  std::shared_ptr<at::cuda::CUDAEvent> done_;
#endif
  bool waited_ = false;
};

using Handle = std::shared_ptr<CommHandle>;

// output (this rank's shard) = sum over ranks of input[rank*n : (rank+1)*n],
// divided by the world size when `average`. input.numel() == world * n.
// `input_is_scratch`: the caller does not need input afterwards, so its
// contents may be overwritten (see [Note: gloo algorithms]).
Handle reduce_scatter(const std::string& group_name, const at::Tensor& input,
                      const at::Tensor& output, bool average, bool input_is_scratch = false);
// output = concat over ranks of input. output.numel() == world * input.numel().
Handle all_gather(const std::string& group_name, const at::Tensor& input,
                  const at::Tensor& output);
// tensor = sum over ranks of tensor (divided by the world size when `average`).
Handle all_reduce(const std::string& group_name, const at::Tensor& tensor, bool average);

}  // namespace zeroshard
