// Torch-facing launchers for the quantization kernels of quant.h ([Note: quantized gathers]).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "ops.h"
#include "quant.h"

#ifdef ZEROSHARD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace zeroshard {
namespace {

QuantKind quant_kind(const std::string& kind) {
  if (kind == "int8") return QuantKind::kInt8;
  if (kind == "fp8") return QuantKind::kFp8E4M3;
  value_error("kind is '", kind, "'; the quantized gathers take 'int8' or 'fp8' (e4m3)");
}

void check_block(int64_t block) {
  if (block < 32 || block > 4096 || block % 32 != 0)
    value_error("block is ", block, "; give a multiple of 32 between 32 and 4096 elements (e.g. 256)");
}

ScalarKind float_kind(const at::Tensor& t, const std::string& name) {
  check_contiguous(t, name);
  check_dtype(t, name, {at::kFloat, at::kBFloat16, at::kHalf});
  return kind_of(t);
}

// The arguments every call shares, checked: (the codes' kind, the values' kind).
std::pair<QuantKind, ScalarKind> check_call(const at::Tensor& values, const at::Tensor& wire, int64_t block,
                                            const std::string& kind) {
  const QuantKind k = quant_kind(kind);
  check_block(block);
  const ScalarKind vk = float_kind(values, "values");
  check_contiguous(wire, "wire");
  check_dtype(wire, "wire", {at::kByte});
  check_same_device(wire, "wire", values, "values");
  return {k, vk};
}

// The segments of counts[i] elements laid end to end in `values`, their wire records end to
// end in `wire`; the sizes checked.
std::vector<QuantSegment> segments_of(const at::Tensor& values, ScalarKind vk, const at::Tensor& wire,
                                      const std::vector<int64_t>& counts, int64_t block) {
  std::vector<QuantSegment> segs;
  int64_t at_value = 0, at_wire = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0) value_error("counts[", i, "] is ", counts[i], "; segment sizes are >= 0");
    segs.push_back(QuantSegment{static_cast<char*>(values.data_ptr()) + at_value * values.element_size(), vk,
                                wire.data_ptr<uint8_t>() + at_wire, counts[i], 0});
    at_value += counts[i];
    at_wire += quant_wire_bytes(counts[i], block);
  }
  check_numel(values, "values", at_value, "the sum of counts");
  check_numel(wire, "wire", at_wire, "each segment's codes, padded to 4 bytes, then a scale per block");
  return segs;
}

void run(std::vector<QuantSegment> segs, int64_t block, QuantKind k, bool quantize, const at::Tensor& ref) {
  int64_t blocks = 0;
  for (QuantSegment& s : segs) {
    s.first_block = blocks;
    blocks += quant_blocks(s.numel, block);
  }
  if (ref.is_cuda()) {
#ifdef ZEROSHARD_WITH_CUDA
    const c10::cuda::CUDAGuard guard(ref.device());
    const auto bytes = static_cast<int64_t>(segs.size() * sizeof(QuantSegment));
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr(), segs.data(), bytes);
    const at::Tensor table = host.to(ref.device(), /*non_blocking=*/true);
    const QuantTable t{static_cast<const QuantSegment*>(table.data_ptr()), static_cast<int32_t>(segs.size()),
                       blocks, block, k};
    const char* err = quant_cuda(t, quantize, at::cuda::getCurrentCUDAStream().stream());
    if (err) throw std::runtime_error(std::string("zeroshard quantization CUDA launch failed: ") + err);
    return;
#else
    value_error("the tensors are on ", ref.device(), " but this build of zeroshard has no CUDA kernels");
#endif
  }
  at::parallel_for(0, blocks, 64, [&](int64_t b, int64_t e) {
    for (const QuantSegment& s : segs) {
      const int64_t lo = std::max(b, s.first_block), hi = std::min(e, s.first_block + quant_blocks(s.numel, block));
      if (lo < hi) {
        if (quantize) quantize_cpu(s, block, k, lo - s.first_block, hi - s.first_block);
        else dequantize_cpu(s, block, k, lo - s.first_block, hi - s.first_block);
      }
    }
  });
}

}  // namespace

void quantize_blocks_(const at::Tensor& values, const at::Tensor& wire, const std::vector<int64_t>& counts,
                      int64_t block, const std::string& kind) {
  const auto [k, vk] = check_call(values, wire, block, kind);
  run(segments_of(values, vk, wire, counts, block), block, k, true, values);
}

void dequantize_blocks_(const at::Tensor& wire, const at::Tensor& values, const std::vector<int64_t>& counts,
                        int64_t block, const std::string& kind) {
  const auto [k, vk] = check_call(values, wire, block, kind);
  run(segments_of(values, vk, wire, counts, block), block, k, false, values);
}

}  // namespace zeroshard
