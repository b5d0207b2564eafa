// io_uring (liburing) and kernel AIO queues behind IoQueue (io_queue.h).
#include "io_queue.h"

#include <liburing.h>
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "io_engine.h"

namespace zeroshard {

namespace {

std::string describe(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

class UringQueue : public IoQueue {
 public:
  explicit UringQueue(int depth) {
    const int rc = io_uring_queue_init(static_cast<unsigned>(depth), &ring_, 0);
    if (rc < 0) throw IoError("io_uring_queue_init(" + std::to_string(depth) + ") failed: " + describe(-rc), -rc);
  }
  ~UringQueue() override { io_uring_queue_exit(&ring_); }

  void queue(int tag, bool write, int fd, void* buf, int64_t len, int64_t offset) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);   // never null: at most `depth` requests are out
    if (write)
      io_uring_prep_write(sqe, fd, buf, static_cast<unsigned>(len), static_cast<uint64_t>(offset));
    else
      io_uring_prep_read(sqe, fd, buf, static_cast<unsigned>(len), static_cast<uint64_t>(offset));
    io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(tag));
  }

  void submit() override {
    for (;;) {
      const int rc = io_uring_submit(&ring_);
      if (rc >= 0) return;
      if (rc != -EINTR && rc != -EAGAIN) throw IoError("io_uring_submit failed: " + describe(-rc), -rc);
    }
  }

  void reap(std::vector<IoCompletion>& out) override {
    io_uring_cqe* cqe = nullptr;
    int rc;
    while ((rc = io_uring_wait_cqe(&ring_, &cqe)) == -EINTR) {
    }
    if (rc < 0) throw IoError("io_uring_wait_cqe failed: " + describe(-rc), -rc);
    while (cqe != nullptr) {
      out.push_back({static_cast<int>(io_uring_cqe_get_data64(cqe)), cqe->res});
      io_uring_cqe_seen(&ring_, cqe);
      if (io_uring_peek_cqe(&ring_, &cqe) != 0) cqe = nullptr;
    }
  }

  const char* name() const override { return "io_uring"; }

 private:
  io_uring ring_{};
};

class AioQueue : public IoQueue {
 public:
  explicit AioQueue(int depth) : cbs_(depth), events_(depth) {
    if (syscall(SYS_io_setup, depth, &ctx_) < 0)
      throw IoError("io_setup(" + std::to_string(depth) + ") failed: " + describe(errno), errno);
    pending_.reserve(depth);
  }
  ~AioQueue() override { syscall(SYS_io_destroy, ctx_); }

  void queue(int tag, bool write, int fd, void* buf, int64_t len, int64_t offset) override {
    iocb& cb = cbs_[tag];
    std::memset(&cb, 0, sizeof(cb));
    cb.aio_data = static_cast<uint64_t>(tag);
    cb.aio_lio_opcode = write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    cb.aio_fildes = static_cast<uint32_t>(fd);
    cb.aio_buf = reinterpret_cast<uint64_t>(buf);
    cb.aio_nbytes = static_cast<uint64_t>(len);
    cb.aio_offset = offset;
    pending_.push_back(&cb);
  }

  void submit() override {
    size_t done = 0;
    while (done < pending_.size()) {
      const long n = syscall(SYS_io_submit, ctx_, static_cast<long>(pending_.size() - done), pending_.data() + done);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n < 0) throw IoError("io_submit failed: " + describe(errno), errno);
      done += static_cast<size_t>(n);
    }
    pending_.clear();
  }

  void reap(std::vector<IoCompletion>& out) override {
    long n;
    while ((n = syscall(SYS_io_getevents, ctx_, 1L, static_cast<long>(events_.size()), events_.data(), nullptr)) < 0 &&
           errno == EINTR) {
    }
    if (n < 0) throw IoError("io_getevents failed: " + describe(errno), errno);
    for (long i = 0; i < n; ++i) out.push_back({static_cast<int>(events_[i].data), events_[i].res});
  }

  const char* name() const override { return "aio"; }

 private:
  aio_context_t ctx_ = 0;
  std::vector<iocb> cbs_;          // one per tag: the kernel reads it during io_submit
  std::vector<iocb*> pending_;
  std::vector<io_event> events_;
};

}  // namespace

std::unique_ptr<IoQueue> make_io_queue(IoBackend backend, int depth, std::string* why) {
  if (why != nullptr) why->clear();
  if (backend == IoBackend::kAio) return std::make_unique<AioQueue>(depth);
  if (backend == IoBackend::kUring) return std::make_unique<UringQueue>(depth);
  try {
    return std::make_unique<UringQueue>(depth);
  } catch (const IoError& uring) {
    try {
      auto q = std::make_unique<AioQueue>(depth);
      if (why != nullptr) *why = uring.what();
      return q;
    } catch (const IoError& aio) {
      throw IoError(std::string("no asynchronous I/O queue: ") + uring.what() + "; and the kernel AIO fallback: " +
                        aio.what() + ". Allow io_uring_setup or io_setup in the container's seccomp profile",
                    aio.err);
    }
  }
}

}  // namespace zeroshard
