#include "comm.h"

#include <ATen/Dispatch.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "checks.h"
#include "comm_handles.h"
#include "gloo_p2p.h"

#ifdef ZEROSHARD_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

// _reduce_scatter_base/_allgather_base exist in every torch we support
// (2.11 ... 2.15); their newer names (*_single) do not exist in 2.11.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace zeroshard {
namespace {

c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& group_name) {
  try {
    return c10d::resolve_process_group(group_name);
  } catch (const std::exception&) {
    value_error("no process group named '", group_name,
                "' is registered; pass a group created with torch.distributed "
                "(init_process_group / new_group) that is still alive");
  }
}

std::string who(const c10d::ProcessGroup& pg, const char* op) {
  return "[rank " + std::to_string(pg.getRank()) + "/" + std::to_string(pg.getSize()) + "] " + op;
}

void check_buffer(const c10d::ProcessGroup& pg, const char* op, const at::Tensor& t,
                  const char* name) {
  const std::string n = who(pg, op) + ": " + name;
  check_contiguous(t, n);
  check_dtype(t, n, {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble});
  if (!t.is_cpu() && !t.is_cuda())
    value_error(n, " is on ", t.device(), "; collectives take CPU (gloo) or CUDA (NCCL) tensors");
}

// Both buffers of a collective: each valid, one device, one dtype.
static void check_alike(const c10d::ProcessGroup& pg, const char* op, const at::Tensor& big,
                        const char* big_name, const at::Tensor& small, const char* small_name) {
  check_buffer(pg, op, big, big_name);
  check_buffer(pg, op, small, small_name);
  const std::string w = who(pg, op) + ": ";
  check_same_device(small, w + small_name, big, big_name);
  if (small.scalar_type() != big.scalar_type())
    value_error(w, small_name, " has dtype ", small.scalar_type(), " but ", big_name,
                " has dtype ", big.scalar_type(), "; both must have one dtype");
}

void check_pair(const c10d::ProcessGroup& pg, const char* op, const at::Tensor& big,
                const char* big_name, const at::Tensor& small, const char* small_name) {
  check_alike(pg, op, big, big_name, small, small_name);
  const std::string w = who(pg, op) + ": ";
  if (big.numel() != small.numel() * pg.getSize())
    value_error(w, big_name, " has ", big.numel(), " elements and ", small_name, " has ",
                small.numel(), "; need ", big_name, ".numel() == world_size (", pg.getSize(),
                ") * ", small_name, ".numel() (pad with zeroshard.compute_layout)");
}

#ifdef ZEROSHARD_WITH_CUDA
// [Note: streams] Every stream zeroshard uses is created here, once per
// (device, role). High priority so communication kernels are scheduled ahead
// of compute kernels queued at the same time.
//  * kReduceScatter: gradient reductions, overlapping the rest of backward.
//  * kAllGather: parameter gathers, overlapping the optimizer step of later
//    buckets and (ZeRO-3) the forward/backward of the previous unit.
//  * kAllReduce: small reductions (norms, flags) that must not queue behind
//    a large bucket on the other two streams.
c10::cuda::CUDAStream comm_stream(StreamRole role, c10::DeviceIndex device) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(static_cast<int>(device), static_cast<int>(role));
  auto it = streams.find(key);
  if (it == streams.end())
    it = streams.emplace(key, c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)).first;
  return it->second;
}
#endif

}  // namespace

// [Note: backend views] The backend never gets a tensor that shares a
// TensorImpl or a StorageImpl with what Python holds. gloo's worker thread can
// drop its reference to a finished work after wait() has returned; if that is
// the last reference to a tensor or storage with a Python object (a storage
// gets one when Python calls untyped_storage(), as FullyShard does), dropping
// it needs the GIL, and at interpreter exit (a script whose last call was a
// step, whose collective just finished) that aborts the process ("terminate
// called without an active exception"). So on CPU the backend gets a
// non-owning tensor over the same memory (from_blob: its own TensorImpl and
// StorageImpl, no Python object, no deleter); the handle keeps the real
// tensors alive until the collective has completed (wait(), or the handle's
// destructor). CUDA tensors (NCCL, which records streams on the caching
// allocator's blocks) get an alias.
at::Tensor backend_view(const at::Tensor& t) {
  if (!t.is_cpu() || t.numel() == 0) return t.alias();
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
}


static void add_works(Works& to, c10::intrusive_ptr<c10d::Work> w) { to.push_back(std::move(w)); }
static void add_works(Works& to, Works ws) {
  for (auto& w : ws) to.push_back(std::move(w));
}

static bool work_completed(const c10::intrusive_ptr<c10d::Work>& w) {
  if (w->isCompleted()) return true;
  // gloo marks its work's future, not the work, when the collective finishes
  try {
    auto fut = w->getFuture();
    return fut && fut->completed();
  } catch (const std::exception&) {
    return false;
  }
}

Handle CommLauncher::cpu(const at::Tensor& result, double divisor, std::vector<at::Tensor> keep_alive, Works works,
                         const at::Tensor& copy_from, std::vector<at::Tensor> addends) {
  auto h = std::make_shared<CommHandle>();
  h->result_ = result;
  h->divisor_ = divisor;
  h->copy_from_ = copy_from;
  h->addends_ = std::move(addends);
  h->works_ = std::move(works);
  h->keep_alive_ = std::move(keep_alive);
  return h;
}

Handle CommLauncher::driven(const at::Tensor& result, double divisor, std::vector<at::Tensor> keep_alive,
                            std::shared_ptr<PieceDriver> driver, std::vector<at::Tensor> addends) {
  Handle h = cpu(result, divisor, std::move(keep_alive), Works{}, at::Tensor(), std::move(addends));
  h->driver_ = std::move(driver);
  return h;
}

// CPU: `issue` may return several works (all waited on).
template <typename Issue>
Handle CommLauncher::run(StreamRole role, const at::Tensor& result, double divisor, std::vector<at::Tensor> keep_alive,
                         Issue&& issue, const at::Tensor& copy_from) {
  if (!result.is_cuda()) {
    Works works;
    add_works(works, issue());
    return cpu(result, divisor, std::move(keep_alive), std::move(works), copy_from);
  }
  auto h = std::make_shared<CommHandle>();
  h->result_ = result;
  h->divisor_ = divisor;
#ifdef ZEROSHARD_WITH_CUDA
  const c10::cuda::CUDAGuard guard(result.device());
  const auto compute = c10::cuda::getCurrentCUDAStream();
  const auto comm = comm_stream(role, result.device().index());
  at::cuda::CUDAEvent ready;
  ready.record(compute);
  ready.block(comm);
  {
    const c10::cuda::CUDAStreamGuard on_comm(comm);
    Works works;
    add_works(works, issue());
    // NCCL's wait() only makes the current (comm) stream wait on NCCL's own
    // stream; the host does not block.
    for (auto& w : works)
      if (w) w->wait();
    if (divisor != 1.0) result.div_(divisor);
  }
  h->done_ = std::make_shared<at::cuda::CUDAEvent>();
  h->done_->record(comm);
  // The caching allocator must not hand these blocks to the compute stream
  // before the comm stream is done with them, even if the caller drops them.
  for (auto& t : keep_alive) t.record_stream(comm);
  h->keep_alive_ = std::move(keep_alive);
#else
  (void)role;
#endif
  return h;
}

bool CommHandle::completed() const {
  if (waited_) return true;
  if (driver_) return driver_->finished();
#ifdef ZEROSHARD_WITH_CUDA
  if (done_) return done_->query();
#endif
  for (const auto& w : works_)
    if (!work_completed(w)) return false;
  return true;
}

static std::atomic<bool> g_abandon_unwaited{false};

void abandon_unwaited() { g_abandon_unwaited = true; }

CommHandle::~CommHandle() {
  // CPU: the backend writes through non-owning views of keep_alive_ (see
  // [Note: backend views]): never free them under a running collective.
  // Once a collective of this process hung or failed, its peers may never
  // complete the others: park them instead of waiting.
  if (g_abandon_unwaited && (!works_.empty() || driver_)) {
    abandon();
    return;
  }
  if (driver_) {
    try {
      driver_->join();
    } catch (...) {  // a failed collective: nothing left to protect
    }
  }
  for (auto& w : works_) {
    try {
      w->wait();
    } catch (...) {  // a failed collective: nothing left to protect
    }
  }
}

void CommHandle::wait() {
  if (waited_) return;
  if (abandoned_)
    throw std::runtime_error("this collective was abandoned after its wait timed out; its result is lost");
#ifdef ZEROSHARD_WITH_CUDA
  if (done_) {
    done_->block(c10::cuda::getCurrentCUDAStream(done_->device_index()));
    waited_ = true;
    keep_alive_.clear();
    return;
  }
#endif
  if (driver_) driver_->join();
  for (auto& w : works_) w->wait();
  finish();
}

bool CommHandle::wait_for(double seconds) {
  if (waited_) return true;
#ifdef ZEROSHARD_WITH_CUDA
  if (done_) {
    wait();
    return true;
  }
#endif
  if (abandoned_) wait();  // raises
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(seconds));
  if (driver_) {
    if (driver_->ended.wait_until(deadline) != std::future_status::ready) {
      abandon();
      return false;
    }
    driver_->join();   // a transport failure raises
  }
  for (auto& w : works_) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      w->wait(std::max(left, std::chrono::milliseconds(1)));
    } catch (...) {
      // A backend reports its own timeout as an error ("Operation timed out!",
      // gloo's "Timed out waiting ... for recv"): one raised at the deadline
      // is ours; one raised before it is the transport failing.
      if (Clock::now() + std::chrono::milliseconds(1) < deadline) throw;
      abandon();
      return false;
    }
  }
  finish();
  return true;
}

void CommHandle::finish() {
  if (copy_from_.defined() && copy_from_.data_ptr() != result_.data_ptr()) result_.copy_(copy_from_);
  for (const auto& a : addends_) result_.add_(a);
  if (divisor_ != 1.0) result_.div_(divisor_);
  waited_ = true;
  keep_alive_.clear();
  copy_from_ = at::Tensor();
  addends_.clear();
  works_.clear();
  driver_.reset();
}

void CommHandle::abandon() {
  // Never freed: the backend may still write these buffers, and waiting on
  // the works again (as the destructor would) could block forever.
  static std::mutex mu;
  static auto* parked = new std::vector<std::shared_ptr<void>>();
  // (a driver's thread is never joined: parked with its buffers, it ends, or the process does)
  auto held = std::make_shared<std::tuple<Works, std::vector<at::Tensor>, at::Tensor, at::Tensor,
                                          std::vector<at::Tensor>, std::shared_ptr<PieceDriver>>>(
      std::move(works_), std::move(keep_alive_), result_, copy_from_, std::move(addends_), std::move(driver_));
  const std::lock_guard<std::mutex> lock(mu);
  parked->push_back(std::move(held));
  works_.clear();
  abandoned_ = true;
}

Handle reduce_scatter(const std::string& group_name, const at::Tensor& input,
                      const at::Tensor& output, bool average, bool input_is_scratch) {
  auto pg = resolve(group_name);
  check_pair(*pg, "reduce_scatter", input, "input", output, "output");
  const double divisor = average ? static_cast<double>(pg->getSize()) : 1.0;
  const int64_t n = output.numel(), rank = pg->getRank();
  if (gloo::applies(*pg, output))  // [Note: gloo algorithms]
    return gloo::reduce_scatter(pg, group_name, input, output, divisor, input_is_scratch);
  if (input.is_cpu() && input_is_scratch) {
    return CommLauncher::run(StreamRole::kReduceScatter, output, divisor, {input, output}, [&] {
      std::vector<at::Tensor> ts{backend_view(input)};
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      return pg->allreduce(ts, opts);
    }, input.narrow(0, rank * n, n));
  }
  return CommLauncher::run(StreamRole::kReduceScatter, output, divisor, {input, output}, [&] {
    at::Tensor in = backend_view(input), out = backend_view(output);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return pg->_reduce_scatter_base(out, in, opts);
  });
}

Handle all_gather(const std::string& group_name, const at::Tensor& input,
                  const at::Tensor& output) {
  auto pg = resolve(group_name);
  check_pair(*pg, "all_gather", output, "output", input, "input");
  const int64_t n = input.numel(), rank = pg->getRank();
  const bool in_place = n > 0 && input.data_ptr() ==
      static_cast<char*>(output.data_ptr()) + rank * n * output.element_size();
  if (in_place && gloo::applies(*pg, output)) return gloo::all_gather_in_place(*pg, input, output);
  return CommLauncher::run(StreamRole::kAllGather, output, 1.0, {input, output}, [&] {
    at::Tensor in = backend_view(input), out = backend_view(output);
    return pg->_allgather_base(out, in);
  });
}

// The chunks of [Note: uneven collectives], checked: `flat` is cut at `bounds`, `mine` is this rank's chunk.
static void check_uneven(const c10d::ProcessGroup& pg, const char* op, const at::Tensor& flat, const char* flat_name,
                         const at::Tensor& mine, const char* mine_name, const std::vector<int64_t>& bounds) {
  check_alike(pg, op, flat, flat_name, mine, mine_name);
  const std::string w = who(pg, op) + ": ";
  const int64_t world = pg.getSize(), rank = pg.getRank();
  if (static_cast<int64_t>(bounds.size()) != world + 1 || bounds.front() != 0 || bounds.back() != flat.numel())
    value_error(w, "bounds must hold world_size + 1 (", world + 1, ") offsets from 0 to ", flat_name, ".numel() (",
                flat.numel(), "), got ", bounds.size(), " ending at ", bounds.empty() ? -1 : bounds.back());
  for (int64_t r = 0; r < world; ++r)
    if (bounds[r] > bounds[r + 1]) value_error(w, "bounds must not decrease; rank ", r, "'s chunk ends before it starts");
  if (mine.numel() != bounds[rank + 1] - bounds[rank])
    value_error(w, mine_name, " has ", mine.numel(), " elements but this rank's chunk has ",
                bounds[rank + 1] - bounds[rank]);
}

// One collective per non-empty chunk of `flat` cut at `bounds` (`op(rank, chunk)`), in one
// NCCL group where the backend is NCCL ([Note: uneven collectives]): torch's list forms
// issue one per rank, empty or not, so their host work grows with the world size.
template <typename Op>
static Works per_chunk(c10d::ProcessGroup& pg, const at::Tensor& flat, const std::vector<int64_t>& bounds, Op&& op) {
  const bool group = flat.is_cuda() && pg.getBackendType() == c10d::ProcessGroup::BackendType::NCCL;
  if (group) pg.startCoalescing(c10::DeviceType::CUDA);
  Works works;
  for (int64_t r = 0; r + 1 < static_cast<int64_t>(bounds.size()); ++r) {
    if (bounds[r + 1] == bounds[r]) continue;
    auto w = op(r, chunk_of(flat, bounds, r));
    if (!group && w) works.push_back(std::move(w));
  }
  if (group) works.push_back(pg.endCoalescing(c10::DeviceType::CUDA));
  return works;
}

Handle reduce_scatter_v(const std::string& group_name, const at::Tensor& input, const at::Tensor& output,
                        const std::vector<int64_t>& bounds, bool average) {
  auto pg = resolve(group_name);
  check_uneven(*pg, "reduce_scatter", input, "input", output, "output", bounds);
  const double divisor = average ? static_cast<double>(pg->getSize()) : 1.0;
  if (gloo::applies(*pg, input)) return gloo::reduce_scatter_v(*pg, input, output, bounds, divisor);
  return CommLauncher::run(StreamRole::kReduceScatter, output, divisor, {input, output}, [&] {
    at::Tensor in = backend_view(input), out = backend_view(output);
    const int64_t rank = pg->getRank();
    if (out.numel() > 0) out.copy_(chunk_of(in, bounds, rank));   // this rank's share, summed in place
    return per_chunk(*pg, in, bounds, [&](int64_t r, const at::Tensor& chunk) {
      std::vector<at::Tensor> ts{r == rank ? out : chunk};
      c10d::ReduceOptions opts;
      opts.rootRank = r;
      opts.reduceOp = c10d::ReduceOp::SUM;
      return pg->reduce(ts, opts);
    });
  });
}

Handle all_gather_v(const std::string& group_name, const at::Tensor& input, const at::Tensor& output,
                    const std::vector<int64_t>& bounds) {
  auto pg = resolve(group_name);
  check_uneven(*pg, "all_gather", output, "output", input, "input", bounds);
  if (gloo::applies(*pg, output)) return gloo::all_gather_v(*pg, input, output, bounds);
  return CommLauncher::run(StreamRole::kAllGather, output, 1.0, {input, output}, [&] {
    at::Tensor out = backend_view(output);
    at::Tensor mine = chunk_of(out, bounds, pg->getRank());
    if (mine.numel() > 0 && mine.data_ptr() != input.data_ptr()) mine.copy_(input);
    return per_chunk(*pg, out, bounds, [&](int64_t r, const at::Tensor& chunk) {
      std::vector<at::Tensor> ts{chunk};
      c10d::BroadcastOptions opts;
      opts.rootRank = r;
      return pg->broadcast(ts, opts);
    });
  });
}

Handle all_reduce(const std::string& group_name, const at::Tensor& tensor, bool average) {
  auto pg = resolve(group_name);
  check_buffer(*pg, "all_reduce", tensor, "tensor");
  const double divisor = average ? static_cast<double>(pg->getSize()) : 1.0;
  return CommLauncher::run(StreamRole::kAllReduce, tensor, divisor, {tensor}, [&] {
    std::vector<at::Tensor> ts{backend_view(tensor)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return pg->allreduce(ts, opts);
  });
}

}  // namespace zeroshard
