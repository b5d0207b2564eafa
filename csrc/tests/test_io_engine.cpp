#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "io_engine.h"

using namespace zeroshard;

namespace {

// A file of `n` random bytes in the build directory (a disk with O_DIRECT), removed after.
struct TestFile {
  std::string path;
  std::vector<char> bytes;
  TestFile(const std::string& name, int64_t n, unsigned seed = 1)
      : path(std::string(ZEROSHARD_TEST_DIR) + "/io-engine-" + name + "-" + std::to_string(getpid())), bytes(n) {
    std::mt19937 rng(seed);
    for (char& b : bytes) b = static_cast<char>(rng());
    std::ofstream(path, std::ios::binary).write(bytes.data(), n);
  }
  ~TestFile() { ::unlink(path.c_str()); }
  std::vector<char> contents() const {
    std::ifstream in(path, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(in), {});
  }
};

std::vector<char> random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<char> v(n);
  for (char& b : v) b = static_cast<char>(rng());
  return v;
}

// (offset, length, shift of the memory from 4096-aligned) that cover every alignment case
const std::vector<std::tuple<int64_t, int64_t, int64_t>> kRanges = {
    {0, 4096, 0},      {0, 70000, 0},   {4096, 8192, 0},  {100, 5, 100},    {100, 5000, 100},  {8191, 2, 8191},
    {4092, 50000, 4092}, {12, 200000, 0}, {12, 200000, 7}, {0, 131072, 4}, {5000, 123457, 5000 % 4096}, {1, 0, 0}};

class IoEngineBackends : public ::testing::TestWithParam<IoBackend> {};

}  // namespace

TEST_P(IoEngineBackends, ReadsAndWritesAnyRangeAndAlignment) {
  TestFile f("rw", 300001);                       // not a whole number of blocks
  IoEngine e(f.path, GetParam(), 4, 16384);         // small pieces: several in flight per transfer
  EXPECT_EQ(e.size(), 300001);
  std::vector<char> expect = f.bytes;
  std::vector<char> mem(400000 + 8192);
  char* base = mem.data() + (4096 - reinterpret_cast<uintptr_t>(mem.data()) % 4096);
  unsigned seed = 10;
  for (auto [off, len, shift] : kRanges) {
    char* buf = base + shift;
    e.wait(e.submit(false, off, len, buf));
    ASSERT_EQ(0, std::memcmp(buf, expect.data() + off, len)) << "read off=" << off << " len=" << len;
    std::vector<char> fresh = random_bytes(len, ++seed);
    std::memcpy(buf, fresh.data(), len);
    e.wait(e.submit(true, off, len, buf));
    std::memcpy(expect.data() + off, fresh.data(), len);
  }
  const int64_t tail = 300001 - 77;                // the last partial block: the file keeps its size
  std::vector<char> last = random_bytes(77, 99);
  e.wait(e.submit(true, tail, 77, last.data()));
  std::memcpy(expect.data() + tail, last.data(), 77);
  EXPECT_EQ(f.contents(), expect);
  std::vector<char> back(300001 + 4096);
  e.wait(e.submit(false, 0, 300001, back.data() + 3));
  EXPECT_EQ(0, std::memcmp(back.data() + 3, expect.data(), 300001));
}

TEST_P(IoEngineBackends, NeighbouringWritesInFlightTogetherKeepEveryByte) {
  // ranges that share blocks, all submitted before any wait: the blocks under
  // read-modify-write are locked in turn ([Note: I/O engine])
  TestFile f("neighbours", 1 << 20);
  IoEngine e(f.path, GetParam(), 8, 8192);
  std::vector<char> expect = f.bytes, src = random_bytes(1 << 20, 5);
  std::vector<uint64_t> tickets;
  for (int64_t off = 3, k = 0; off < (1 << 20) - 20000; off += 1000 + 37 * (k++ % 50)) {
    const int64_t len = 1000 + 37 * (k % 50);
    tickets.push_back(e.submit(true, off, len, src.data() + off));
    std::memcpy(expect.data() + off, src.data() + off, len);
  }
  for (uint64_t t : tickets) e.wait(t);
  EXPECT_EQ(f.contents(), expect);
}

TEST_P(IoEngineBackends, ThreadsShareOneQueue) {
  TestFile f("threads", 4 << 20);
  IoEngine e(f.path, GetParam(), 4, 65536);
  std::vector<std::vector<char>> got(4, std::vector<char>(1 << 20));
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&, k] {
      for (int rep = 0; rep < 5; ++rep) e.wait(e.submit(false, int64_t(k) << 20, 1 << 20, got[k].data()));
    });
  for (auto& t : threads) t.join();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(0, std::memcmp(got[k].data(), f.bytes.data() + (int64_t(k) << 20), 1 << 20));
}

INSTANTIATE_TEST_SUITE_P(Queues, IoEngineBackends, ::testing::Values(IoBackend::kUring, IoBackend::kAio),
                         [](const auto& info) { return info.param == IoBackend::kUring ? "io_uring" : "aio"; });

TEST(IoEngine, ChoosesABackendAndSaysWhy) {
  TestFile f("auto", 8192);
  IoEngine e(f.path);
  EXPECT_TRUE(std::string(e.backend()) == "io_uring" || !e.fallback().empty()) << e.backend();
  EXPECT_EQ(e.depth(), 8);
}

TEST(IoEngine, AReadPastATruncationNamesTheFile) {
  TestFile f("truncated", 1 << 20);
  IoEngine e(f.path, IoBackend::kAuto, 4, 65536);
  ASSERT_EQ(0, ::truncate(f.path.c_str(), 100000));
  std::vector<char> buf(1 << 20);
  try {
    e.wait(e.submit(false, 0, 1 << 20, buf.data()));
    FAIL() << "no error";
  } catch (const IoError& err) {
    const std::string what = err.what();
    EXPECT_NE(what.find(f.path), std::string::npos) << what;
    EXPECT_NE(what.find("the file is 100000 bytes (truncated while the job ran?)"), std::string::npos) << what;
    EXPECT_NE(what.find("at offset "), std::string::npos) << what;
  }
  EXPECT_THROW(e.check(1 << 20), IoError);
  e.check(100000);
  ::unlink(f.path.c_str());
  try {
    e.check(100000);
    FAIL() << "no error";
  } catch (const IoError& err) {
    EXPECT_NE(std::string(err.what()).find(f.path + " was deleted while the job ran"), std::string::npos);
    EXPECT_EQ(err.err, ENOENT);
  }
}

TEST(IoEngine, BadRangesAndArguments) {
  TestFile f("bad", 8192);
  IoEngine e(f.path);
  char buf[16];
  EXPECT_THROW(e.submit(false, 8190, 16, buf), std::invalid_argument);
  EXPECT_THROW(e.submit(true, -1, 1, buf), std::invalid_argument);
  EXPECT_THROW(e.wait(12345), std::invalid_argument);
  EXPECT_THROW(IoEngine(f.path, IoBackend::kAuto, 0), std::invalid_argument);
  EXPECT_THROW(IoEngine(f.path, IoBackend::kAuto, 4, 1000), std::invalid_argument);
  try {
    IoEngine missing(f.path + ".missing");
    FAIL() << "no error";
  } catch (const IoError& err) {
    EXPECT_EQ(err.err, ENOENT);
    EXPECT_NE(std::string(err.what()).find(".missing for direct I/O"), std::string::npos);
  }
}

TEST(IoEngine, AForkedChildRefusesTheParentsQueue) {
  TestFile f("fork", 8192);
  IoEngine e(f.path);
  char buf[16];
  const pid_t pid = fork();
  if (pid == 0) {
    int code = 1;
    try {
      e.submit(false, 0, 16, buf);
    } catch (const std::logic_error& err) {
      code = std::string(err.what()).find("a forked child cannot use it") != std::string::npos ? 0 : 2;
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  e.wait(e.submit(false, 0, 16, buf));   // the parent's engine goes on
  EXPECT_EQ(0, std::memcmp(buf, f.bytes.data(), 16));
}

TEST(IoEngine, ARefusedDirectOpenNamesTheFilesystemAndTheFix) {
  const std::string msg = direct_open_error("/dev/shm/run/f.optstate", EINVAL, 0x01021994);
  EXPECT_EQ(msg, "cannot open /dev/shm/run/f.optstate for direct I/O (O_DIRECT): " + std::string(std::strerror(EINVAL)) +
                     " (errno 22): its filesystem (tmpfs, the directory /dev/shm/run) does not support direct I/O; "
                     "put the file in a directory on a local disk (ext4, xfs or btrfs)");
  EXPECT_NE(direct_open_error("f", EINVAL, 0x1234).find("(filesystem type 0x1234, the directory .)"), std::string::npos);
}
