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
static at::Tensor backend_view(const at::Tensor& t) {
  if (!t.is_cpu() || t.numel() == 0) return t.alias();
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
}

using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;

// Tags of zeroshard's point-to-point messages: one per collective kind and
// message size, apart from the tags users pick for their own send/recv
// (small numbers). gloo matches a pair's messages of one tag in the order
// they were posted, and every rank issues the collectives in one order, so
// each receive meets its send. Ranks that diverged (one in a checkpoint's
// exchange, the other in a unit's all-gather) then wait for messages that
// never come, which the watchdog reports, instead of receiving a message of
// the wrong size, which gloo answers by terminating the process.
constexpr int kKindReduceScatter = 1;
constexpr int kKindAllGather = 2;
constexpr int kKindReduceScatterPiece = 3;   // tag: the group's count of such collectives, the piece
constexpr int kKindReduceScatterV = 4;       // [Note: uneven collectives]; tag: the flat tensor's size
constexpr int kKindAllGatherV = 5;

// [Note: reduce-scatter in pieces]
static std::atomic<int64_t> g_rs_piece_bytes{4 << 20};   // no piece is smaller (see the Note)
constexpr int64_t kRsPieces = 16;             // at most this many pieces per chunk
constexpr int64_t kRsSlots = 2;               // pieces whose receives are posted at once

// Scratch chunks of a reduce-scatter run whole: one per peer whose chunk cannot
// land in the output; with `input_is_scratch` at most one ([Note: landing in
// sent chunks]).
static int64_t whole_scratch_chunks(int64_t world, bool in_place, bool input_is_scratch) {
  if (world < 2) return 0;
  if (input_is_scratch) return in_place ? 1 : 0;
  return in_place ? world - 1 : world - 2;
}

// Elements per piece of a reduce-scatter whose chunk has n elements: n when it
// runs whole (too small to cut into more pieces than there are slots, or whole
// takes no more scratch).
static int64_t piece_numel(int64_t n, int64_t element_size, int64_t world, bool in_place, bool input_is_scratch) {
  const int64_t m = std::max((n + kRsPieces - 1) / kRsPieces, (g_rs_piece_bytes + element_size - 1) / element_size);
  const bool fewer = kRsSlots * (world - 1) * m < whole_scratch_chunks(world, in_place, input_is_scratch) * n;
  return (n + m - 1) / m > kRsSlots && fewer ? m : n;
}

static int piece_tag(uint32_t seq, int64_t piece) {
  return 0x40000000 | (kKindReduceScatterPiece << 24) | static_cast<int>((seq & 0xFFF) << 12) |
         static_cast<int>(piece & 0xFFF);
}

// Every rank of a group issues its collectives in one order, so this count agrees.
static uint32_t next_piece_seq(const std::string& group_name) {
  static std::mutex mu;
  static std::map<std::string, uint32_t> seq;
  const std::lock_guard<std::mutex> lock(mu);
  return seq[group_name]++;
}

static int message_tag(int kind, const at::Tensor& chunk) {
  const uint64_t h = static_cast<uint64_t>(chunk.nbytes()) * 0x9E3779B97F4A7C15ull;
  return 0x40000000 | (kind << 24) | static_cast<int>((h >> 40) & 0xFFFFFF);
}

// Whether CPU collectives on `t` run as point-to-point messages: gloo groups
// of more than one rank ([Note: gloo algorithms]).
static bool point_to_point(c10d::ProcessGroup& pg, const at::Tensor& t) {
  if (!t.is_cpu() || pg.getSize() < 2 || t.numel() == 0) return false;
  try {
    return pg.getBackend(c10::DeviceType::CPU)->getBackendName() == "gloo";
  } catch (const std::exception&) {
    return false;
  }
}

// N-1 steps, all in flight at once: at step k this rank receives from rank - k
// into `into(from)` and sends `from_here(to)` to rank + k. An empty message is
// not posted (its peer's matching one is empty too: both sizes come from the
// same chunk).
template <typename Into, typename FromHere>
static Works exchange(c10d::ProcessGroup& pg, int tag, Into&& into, FromHere&& from_here) {
  const int64_t world = pg.getSize(), rank = pg.getRank();
  Works works;
  for (int64_t k = 1; k < world; ++k) {
    const int64_t from = (rank - k + world) % world, to = (rank + k) % world;
    std::vector<at::Tensor> in{backend_view(into(from))};
    if (in[0].numel() > 0) works.push_back(pg.recv(in, static_cast<int>(from), tag));
    std::vector<at::Tensor> out{backend_view(from_here(to))};
    if (out[0].numel() > 0) works.push_back(pg.send(out, static_cast<int>(to), tag));
  }
  return works;
}

static bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
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
  // A CPU handle whose work is the driver's thread; `addends` are summed into
  // the result in wait().
  static Handle driven(const at::Tensor& result, double divisor, std::vector<at::Tensor> keep_alive,
                       std::shared_ptr<PieceDriver> driver, std::vector<at::Tensor> addends = {}) {
    auto h = std::make_shared<CommHandle>();
    h->result_ = result;
    h->divisor_ = divisor;
    h->addends_ = std::move(addends);
    h->keep_alive_ = std::move(keep_alive);
    h->driver_ = std::move(driver);
    return h;
  }

  // Issues `issue()` ordered after the caller's current stream (CUDA) and
  // returns the handle that guards its result.
  // CPU: `issue` may instead return several works (all waited on).
  template <typename Issue>
  static Handle run(StreamRole role, const at::Tensor& result, double divisor,
                    std::vector<at::Tensor> keep_alive, Issue&& issue,
                    const at::Tensor& copy_from = at::Tensor(),
                    std::vector<at::Tensor> addends = {}) {
    auto h = std::make_shared<CommHandle>();
    h->result_ = result;
    h->divisor_ = divisor;
    h->copy_from_ = copy_from;
    h->addends_ = std::move(addends);
    if (!result.is_cuda()) {
      add_works(h->works_, issue());
      h->keep_alive_ = std::move(keep_alive);
      return h;
    }
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
    (void)issue;
#endif
    return h;
  }
};

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

int64_t set_reduce_scatter_piece_bytes(int64_t bytes) {
  if (bytes < 1) value_error("the smallest piece of a reduce-scatter must be at least 1 byte, got ", bytes);
  return g_rs_piece_bytes.exchange(bytes);
}

int64_t reduce_scatter_scratch_bytes(int64_t n, int64_t element_size, int64_t world, bool in_place,
                                     bool input_is_scratch) {
  if (world < 2 || n == 0) return 0;
  const int64_t m = piece_numel(n, element_size, world, in_place, input_is_scratch);
  return (m < n ? kRsSlots * (world - 1) * m : whole_scratch_chunks(world, in_place, input_is_scratch) * n) *
         element_size;
}

// dst += src on the calling thread alone: at:: kernels would start an OpenMP team
// for the driver's thread, competing with the compute threads for the cores.
static void add_into(const at::Tensor& dst, const at::Tensor& src) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "add_into", [&] {
    scalar_t* d = dst.data_ptr<scalar_t>();
    const scalar_t* x = src.data_ptr<scalar_t>();
    for (int64_t i = 0, n = dst.numel(); i < n; ++i) d[i] += x[i];
  });
}

// [Note: reduce-scatter in pieces]: sends now, receives and sums in the driver's thread.
static Handle reduce_scatter_in_pieces(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                       const std::string& group_name, const at::Tensor& input,
                                       const at::Tensor& output, double divisor, bool in_place, int64_t m) {
  const int64_t n = output.numel(), world = pg->getSize(), rank = pg->getRank();
  const int64_t pieces = (n + m - 1) / m;
  const uint32_t seq = next_piece_seq(group_name);
  const at::Tensor scratch = at::empty({kRsSlots * (world - 1) * m}, output.options());
  const at::Tensor in = backend_view(input), out = backend_view(output), slots = backend_view(scratch);
  auto length = [=](int64_t p) { return std::min(m, n - p * m); };
  Works sends;
  for (int64_t p = 0; p < pieces; ++p) {
    for (int64_t k = 1; k < world; ++k) {
      const int64_t to = (rank + k) % world;
      std::vector<at::Tensor> t{in.narrow(0, to * n + p * m, length(p))};
      sends.push_back(pg->send(t, static_cast<int>(to), piece_tag(seq, p)));
    }
  }
  auto driver = PieceDriver::start([=, sends = std::move(sends)]() mutable {
    if (!in_place)   // this rank's own contribution
      std::memcpy(out.data_ptr(), in.narrow(0, rank * n, n).data_ptr(), out.nbytes());
    auto landing = [&](int64_t p, int64_t k) {   // peer rank - k's piece p
      return slots.narrow(0, ((p % kRsSlots) * (world - 1) + (k - 1)) * m, length(p));
    };
    auto post = [&](int64_t p) {
      Works recvs;
      for (int64_t k = 1; k < world; ++k) {
        std::vector<at::Tensor> t{landing(p, k)};
        recvs.push_back(pg->recv(t, static_cast<int>((rank - k + world) % world), piece_tag(seq, p)));
      }
      return recvs;
    };
    std::deque<Works> posted;
    for (int64_t p = 0; p < std::min(kRsSlots, pieces); ++p) posted.push_back(post(p));
    for (int64_t p = 0; p < pieces; ++p) {
      for (auto& w : posted.front()) w->wait();
      posted.pop_front();
      at::Tensor o = out.narrow(0, p * m, length(p));
      for (int64_t k = 1; k < world; ++k) add_into(o, landing(p, k));
      if (p + kRsSlots < pieces) posted.push_back(post(p + kRsSlots));
    }
    for (auto& w : sends) w->wait();
  });
  return CommLauncher::driven(output, divisor, {input, output, scratch}, std::move(driver));
}

// [Note: landing in sent chunks]: sends and the first receive now, the other
// receives from the driver's thread as this rank's own sends complete.
static Handle reduce_scatter_into_sent_chunks(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                              const std::string& group_name, const at::Tensor& input,
                                              const at::Tensor& output, double divisor, bool in_place) {
  const int64_t n = output.numel(), world = pg->getSize(), rank = pg->getRank();
  const int tag = piece_tag(next_piece_seq(group_name), 0);
  const at::Tensor in = backend_view(input);
  // (by value: the thread uses them after this function returned)
  auto peer = [=](int64_t k) { return static_cast<int>((rank + k + world) % world); };   // -world < k < world
  auto chunk = [=](const at::Tensor& t, int64_t k) { return t.narrow(0, peer(k) * n, n); };
  // step k's chunk: the peer rank - k's; it lands in the output (outside the
  // input) or in one chunk of scratch at step 1, then in the chunk this rank
  // sent to rank + k - 1 at step k - 1
  std::vector<at::Tensor> keep_alive{input, output}, addends;
  at::Tensor first = output;
  if (in_place) {
    keep_alive.push_back(at::empty({n}, output.options()));
    first = keep_alive.back();
    addends.push_back(first);
  } else {
    addends.push_back(chunk(input, 0));   // this rank's own contribution
  }
  for (int64_t k = 2; k < world; ++k) addends.push_back(chunk(input, k - 1));
  Works sends;
  for (int64_t k = 1; k < world; ++k) {
    std::vector<at::Tensor> t{chunk(in, k)};
    sends.push_back(pg->send(t, peer(k), tag));
  }
  std::vector<at::Tensor> t{backend_view(first)};
  auto first_recv = pg->recv(t, peer(-1), tag);
  auto driver = PieceDriver::start([=, sends = std::move(sends)]() mutable {
    Works recvs{first_recv};
    for (int64_t k = 2; k < world; ++k) {
      sends[k - 2]->wait();   // chunk(in, k - 1) has left: free to land in
      std::vector<at::Tensor> into{chunk(in, k - 1)};
      recvs.push_back(pg->recv(into, peer(-k), tag));
    }
    sends.back()->wait();   // (a work is waited once: gloo counts completions)
    for (auto& w : recvs) w->wait();
  });
  return CommLauncher::driven(output, divisor, std::move(keep_alive), std::move(driver), std::move(addends));
}

Handle reduce_scatter(const std::string& group_name, const at::Tensor& input,
                      const at::Tensor& output, bool average, bool input_is_scratch) {
  auto pg = resolve(group_name);
  check_pair(*pg, "reduce_scatter", input, "input", output, "output");
  const double divisor = average ? static_cast<double>(pg->getSize()) : 1.0;
  const int64_t n = output.numel(), world = pg->getSize(), rank = pg->getRank();
  if (point_to_point(*pg, output)) {  // [Note: gloo algorithms]
    // In pieces where that takes the least scratch, else landing in sent
    // chunks when the input is scratch; else whole: each peer's contribution
    // to this rank's chunk lands in `output` itself when output is not inside
    // input (it is then summed with our own chunk), else in a scratch chunk;
    // both are summed into output in wait().
    const bool in_place = overlaps(output, input);
    const int64_t piece = piece_numel(n, output.element_size(), world, in_place, input_is_scratch);
    if (piece < n) return reduce_scatter_in_pieces(pg, group_name, input, output, divisor, in_place, piece);
    if (input_is_scratch && world > 2)
      return reduce_scatter_into_sent_chunks(pg, group_name, input, output, divisor, in_place);
    const int64_t scratch_chunks = whole_scratch_chunks(world, in_place, false);
    std::vector<at::Tensor> keep_alive{input, output}, landing, addends;
    if (!in_place) {
      landing.push_back(output);
      addends.push_back(input.narrow(0, rank * n, n));
    }
    if (scratch_chunks > 0) {
      keep_alive.push_back(at::empty({scratch_chunks * n}, output.options()));
      for (int64_t k = 0; k < scratch_chunks; ++k) {
        landing.push_back(keep_alive.back().narrow(0, k * n, n));
        addends.push_back(landing.back());
      }
    }
    return CommLauncher::run(StreamRole::kReduceScatter, output, divisor, std::move(keep_alive), [&] {
      // rank - k's chunk (step k) lands in landing[k - 1]
      return exchange(
          *pg, message_tag(kKindReduceScatter, output), [&](int64_t from) { return landing[(rank - from - 1 + world) % world]; },
          [&](int64_t to) { return input.narrow(0, to * n, n); });
    }, at::Tensor(), std::move(addends));
  }
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
  if (in_place && point_to_point(*pg, output)) {  // [Note: gloo algorithms]
    return CommLauncher::run(StreamRole::kAllGather, output, 1.0, {output}, [&] {
      return exchange(*pg, message_tag(kKindAllGather, input), [&](int64_t from) { return output.narrow(0, from * n, n); },
                      [&](int64_t) { return input; });
    });
  }
  return CommLauncher::run(StreamRole::kAllGather, output, 1.0, {input, output}, [&] {
    at::Tensor in = backend_view(input), out = backend_view(output);
    return pg->_allgather_base(out, in);
  });
}

// Rank r's chunk of a flat tensor cut at `bounds` ([Note: uneven collectives]).
static at::Tensor chunk_of(const at::Tensor& t, const std::vector<int64_t>& bounds, int64_t r) {
  return t.narrow(0, bounds[r], bounds[r + 1] - bounds[r]);
}

// Every rank's chunk, in rank order (the list forms of c10d's collectives).
static std::vector<at::Tensor> chunks_of(const at::Tensor& t, const std::vector<int64_t>& bounds) {
  std::vector<at::Tensor> out;
  for (size_t r = 0; r + 1 < bounds.size(); ++r) out.push_back(chunk_of(t, bounds, static_cast<int64_t>(r)));
  return out;
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

Handle reduce_scatter_v(const std::string& group_name, const at::Tensor& input, const at::Tensor& output,
                        const std::vector<int64_t>& bounds, bool average) {
  auto pg = resolve(group_name);
  check_uneven(*pg, "reduce_scatter", input, "input", output, "output", bounds);
  const double divisor = average ? static_cast<double>(pg->getSize()) : 1.0;
  const int64_t world = pg->getSize(), rank = pg->getRank(), n = output.numel();
  if (point_to_point(*pg, input)) {   // each peer's contribution to this chunk lands in scratch
    const bool in_place = n > 0 && overlaps(output, input);
    std::vector<at::Tensor> keep_alive{input, output}, addends;
    keep_alive.push_back(at::empty({(world - 1) * n}, output.options()));
    for (int64_t k = 1; k < world; ++k) addends.push_back(keep_alive.back().narrow(0, (k - 1) * n, n));
    const int tag = message_tag(kKindReduceScatterV, input);
    return CommLauncher::run(StreamRole::kReduceScatter, output, divisor, std::move(keep_alive), [&] {
      // rank - k's contribution (step k) lands in addends[k - 1]
      return exchange(*pg, tag, [&](int64_t from) { return addends[(rank - from - 1 + world) % world]; },
                      [&](int64_t to) { return chunk_of(input, bounds, to); });
    }, in_place ? at::Tensor() : chunk_of(input, bounds, rank), addends);
  }
  return CommLauncher::run(StreamRole::kReduceScatter, output, divisor, {input, output}, [&] {
    std::vector<at::Tensor> outs{backend_view(output)};
    std::vector<std::vector<at::Tensor>> ins{chunks_of(backend_view(input), bounds)};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return pg->reduce_scatter(outs, ins, opts);
  });
}

Handle all_gather_v(const std::string& group_name, const at::Tensor& input, const at::Tensor& output,
                    const std::vector<int64_t>& bounds) {
  auto pg = resolve(group_name);
  check_uneven(*pg, "all_gather", output, "output", input, "input", bounds);
  const int64_t rank = pg->getRank(), n = input.numel();
  if (point_to_point(*pg, output)) {
    const at::Tensor own = chunk_of(output, bounds, rank);
    if (n > 0 && own.data_ptr() != input.data_ptr()) own.copy_(input);
    const int tag = message_tag(kKindAllGatherV, output);
    return CommLauncher::run(StreamRole::kAllGather, output, 1.0, {input, output}, [&] {
      return exchange(*pg, tag, [&](int64_t from) { return chunk_of(output, bounds, from); },
                      [&](int64_t) { return own; });
    });
  }
  return CommLauncher::run(StreamRole::kAllGather, output, 1.0, {input, output}, [&] {
    std::vector<std::vector<at::Tensor>> outs{chunks_of(backend_view(output), bounds)};
    std::vector<at::Tensor> ins{backend_view(input)};
    return pg->allgather(outs, ins);
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
