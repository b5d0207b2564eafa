#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "adamw.h"
#include "adamw_multi.h"
#include "checks.h"

#ifdef ZEROSHARD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace zeroshard {
namespace {

std::string item(const char* list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

void check_flag(const std::optional<at::Tensor>& t, const char* name, at::ScalarType dtype,
                const at::Tensor& ref) {
  if (!t) return;
  check_contiguous(*t, name);
  check_dtype(*t, name, {dtype});
  check_numel(*t, name, 1, "it is a single flag or factor");
  check_same_device(*t, name, ref, "params[0]");
}

void check_hyper(const AdamWOptions& o) {
  if (!(o.lr >= 0)) value_error("lr must be >= 0, got ", o.lr);
  if (!(o.eps >= 0)) value_error("eps must be >= 0, got ", o.eps);
  if (!(o.beta1 >= 0 && o.beta1 < 1)) value_error("beta1 must be in [0, 1), got ", o.beta1);
  if (!(o.beta2 >= 0 && o.beta2 < 1)) value_error("beta2 must be in [0, 1), got ", o.beta2);
  if (!(o.weight_decay >= 0)) value_error("weight_decay must be >= 0, got ", o.weight_decay);
  if (o.step < 1) value_error("step must be >= 1 (the count including this update), got ", o.step);
}

// One parallel region over every shard of the call: the shards are laid end
// to end and at::parallel_for splits the total into torch.get_num_threads()
// parts of at least kMinPerThread elements each (below it, measured, a second
// thread costs more in start-up and cache traffic than it saves), on
// torch's own intra-op threads ([Note: CPU threads] in CMakeLists.txt). A part
// may span several shards; each shard's range is updated independently, with
// its own hyperparameters.
void adamw_cpu_all(const std::vector<AdamWShard>& shards, std::vector<AdamWHyper> hypers,
                   const std::vector<int32_t>& hyper_of, const at::Tensor* scale, const at::Tensor* noop,
                   const at::Tensor* found_inf) {
  if (noop && noop->item<int32_t>() != 0) return;
  if (scale) {
    const float mult = scale->item<float>();
    for (AdamWHyper& h : hypers) h.unscale *= mult;
  }
  std::vector<int64_t> start(shards.size() + 1, 0);
  for (size_t k = 0; k < shards.size(); ++k) start[k + 1] = start[k] + shards[k].numel;
  constexpr int64_t kMinPerThread = 1 << 20;
  std::atomic<bool> bad{false};
  at::parallel_for(0, start.back(), kMinPerThread, [&](int64_t b, int64_t e) {
    // the first shard that ends after b, then every shard that starts before e
    size_t k = std::upper_bound(start.begin(), start.end(), b) - start.begin() - 1;
    for (; k < shards.size() && start[k] < e; ++k) {
      const int64_t lo = std::max(b, start[k]) - start[k], hi = std::min(e, start[k + 1]) - start[k];
      if (lo < hi && adamw_cpu(shards[k], hypers[hyper_of[k]], lo, hi))
        bad.store(true, std::memory_order_relaxed);
    }
  });
  if (bad.load() && found_inf) found_inf->fill_(1);
}

#ifdef ZEROSHARD_WITH_CUDA
// One launch over every shard ([Note: one launch] in adamw_multi.h): the table
// is packed in pinned host memory and copied to the device on the current
// stream (torch's host allocator keeps the pinned block until the copy is
// done; the device copy is freed in stream order after the kernel).
void adamw_cuda_all(const std::vector<AdamWShard>& shards, const std::vector<AdamWHyper>& hypers,
                    const std::vector<int32_t>& hyper_of, const at::Tensor& ref, const at::Tensor* scale,
                    const at::Tensor* noop, const at::Tensor* found_inf) {
  const c10::cuda::CUDAGuard guard(ref.device());
  const auto n = static_cast<int32_t>(shards.size()), nh = static_cast<int32_t>(hypers.size());
  const auto bytes = static_cast<int64_t>(adamw_table_bytes(n, nh));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  const int64_t chunks = pack_adamw_table(shards.data(), hyper_of.data(), n, hypers.data(), nh, host.data_ptr());
  const at::Tensor table = host.to(ref.device(), /*non_blocking=*/true);
  const char* err = adamw_cuda_multi(adamw_table_at(table.data_ptr(), n, chunks),
                                     scale ? scale->data_ptr<float>() : nullptr,
                                     noop ? noop->data_ptr<int32_t>() : nullptr,
                                     found_inf ? found_inf->data_ptr<int32_t>() : nullptr,
                                     at::cuda::getCurrentCUDAStream().stream());
  if (err) throw std::runtime_error(std::string("zeroshard AdamW CUDA launch failed: ") + err);
}
#endif

// Checks shard i's tensors against params[i] (dtype, device, size) and returns its record.
AdamWShard shard_of(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                    const std::vector<std::optional<at::Tensor>>& outs, size_t i) {
  const at::Tensor& ref = params[0];
  const at::Tensor& p = params[i];
  check_contiguous(p, item("params", i));
  check_dtype(p, item("params", i), {at::kFloat});
  check_same_device(p, item("params", i), ref, "params[0]");
  const std::string why = "it must match " + item("params", i);
  struct Arg { const at::Tensor& t; std::string name; std::vector<at::ScalarType> dtypes; };
  std::vector<Arg> args = {
      {grads[i], item("grads", i), {at::kFloat, at::kBFloat16, at::kHalf}},
      {exp_avgs[i], item("exp_avgs", i), {at::kFloat}},
      {exp_avg_sqs[i], item("exp_avg_sqs", i), {at::kFloat}}};
  const bool has_out = !outs.empty() && outs[i].has_value();
  if (has_out) args.push_back({*outs[i], item("outs", i), {at::kBFloat16, at::kHalf, at::kFloat}});
  for (const Arg& a : args) {
    check_contiguous(a.t, a.name);
    check_dtype(a.t, a.name, a.dtypes);
    check_same_device(a.t, a.name, ref, "params[0]");
    check_numel(a.t, a.name, p.numel(), why);
  }
  return AdamWShard{p.data_ptr<float>(),
                    grads[i].data_ptr(),
                    kind_of(grads[i]),
                    exp_avgs[i].data_ptr<float>(),
                    exp_avg_sqs[i].data_ptr<float>(),
                    has_out ? outs[i]->data_ptr() : nullptr,
                    has_out ? kind_of(*outs[i]) : ScalarKind::kFloat32,
                    p.numel()};
}

}  // namespace

void fused_adamw_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& exp_avgs,
                  const std::vector<at::Tensor>& exp_avg_sqs,
                  const std::vector<std::optional<at::Tensor>>& outs,
                  const std::vector<AdamWOptions>& hypers, const std::vector<int64_t>& hyper_of,
                  const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& noop,
                  const std::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  auto same_len = [&](size_t len, const char* name) {
    if (len != n)
      value_error(name, " has ", len, " tensors but params has ", n,
                  "; pass one entry per shard in every list");
  };
  same_len(grads.size(), "grads");
  same_len(exp_avgs.size(), "exp_avgs");
  same_len(exp_avg_sqs.size(), "exp_avg_sqs");
  if (!outs.empty()) same_len(outs.size(), "outs");
  if (hyper_of.size() != n)
    value_error("hyper_of has ", hyper_of.size(), " entries but params has ", n, "; pass one per shard");
  for (const AdamWOptions& o : hypers) check_hyper(o);
  for (size_t i = 0; i < n; ++i)
    if (hyper_of[i] < 0 || hyper_of[i] >= static_cast<int64_t>(hypers.size()))
      value_error("hyper_of[", i, "] is ", hyper_of[i], " but there are ", hypers.size(),
                  " hyperparameter sets; pass an index into them");
  if (n == 0) return;

  const at::Tensor& ref = params[0];
  if (!ref.defined()) value_error("params[0] is None; pass a tensor");
  if (!ref.is_cpu() && !ref.is_cuda())
    value_error("params[0] is on ", ref.device(), "; fused_adamw_ supports CPU and CUDA tensors");
#ifndef ZEROSHARD_WITH_CUDA
  if (ref.is_cuda())
    value_error("params[0] is on ", ref.device(),
                " but this zeroshard build has no CUDA kernels (zeroshard.build_info()['cuda'] is "
                "False); reinstall with nvcc on PATH and a CUDA build of torch");
#endif
  check_flag(scale, "scale", at::kFloat, ref);
  check_flag(noop, "noop", at::kInt, ref);
  check_flag(found_inf, "found_inf", at::kInt, ref);

  std::vector<AdamWShard> shards(n);
  std::vector<int32_t> which(n);
  for (size_t i = 0; i < n; ++i) {
    shards[i] = shard_of(params, grads, exp_avgs, exp_avg_sqs, outs, i);
    which[i] = static_cast<int32_t>(hyper_of[i]);
  }
  std::vector<AdamWHyper> sets;
  for (const AdamWOptions& o : hypers)
    sets.push_back(make_adamw_hyper(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.step));

  const at::Tensor* sc = scale ? &*scale : nullptr;
  const at::Tensor* no = noop ? &*noop : nullptr;
  const at::Tensor* fi = found_inf ? &*found_inf : nullptr;
  if (ref.is_cpu()) return adamw_cpu_all(shards, std::move(sets), which, sc, no, fi);
#ifdef ZEROSHARD_WITH_CUDA
  adamw_cuda_all(shards, sets, which, ref, sc, no, fi);
#endif
}

}  // namespace zeroshard
