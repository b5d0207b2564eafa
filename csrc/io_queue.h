// The asynchronous queues under the I/O engine (io_engine.h, [Note: I/O
// engine]): io_uring through liburing, and the kernel's own asynchronous I/O
// (the io_setup/io_submit/io_getevents system calls libaio wraps, called
// directly) where io_uring is refused, e.g. by a container's seccomp profile.
// Torch-free. A queue is driven by one thread queuing and submitting while at
// most one other reaps; IoEngine's lock provides that.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

enum class IoBackend { kAuto, kUring, kAio };

// One finished request: the tag it was queued with, and the kernel's result
// (bytes moved, or -errno).
struct IoCompletion {
  int tag;
  int64_t result;
};

class IoQueue {
 public:
  virtual ~IoQueue() = default;
  // Adds one read or write to the next submit(); `tag` is in [0, depth).
  virtual void queue(int tag, bool write, int fd, void* buf, int64_t len, int64_t offset) = 0;
  // Hands what queue() added to the kernel.
  virtual void submit() = 0;
  // Blocks until at least one request has finished; appends every finished one.
  virtual void reap(std::vector<IoCompletion>& out) = 0;
  virtual const char* name() const = 0;
};

// A queue holding up to `depth` requests. kAuto: io_uring, or the kernel's AIO
// when io_uring_queue_init is refused (`why` then says why; empty otherwise).
// Throws IoError (io_engine.h) when no backend can be set up.
std::unique_ptr<IoQueue> make_io_queue(IoBackend backend, int depth, std::string* why);

}  // namespace zeroshard
