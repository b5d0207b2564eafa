#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "crc32.h"

using namespace zeroshard;

namespace {

uint32_t bitwise(const std::vector<uint8_t>& d, uint32_t crc = 0) {   // the definition, bit by bit
  uint32_t c = ~crc;
  for (uint8_t b : d) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
  }
  return ~c;
}

}  // namespace

TEST(Crc32, KnownValues) {
  const std::string s = "123456789";
  EXPECT_EQ(crc32(s.data(), s.size()), 0xCBF43926u);     // the IEEE check value (zlib.crc32)
  EXPECT_EQ(crc32(nullptr, 0), 0u);
  EXPECT_EQ(crc32_table(s.data(), s.size()), 0xCBF43926u);
}

TEST(Crc32, EveryLengthAndOffsetAgreesWithTheDefinition) {
  std::mt19937 rng(7);
  std::vector<uint8_t> buf(5000);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (size_t n : {0, 1, 15, 16, 17, 63, 64, 65, 79, 80, 127, 128, 129, 191, 255, 256, 1000, 4093, 4999}) {
    for (size_t off : {0, 1, 3, 8}) {
      if (off + n > buf.size()) continue;
      std::vector<uint8_t> d(buf.begin() + off, buf.begin() + off + n);
      EXPECT_EQ(crc32(d.data(), n), bitwise(d)) << "n=" << n << " off=" << off;
      EXPECT_EQ(crc32(d.data(), n, 0x12345678u), bitwise(d, 0x12345678u)) << "n=" << n;
    }
  }
}

TEST(Crc32, ChainsLikeZlib) {   // crc32(b, crc32(a)) == crc32(a + b)
  std::mt19937 rng(11);
  std::vector<uint8_t> d(1 << 20);
  for (auto& b : d) b = static_cast<uint8_t>(rng());
  const uint32_t whole = crc32(d.data(), d.size());
  EXPECT_EQ(whole, crc32_table(d.data(), d.size()));
  for (size_t cut : {1, 100, 4096, 700001}) {
    EXPECT_EQ(crc32(d.data() + cut, d.size() - cut, crc32(d.data(), cut)), whole) << cut;
  }
}
