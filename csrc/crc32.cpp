#include "crc32.h"

#include <array>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ZEROSHARD_CRC32_PCLMUL 1
#endif

namespace zeroshard {
namespace {

constexpr uint32_t kPoly = 0xEDB88320u;   // the IEEE polynomial, reflected

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}

const std::array<uint32_t, 256>& table() {
  static const std::array<uint32_t, 256> t = make_table();
  return t;
}

// On the inverted register (no pre/post inversion).
uint32_t table_update(const uint8_t* p, size_t n, uint32_t c) {
  const auto& t = table();
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

#ifdef ZEROSHARD_CRC32_PCLMUL
#define ZS_PCLMUL __attribute__((target("pclmul,sse4.1")))

ZS_PCLMUL inline __m128i load(const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); }

// x * x^(distance k encodes) + next
ZS_PCLMUL inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

// Folds n bytes (n >= 64, a multiple of 16) into the inverted register c.
// Constants: x^(k) mod P(x) in the reflected domain for folding across 512 and
// 128 bits, 64 to 32 bits, and the Barrett reduction (mu, P').
ZS_PCLMUL uint32_t fold_update(const uint8_t* p, size_t n, uint32_t c) {
  alignas(16) static const uint64_t k1k2[2] = {0x0154442bd4ull, 0x01c6e41596ull};
  alignas(16) static const uint64_t k3k4[2] = {0x01751997d0ull, 0x00ccaa009eull};
  alignas(16) static const uint64_t k5k0[2] = {0x0163cd6124ull, 0};
  alignas(16) static const uint64_t poly[2] = {0x01db710641ull, 0x01f7011641ull};
  __m128i x1 = load(p), x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(k1k2));
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    x1 = fold(x1, k, load(p));
    x2 = fold(x2, k, load(p + 16));
    x3 = fold(x3, k, load(p + 32));
    x4 = fold(x4, k, load(p + 48));
  }
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(k3k4));
  x1 = fold(x1, k, x2);
  x1 = fold(x1, k, x3);
  x1 = fold(x1, k, x4);
  for (; n >= 16; p += 16, n -= 16) x1 = fold(x1, k, load(p));
  // 128 -> 64 bits
  const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
  __m128i x2b = _mm_clmulepi64_si128(x1, k, 0x10);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2b);
  k = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k5k0));
  x2b = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k, 0x00), x2b);
  // Barrett reduction to 32 bits
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(poly));
  x2b = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k, 0x10);
  x2b = _mm_clmulepi64_si128(_mm_and_si128(x2b, mask32), k, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x1, x2b), 1));
}

bool has_pclmul() {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}
#endif

}  // namespace

uint32_t crc32_table(const void* data, size_t n, uint32_t crc) {
  return ~table_update(static_cast<const uint8_t*>(data), n, ~crc);
}

bool crc32_is_fast() {
#ifdef ZEROSHARD_CRC32_PCLMUL
  return has_pclmul();
#else
  return false;
#endif
}

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#ifdef ZEROSHARD_CRC32_PCLMUL
  if (n >= 64 && has_pclmul()) {
    const size_t folded = n & ~static_cast<size_t>(15);
    c = fold_update(p, folded, c);
    p += folded;
    n -= folded;
  }
#endif
  return ~table_update(p, n, c);
}

}  // namespace zeroshard
