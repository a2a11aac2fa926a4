// Argument checks shared by the CPU (kv_stack.cpp) and CUDA (kv_stack_cuda.cu)
// kernels of the dtree KV-stack ops. Schemas and semantics: kv_stack.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace dtree {

// A stack buffer pair: [layers, capacity, kv_heads, head_dim], contiguous, same
// shape, dtype and device. The kernels index it as flat memory.
inline void check_stack_pair(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.dim() == 4, what, ": expected [layers, capacity, kv_heads, head_dim], got ", a.sizes());
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && a.device() == b.device(),
              what, ": K and V buffers differ (", a.sizes(), " ", a.scalar_type(), " ", a.device(), " vs ",
              b.sizes(), " ", b.scalar_type(), " ", b.device(), ")");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), what, ": stack buffers must be contiguous");
}

// Rows [n, kv_heads, head_dim] (any strides) written to / added into one layer of
// `stack`, at slots `start + index[i]` (index given) or `start + i`.
inline void check_rows(const at::Tensor& stack, int64_t layer, const at::Tensor& a, const at::Tensor& b,
                       int64_t start, const std::optional<at::Tensor>& index, const char* what) {
  TORCH_CHECK(0 <= layer && layer < stack.size(0), what, ": layer ", layer, " out of range [0, ", stack.size(0), ")");
  TORCH_CHECK(a.dim() == 3 && a.size(1) == stack.size(2) && a.size(2) == stack.size(3), what,
              ": expected rows of shape [n, ", stack.size(2), ", ", stack.size(3), "], got ", a.sizes());
  TORCH_CHECK(a.sizes() == b.sizes(), what, ": K rows ", a.sizes(), " and V rows ", b.sizes(), " differ in shape");
  TORCH_CHECK(a.device() == stack.device() && b.device() == stack.device(), what, ": rows are on ", a.device(),
              "/", b.device(), " but the stack is on ", stack.device());
  const int64_t n = a.size(0), capacity = stack.size(1);
  if (index.has_value()) {
    const at::Tensor& idx = *index;
    TORCH_CHECK(idx.dim() == 1 && idx.size(0) == n, what, ": index must be [", n, "], got ", idx.sizes());
    TORCH_CHECK(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, what,
                ": index must be int32 or int64, got ", idx.scalar_type());
    TORCH_CHECK(idx.device() == stack.device(), what, ": index is on ", idx.device(), " but the stack is on ",
                stack.device());
  } else {
    TORCH_CHECK(0 <= start && start + n <= capacity, what, ": slots [", start, ", ", start + n,
                ") out of range for capacity ", capacity);
  }
}

inline void check_zero_range(const at::Tensor& grad, int64_t lo, int64_t hi) {
  TORCH_CHECK(0 <= lo && lo <= hi && hi <= grad.size(1), "kv_zero_grad: slots [", lo, ", ", hi,
              ") out of range for capacity ", grad.size(1));
}

}  // namespace dtree
