// The I/O engine: direct reads and writes of one file, several pieces in
// flight ([Note: I/O engine] in io_engine.h).
#include "io_engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace zeroshard {

namespace {

constexpr int64_t kBlock = IoEngine::kBlock;

int64_t floor_block(int64_t x) { return x / kBlock * kBlock; }
int64_t ceil_block(int64_t x) { return (x + kBlock - 1) / kBlock * kBlock; }

std::string describe(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

std::string fs_name(int64_t magic) {
  switch (magic) {
    case 0x01021994: return "tmpfs";
    case 0x858458f6: return "ramfs";
    case 0x65735546: return "fuse";
    case 0x794c7630: return "overlayfs";
    case 0x6969: return "nfs";
    case 0xEF53: return "ext2/3/4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    default: {
      std::ostringstream os;
      os << "filesystem type 0x" << std::hex << magic;
      return os.str();
    }
  }
}

std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

std::string direct_open_error(const std::string& path, int err, int64_t fs_magic) {
  std::string msg = "cannot open " + path + " for direct I/O (O_DIRECT): " + describe(err);
  if (err == EINVAL)
    msg += ": its filesystem (" + fs_name(fs_magic) + ", the directory " + directory_of(path) +
           ") does not support direct I/O; put the file in a directory on a local disk (ext4, xfs or btrfs)";
  return msg;
}

IoEngine::IoEngine(const std::string& path, IoBackend backend, int depth, int64_t piece_bytes)
    : path_(path), pid_(getpid()), piece_bytes_(piece_bytes), depth_(depth) {
  if (depth < 1 || depth > 1024) throw std::invalid_argument("depth must be in [1, 1024], got " + std::to_string(depth));
  if (piece_bytes < kBlock || piece_bytes % kBlock != 0 || piece_bytes > (int64_t{1} << 30))
    throw std::invalid_argument("piece_bytes must be a multiple of 4096 of at most 1 GiB, got " +
                                std::to_string(piece_bytes));
  dio_fd_ = ::open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  if (dio_fd_ < 0) {
    const int err = errno;
    struct statfs fs {};
    throw IoError(direct_open_error(path, err, statfs(path.c_str(), &fs) == 0 ? int64_t(fs.f_type) : 0), err);
  }
  plain_fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  struct stat st {};
  if (plain_fd_ < 0 || fstat(dio_fd_, &st) != 0) {
    const int err = errno;
    ::close(dio_fd_);
    if (plain_fd_ >= 0) ::close(plain_fd_);
    throw IoError("cannot open " + path + ": " + describe(err), err);
  }
  size_ = st.st_size;
  try {
    queue_ = make_io_queue(backend, depth, &fallback_);
  } catch (...) {
    ::close(dio_fd_);
    ::close(plain_fd_);
    throw;
  }
  slots_.resize(depth);
  for (int i = depth - 1; i >= 0; --i) free_.push_back(i);
}

IoEngine::~IoEngine() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    while (in_flight_ > 0 && getpid() == pid_) {   // a forked child must not reap its parent's completions
      if (reaping_) {
        cv_.wait(lk);
        continue;
      }
      try {
        reap_once(lk);
      } catch (const std::exception&) {
        break;   // the queue itself failed: nothing more will complete
      }
    }
  }
  queue_.reset();
  for (Slot& s : slots_) std::free(s.bounce);
  ::close(dio_fd_);
  ::close(plain_fd_);
}

void IoEngine::check_process() const {
  if (getpid() != pid_)
    throw std::logic_error(path_ + ": this I/O engine was opened by process " + std::to_string(pid_) +
                           "; a forked child cannot use it (its queue is the parent's): open another in the child");
}

uint64_t IoEngine::submit(bool write, int64_t offset, int64_t nbytes, void* buf) {
  check_process();
  if (offset < 0 || nbytes < 0 || offset + nbytes > size_ || (buf == nullptr && nbytes > 0))
    throw std::invalid_argument(path_ + ": bytes [" + std::to_string(offset) + ", " + std::to_string(offset + nbytes) +
                                ") are outside the file (" + std::to_string(size_) + " bytes) or have no memory");
  Ticket t{write, offset, offset + nbytes, static_cast<char*>(buf), false, 0};
  const int64_t direct_end = floor_block(size_);
  if (write && t.end > direct_end) {   // the file's last partial block: a plain pwrite of these bytes
    const int64_t from = std::max(t.off, direct_end);
    tail_write(from, t.end, t.buf + (from - t.off), t);
    t.end = from;
  }
  t.cut = t.end > t.off ? floor_block(t.off) : t.end;
  t.congruent = (reinterpret_cast<uintptr_t>(buf) - static_cast<uintptr_t>(offset)) % kBlock == 0;
  std::lock_guard<std::mutex> lk(mu_);
  const uint64_t id = next_ticket_++;
  tickets_.emplace(id, std::move(t));
  pump();
  return id;
}

void IoEngine::tail_write(int64_t off, int64_t end, const char* buf, Ticket& t) {
  while (off < end) {
    const ssize_t n = ::pwrite(plain_fd_, buf, static_cast<size_t>(end - off), off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      fail(t, n < 0 ? errno : EIO, "writing the last " + std::to_string(end - off) + " bytes at offset " +
                                       std::to_string(off) + " failed: " + describe(n < 0 ? errno : EIO));
      return;
    }
    off += n;
    buf += n;
  }
}

void IoEngine::wait(uint64_t ticket) {
  check_process();
  std::unique_lock<std::mutex> lk(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) throw std::invalid_argument("ticket " + std::to_string(ticket) + " is unknown or was waited for");
  while (!it->second.finished()) {
    if (reaping_) {   // another waiter reaps for everyone: it wakes us
      cv_.wait(lk);
      continue;
    }
    pump();
    if (it->second.finished()) break;
    if (in_flight_ == 0) throw std::logic_error("IoEngine: a ticket is unfinished with nothing in flight");
    reap_once(lk);
  }
  Ticket t = std::move(it->second);
  tickets_.erase(it);
  if (!t.error.empty()) throw IoError(t.error, t.err);
}

void IoEngine::reap_once(std::unique_lock<std::mutex>& lk) {
  reaping_ = true;
  lk.unlock();
  try {
    queue_->reap(reaped_);
  } catch (...) {
    lk.lock();
    reaping_ = false;
    cv_.notify_all();
    throw;
  }
  lk.lock();
  reaping_ = false;
  for (const IoCompletion& c : reaped_) complete(c);
  reaped_.clear();
  pump();
  cv_.notify_all();
}

void IoEngine::pump() {
  std::vector<int> queued;
  for (auto& [id, t] : tickets_) {
    while (!free_.empty() && t.cut < t.end && t.error.empty()) {
      const int tag = free_.back();
      if (!cut_piece(id, t)) break;   // waits for a locked block (or failed); the others go on
      queued.push_back(tag);
    }
    if (free_.empty()) break;
  }
  if (queued.empty()) return;
  try {
    queue_->submit();
  } catch (const IoError& e) {
    for (int tag : queued) complete({tag, -int64_t{e.err ? e.err : EIO}});
  }
}

bool IoEngine::cut_piece(uint64_t id, Ticket& t) {
  const int64_t c = t.cut;
  bool bounced = true;
  int64_t len = kBlock;
  if (!t.congruent)
    len = std::min(piece_bytes_, ceil_block(t.end) - c);
  else if (c >= t.off && c + kBlock <= t.end)   // whole blocks: straight into or out of the caller's memory
    len = std::min(piece_bytes_, floor_block(t.end) - c), bounced = false;
  const int tag = free_.back();
  Slot& s = slots_[tag];
  if (bounced && s.bounce == nullptr) {
    void* p = nullptr;
    if (posix_memalign(&p, kBlock, static_cast<size_t>(piece_bytes_)) != 0) throw std::bad_alloc();
    s.bounce = static_cast<char*>(p);
  }
  const int64_t lo = std::max(c, t.off), hi = std::min(c + len, t.end);
  s.ticket = id, s.write = t.write, s.bounced = bounced, s.file_off = c;
  s.user = t.buf + (lo - t.off), s.user_len = hi - lo, s.user_at = lo - c;
  s.want = t.write || !bounced ? len : hi - c;   // a read of the file's last block comes back short
  if (t.write && bounced) {
    if (!lock_edges(t, c, c + len, s)) return false;
    fill_edges(t, c, s);
    if (!t.error.empty()) {
      for (int64_t& b : s.locks) locked_.erase(b), b = -1;
      return false;
    }
    std::memcpy(s.bounce + s.user_at, s.user, static_cast<size_t>(s.user_len));
  }
  free_.pop_back();
  s.busy = true;
  queue_->queue(tag, t.write, dio_fd_, bounced ? s.bounce : t.buf + (c - t.off), len, c);
  t.cut += len;
  ++t.in_flight;
  ++in_flight_;
  return true;
}

bool IoEngine::lock_edges(const Ticket& t, int64_t lo, int64_t hi, Slot& s) {
  const int64_t head = lo < t.off ? lo : -1, tail = hi > t.end ? hi - kBlock : -1;
  for (int64_t b : {head, tail})
    if (b >= 0 && locked_.count(b)) return false;
  s.locks[0] = head, s.locks[1] = tail == head ? -1 : tail;
  for (int64_t b : s.locks)
    if (b >= 0) locked_.insert(b);
  return true;
}

void IoEngine::fill_edges(Ticket& t, int64_t lo, Slot& s) {
  for (int64_t b : s.locks) {
    if (b < 0) continue;
    ssize_t n;
    while ((n = ::pread(dio_fd_, s.bounce + (b - lo), kBlock, b)) < 0 && errno == EINTR) {
    }
    if (n != kBlock) {
      const int err = n < 0 ? errno : EIO;
      const std::string why = n < 0 ? "failed: " + describe(err)
                                    : "returned " + std::to_string(n) + " bytes: the file is " +
                                          std::to_string(current_size()) + " bytes (truncated while the job ran?)";
      fail(t, err, "reading the block at offset " + std::to_string(b) + " to write part of it " + why);
      return;
    }
  }
}

void IoEngine::complete(const IoCompletion& c) {
  Slot& s = slots_[c.tag];
  Ticket& t = tickets_.at(s.ticket);
  const std::string what = std::string(s.write ? "writing " : "reading ") + std::to_string(s.want) +
                           " bytes at offset " + std::to_string(s.file_off);
  if (c.result < 0) {
    const int err = static_cast<int>(-c.result);
    fail(t, err, what + " failed: " + describe(err) +
                     (err == EINVAL ? ": the filesystem refused a block-aligned direct I/O request" : ""));
  } else if (c.result < s.want) {
    fail(t, s.write ? ENOSPC : EIO,
         what + (s.write ? " wrote " : " returned ") + std::to_string(c.result) + " bytes: the file is " +
             std::to_string(current_size()) + " bytes" +
             (s.write ? " (disk full?)" : " (truncated while the job ran?); its data is lost: resume from a checkpoint"));
  } else if (!s.write && s.bounced && t.error.empty()) {
    std::memcpy(s.user, s.bounce + s.user_at, static_cast<size_t>(s.user_len));
  }
  for (int64_t& b : s.locks) {
    if (b >= 0) locked_.erase(b);
    b = -1;
  }
  s.busy = false;
  free_.push_back(c.tag);
  --t.in_flight;
  --in_flight_;
}

void IoEngine::fail(Ticket& t, int err, const std::string& what) {
  if (!t.error.empty()) return;
  t.err = err;
  t.error = path_ + ": " + what;
}

int64_t IoEngine::current_size() const {
  struct stat st {};
  return fstat(dio_fd_, &st) == 0 ? int64_t(st.st_size) : -1;
}

void IoEngine::check(int64_t nbytes) const {
  struct stat st {};
  if (fstat(dio_fd_, &st) != 0) throw IoError(path_ + ": fstat failed: " + describe(errno), errno);
  if (st.st_nlink == 0)
    throw IoError(path_ + " was deleted while the job ran (something removed it from its directory); keep the "
                  "offload directory's files while the job runs and resume from the last checkpoint", ENOENT);
  if (st.st_size < nbytes)
    throw IoError(path_ + " is " + std::to_string(st.st_size) + " bytes but holds " + std::to_string(nbytes) +
                  ": it was truncated while the job ran; its data is lost: resume from the last checkpoint", EIO);
}

}  // namespace zeroshard
