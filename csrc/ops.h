// Torch-facing launchers for the kernels in adamw.h and quant.h.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "adamw.h"  // ScalarKind

namespace zeroshard {

// The kernels' name for a float tensor's dtype (bf16, fp16, else fp32: check the dtype first).
inline ScalarKind kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return ScalarKind::kBFloat16;
    case at::kHalf: return ScalarKind::kFloat16;
    default: return ScalarKind::kFloat32;
  }
}

struct AdamWOptions {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;
};

// Updates every shard i: params[i] (fp32), exp_avgs[i], exp_avg_sqs[i] in
// place from grads[i] (fp32/bf16/fp16), with the hyperparameters
// hypers[hyper_of[i]], optionally writing the new params into outs[i]
// (bf16/fp16/fp32; `outs` is empty or has one entry per shard, None for
// none). One launch over every shard (CUDA, [Note: one launch]) or one
// parallel loop (CPU). The gradients are taken as they are (averaged:
// [Note: one meaning for a gradient] in core/segments.py), but `scale` (fp32,
// 1 element: GradScaler's inverse scale) multiplies them if given; `noop`
// (int32, 1 element) turns the call into a no-op when non-zero; `found_inf`
// (int32, 1 element) is set to 1 if any scaled gradient is non-finite. On CUDA none of these syncs with the host. Every argument is
// checked before anything is written.
void fused_adamw_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& exp_avgs,
                  const std::vector<at::Tensor>& exp_avg_sqs,
                  const std::vector<std::optional<at::Tensor>>& outs,
                  const std::vector<AdamWOptions>& hypers, const std::vector<int64_t>& hyper_of,
                  const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& noop,
                  const std::optional<at::Tensor>& found_inf);

}  // namespace zeroshard

namespace zeroshard {

// [Note: quantized gathers] (quant.h). The segments of counts[i] elements laid end to end in
// `values` (fp32/bf16/fp16) quantized as `kind` ("int8" or "fp8") in blocks of `block`
// elements into their wire records, laid end to end in `wire` (uint8). One launch (CUDA) or
// one parallel loop (CPU).
void quantize_blocks_(const at::Tensor& values, const at::Tensor& wire, const std::vector<int64_t>& counts,
                      int64_t block, const std::string& kind);
// The wire records of such segments decoded into `values`, in one launch.
void dequantize_blocks_(const at::Tensor& wire, const at::Tensor& values, const std::vector<int64_t>& counts,
                        int64_t block, const std::string& kind);

}  // namespace zeroshard
