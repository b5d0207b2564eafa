// Argument checks shared by the torch-facing entry points. Each throws
// std::invalid_argument (a Python ValueError) whose message names the
// offending argument, index, dtype, device or size and says how to fix it.
#pragma once

#include <ATen/ATen.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace zeroshard {

template <typename... Args>
[[noreturn]] void value_error(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw std::invalid_argument(os.str());
}

inline void check_contiguous(const at::Tensor& t, const std::string& name) {
  if (!t.defined()) value_error(name, " is None; pass a tensor");
  if (!t.is_contiguous())
    value_error(name, " is not contiguous (shape ", t.sizes(), ", strides ", t.strides(),
                "); pass a contiguous tensor, e.g. t.contiguous()");
}

inline void check_dtype(const at::Tensor& t, const std::string& name,
                        const std::vector<at::ScalarType>& allowed) {
  for (auto s : allowed)
    if (t.scalar_type() == s) return;
  std::ostringstream want;
  for (auto s : allowed) want << (want.tellp() ? " or " : "") << s;
  value_error(name, " has dtype ", t.scalar_type(), ", but expected ", want.str());
}

inline void check_same_device(const at::Tensor& t, const std::string& name,
                              const at::Tensor& ref, const std::string& ref_name) {
  if (t.device() != ref.device())
    value_error(name, " is on ", t.device(), " but ", ref_name, " is on ", ref.device(),
                "; move all tensors of one call to the same device");
}

inline void check_numel(const at::Tensor& t, const std::string& name, int64_t want,
                        const std::string& why) {
  if (t.numel() != want)
    value_error(name, " has ", t.numel(), " elements, but ", want, " are needed (", why, ")");
}

}  // namespace zeroshard
