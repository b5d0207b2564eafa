// CRC-32 of the checkpoint files' blocks: zlib's (the IEEE polynomial,
// reflected, initial and final value ~0), so files written before and after
// it and any reader with zlib agree. zlib as Python ships it made checksums
// the largest part of loading a checkpoint from the page cache (the figures:
// benchmarks/history.md); on x86 CPUs with
// PCLMULQDQ this folds 64 bytes per step with carry-less multiplications
// (Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ",
// the method zlib-ng and Chromium's zlib use) and falls back to a table
// elsewhere.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zeroshard {

// crc32(data, n, zlib.crc32 of the bytes before) == zlib.crc32(before + data).
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);
// Whether crc32() takes the carry-less-multiplication path on this CPU.
bool crc32_is_fast();
// The table-driven path alone (tests compare the two).
uint32_t crc32_table(const void* data, size_t n, uint32_t crc = 0);

}  // namespace zeroshard
