// Reads and writes of one file by direct I/O, several requests in flight.
// Torch-free: plain pointers and byte offsets; the bindings hand it tensors'
// memory, offload/io_engine.py wraps it.
//
// [Note: I/O engine] The offload file (offload="nvme") is read and written by
// O_DIRECT through an asynchronous queue, so the streamed step neither fills
// the page cache (whose pages count against the machine's memory) nor waits
// for one request before the next starts:
// * Queue. io_uring (liburing), or the kernel's AIO where io_uring is refused
//   (chosen at run time; ZEROSHARD_IO_BACKEND or the constructor forces one).
//   A transfer is cut into pieces of at most `piece_bytes`, `depth` of them in
//   flight at once.
// * Alignment. Direct I/O moves whole 4096-byte blocks between block-aligned
//   memory and block-aligned file offsets. A transfer whose memory and file
//   offset are congruent modulo 4096 (offload/streamer.py places its window
//   buffers so) moves its whole blocks straight into or out of the caller's
//   memory; its partial first and last blocks, and every piece of a transfer
//   that is not congruent, go through an aligned bounce buffer of its own
//   slot, copied in (writes) or out (reads) by the engine.
// * Partial blocks written. A write that covers part of a block first reads
//   the block (read-modify-write). Two such writes of one block (neighbouring
//   ranges, e.g. two windows written back at once) would lose one's bytes, so
//   a block under read-modify-write is locked until its write completes; a
//   piece that needs a locked block waits, the others go on. The file's last
//   partial block (its size need not be a multiple of 4096) is written with
//   a plain pwrite of the caller's bytes, so the file never grows.
// * One completion path. Completions are reaped by whichever thread waits,
//   one at a time; it finishes every ticket's pieces, refills the queue and
//   wakes the other waiters. Every user of a file (the streamed step, reads of
//   state or parameters) shares its engine's queue and this path. Nothing
//   here holds the GIL (the bindings release it).
// * Errors name the file, the offset and the errno and say what to do: a
//   filesystem that refuses O_DIRECT (ramfs, tmpfs before Linux 6.6), a read
//   that comes back short (the file truncated under the job), a file deleted
//   under the job (check()). The mapping of the file (state dicts,
//   checkpoints) stays coherent: the kernel writes dirty mapped pages back
//   before a direct read and drops cached pages after a direct write.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "io_queue.h"

namespace zeroshard {

// An I/O failure; what() names the file, the offset and the errno.
class IoError : public std::runtime_error {
 public:
  IoError(const std::string& what, int err) : std::runtime_error(what), err(err) {}
  int err;
};

class IoEngine {
 public:
  static constexpr int64_t kBlock = 4096;   // direct I/O's unit, in memory and in the file

  // Opens `path` (an existing file, allocated to its full size beforehand: the
  // engine never grows it) for direct I/O.
  IoEngine(const std::string& path, IoBackend backend = IoBackend::kAuto, int depth = 8,
           int64_t piece_bytes = int64_t{1} << 20);
  ~IoEngine();   // waits for the requests in flight (in the process that opened it)
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Starts moving bytes [offset, offset + nbytes) of the file into (read) or
  // out of (write) `buf`; returns the ticket to wait() for. `buf` must stay
  // valid until then. Any alignment ([Note: I/O engine]).
  uint64_t submit(bool write, int64_t offset, int64_t nbytes, void* buf);
  // Blocks until the ticket's bytes have moved; throws IoError if they did not.
  void wait(uint64_t ticket);
  // Throws IoError if the file was deleted, or is shorter than `nbytes`.
  void check(int64_t nbytes) const;

  const std::string& path() const { return path_; }
  const char* backend() const { return queue_->name(); }
  // Why io_uring was not used (empty when it is).
  const std::string& fallback() const { return fallback_; }
  int depth() const { return depth_; }
  int64_t size() const { return size_; }

 private:
  struct Ticket {
    bool write;
    int64_t off, end;   // the bytes moved by direct I/O: [off, end)
    char* buf;          // the caller's memory for byte `off`
    bool congruent;     // buf and off agree modulo kBlock
    int64_t cut;        // where the next piece starts (block-aligned)
    int in_flight = 0;
    int err = 0;
    std::string error;
    bool finished() const { return in_flight == 0 && (cut >= end || !error.empty()); }
  };
  struct Slot {
    uint64_t ticket = 0;
    bool busy = false, write = false, bounced = false;
    int64_t file_off = 0, want = 0;     // the piece's offset; the bytes it must move
    char* user = nullptr;               // bounced: the caller's bytes of the piece,
    int64_t user_len = 0, user_at = 0;  // and where they sit in the bounce buffer
    int64_t locks[2] = {-1, -1};        // blocks under read-modify-write
    char* bounce = nullptr;             // kBlock-aligned, piece_bytes_ long (allocated on first use)
  };

  bool cut_piece(uint64_t id, Ticket& t);
  bool lock_edges(const Ticket& t, int64_t lo, int64_t hi, Slot& s);
  void fill_edges(Ticket& t, int64_t lo, Slot& s);
  int64_t current_size() const;
  void pump();
  void complete(const IoCompletion& c);
  void fail(Ticket& t, int err, const std::string& what);
  void reap_once(std::unique_lock<std::mutex>& lk);
  void tail_write(int64_t off, int64_t end, const char* buf, Ticket& t);

  void check_process() const;

  std::string path_, fallback_;
  int pid_;                            // the process that opened it: a forked child may not use it
  int dio_fd_ = -1, plain_fd_ = -1;
  int64_t size_ = 0, piece_bytes_;
  int depth_;
  std::unique_ptr<IoQueue> queue_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool reaping_ = false;
  int in_flight_ = 0;
  uint64_t next_ticket_ = 1;
  std::map<uint64_t, Ticket> tickets_;   // by ticket: pieces are cut oldest first
  std::vector<Slot> slots_;
  std::vector<int> free_;
  std::set<int64_t> locked_;
  std::vector<IoCompletion> reaped_;
};

// The message for a failed open of `path` with O_DIRECT (errno `err`): for
// EINVAL, the directory and its filesystem, which refuses direct I/O, and the fix.
std::string direct_open_error(const std::string& path, int err, int64_t fs_magic);

}  // namespace zeroshard
