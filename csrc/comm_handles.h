// What comm.cpp (c10d's collectives) and gloo_p2p.cpp (the point-to-point
// transport on gloo) share: the thread a handle may own, how a CPU handle is
// made over a collective's works, and the views the backend gets. Internal to
// csrc/: the bindings see comm.h only.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "comm.h"

namespace zeroshard {

using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;

// The thread of a reduce-scatter in pieces or landing in sent chunks ([Note:
// reduce-scatter in pieces], [Note: landing in sent chunks]); `ended` is set
// (or holds what it raised) when it is done.
struct PieceDriver {
  std::thread thread;
  std::promise<void> end;
  std::shared_future<void> ended = end.get_future().share();

  // Runs `body` on a thread of its own; its end (or what it raised) sets `ended`.
  template <typename Body>
  static std::shared_ptr<PieceDriver> start(Body body) {
    auto driver = std::make_shared<PieceDriver>();
    PieceDriver* d = driver.get();   // outlives the thread: joined, or parked with it
    d->thread = std::thread([d, body = std::move(body)]() mutable {
      try {
        body();
        d->end.set_value();
      } catch (...) {
        d->end.set_exception(std::current_exception());
      }
    });
    return driver;
  }

  bool finished() const { return ended.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
  // Joins the thread; rethrows what it raised.
  void join() {
    if (thread.joinable()) thread.join();
    ended.get();
  }
};

struct CommLauncher {
  // A CPU handle over `works`: in wait(), `copy_from` is copied into `result`,
  // `addends` are added to it, and it is divided by `divisor`; `keep_alive` is
  // held until then ([Note: backend views]).
  static Handle cpu(const at::Tensor& result, double divisor, std::vector<at::Tensor> keep_alive, Works works,
                    const at::Tensor& copy_from = at::Tensor(), std::vector<at::Tensor> addends = {});
  // A CPU handle whose work is the driver's thread; `addends` are summed into
  // the result in wait().
  static Handle driven(const at::Tensor& result, double divisor, std::vector<at::Tensor> keep_alive,
                       std::shared_ptr<PieceDriver> driver, std::vector<at::Tensor> addends = {});
  // Issues `issue()` ordered after the caller's current stream (CUDA) and
  // returns the handle that guards its result (defined in comm.cpp, its one user).
  template <typename Issue>
  static Handle run(StreamRole role, const at::Tensor& result, double divisor, std::vector<at::Tensor> keep_alive,
                    Issue&& issue, const at::Tensor& copy_from = at::Tensor());
};

// The tensor the backend is given for `t` ([Note: backend views] in comm.cpp).
at::Tensor backend_view(const at::Tensor& t);

// Rank r's chunk of a flat tensor cut at `bounds` ([Note: uneven collectives]).
inline at::Tensor chunk_of(const at::Tensor& t, const std::vector<int64_t>& bounds, int64_t r) {
  return t.narrow(0, bounds[r], bounds[r + 1] - bounds[r]);
}

}  // namespace zeroshard
