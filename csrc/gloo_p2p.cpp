// zeroshard's point-to-point transport for gloo; see gloo_p2p.h for what it
// buys ([Note: gloo algorithms]).
#include "gloo_p2p.h"

#include <ATen/Dispatch.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include "checks.h"
#include "comm_handles.h"

namespace zeroshard {

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

namespace gloo {

bool applies(c10d::ProcessGroup& pg, const at::Tensor& t) {
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

}  // namespace gloo

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

namespace gloo {

Handle reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& group_name,
                      const at::Tensor& input, const at::Tensor& output, double divisor, bool input_is_scratch) {
  const int64_t n = output.numel(), world = pg->getSize(), rank = pg->getRank();
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
  // rank - k's chunk (step k) lands in landing[k - 1]
  Works works = exchange(
      *pg, message_tag(kKindReduceScatter, output), [&](int64_t from) { return landing[(rank - from - 1 + world) % world]; },
      [&](int64_t to) { return input.narrow(0, to * n, n); });
  return CommLauncher::cpu(output, divisor, std::move(keep_alive), std::move(works), at::Tensor(), std::move(addends));
}

Handle all_gather_in_place(c10d::ProcessGroup& pg, const at::Tensor& input, const at::Tensor& output) {
  const int64_t n = input.numel();
  Works works = exchange(pg, message_tag(kKindAllGather, input), [&](int64_t from) { return output.narrow(0, from * n, n); },
                         [&](int64_t) { return input; });
  return CommLauncher::cpu(output, 1.0, {output}, std::move(works));
}

Handle reduce_scatter_v(c10d::ProcessGroup& pg, const at::Tensor& input, const at::Tensor& output,
                        const std::vector<int64_t>& bounds, double divisor) {
  // each peer's contribution to this chunk lands in scratch
  const int64_t world = pg.getSize(), rank = pg.getRank(), n = output.numel();
  const bool in_place = n > 0 && overlaps(output, input);
  std::vector<at::Tensor> keep_alive{input, output}, addends;
  keep_alive.push_back(at::empty({(world - 1) * n}, output.options()));
  for (int64_t k = 1; k < world; ++k) addends.push_back(keep_alive.back().narrow(0, (k - 1) * n, n));
  // rank - k's contribution (step k) lands in addends[k - 1]
  Works works = exchange(pg, message_tag(kKindReduceScatterV, input),
                         [&](int64_t from) { return addends[(rank - from - 1 + world) % world]; },
                         [&](int64_t to) { return chunk_of(input, bounds, to); });
  return CommLauncher::cpu(output, divisor, std::move(keep_alive), std::move(works),
                           in_place ? at::Tensor() : chunk_of(input, bounds, rank), std::move(addends));
}

Handle all_gather_v(c10d::ProcessGroup& pg, const at::Tensor& input, const at::Tensor& output,
                    const std::vector<int64_t>& bounds) {
  const at::Tensor own = chunk_of(output, bounds, pg.getRank());
  if (input.numel() > 0 && own.data_ptr() != input.data_ptr()) own.copy_(input);
  Works works = exchange(pg, message_tag(kKindAllGatherV, output),
                         [&](int64_t from) { return chunk_of(output, bounds, from); }, [&](int64_t) { return own; });
  return CommLauncher::cpu(output, 1.0, {input, output}, std::move(works));
}

}  // namespace gloo
}  // namespace zeroshard
