// zeroshard's point-to-point transport for gloo: the reduce-scatter and the
// all-gather of CPU tensors over gloo groups of more than one rank, as
// messages between each pair of ranks. Only gloo takes this path: CUDA
// tensors go to NCCL's own collectives and other CPU backends to theirs
// (comm.cpp, plainly c10d's). What it buys, on gloo only, and at what cost:
//
// [Note: gloo algorithms] gloo's own reduce-scatter is an all-reduce plus a
// copy, slower than the all-reduce alone, and its all-gather is slower than
// N broadcasts. So on CPU tensors over gloo both run as point-to-point
// messages, all in flight at once: for a reduce-scatter each rank sends peer
// j the chunk j of its input and receives every peer's chunk of its own,
// summing them in wait(); for an in-place all-gather (input is this rank's
// chunk of output) each rank sends its chunk to every peer and receives
// theirs in place. Each rank then sends (N-1)/N of the buffer, the least any
// algorithm can (an all-reduce sends twice that), and measured faster than
// gloo's own all-reduce, reduce-scatter and broadcasts (the first figures:
// benchmarks/history.md; paired in this file's own build: benchmarks/RESULTS.md,
// "The gloo transport, paired", for what each part still buys).
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
// CPUs delays the peer: small pieces made a ZeRO-3 step measurably slower
// (2 ranks on 2 cores; benchmarks/history.md), so pieces are large and only
// large chunks are cut. A piece's messages carry a tag of their own (the group's count of
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
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <vector>

#include "comm.h"

namespace zeroshard {
namespace gloo {

// Whether CPU collectives on `t` over `pg` take this transport: gloo groups of
// more than one rank ([Note: gloo algorithms]).
bool applies(c10d::ProcessGroup& pg, const at::Tensor& t);

// comm.h's reduce_scatter on gloo ([Note: gloo algorithms], [Note: reduce-scatter
// in pieces], [Note: landing in sent chunks]), checked by the caller.
Handle reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& group_name,
                      const at::Tensor& input, const at::Tensor& output, double divisor, bool input_is_scratch);
// comm.h's all_gather on gloo, `input` being this rank's chunk of `output`.
Handle all_gather_in_place(c10d::ProcessGroup& pg, const at::Tensor& input, const at::Tensor& output);
// comm.h's reduce_scatter_v / all_gather_v on gloo ([Note: uneven collectives]).
Handle reduce_scatter_v(c10d::ProcessGroup& pg, const at::Tensor& input, const at::Tensor& output,
                        const std::vector<int64_t>& bounds, double divisor);
Handle all_gather_v(c10d::ProcessGroup& pg, const at::Tensor& input, const at::Tensor& output,
                    const std::vector<int64_t>& bounds);

}  // namespace gloo
}  // namespace zeroshard
