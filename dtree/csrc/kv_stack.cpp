// dtree KV-stack ops: schemas (namespace `dtree`) and CPU kernels.
//
// The stack (dtree/kv_stack.py) holds, per layer, the K/V of the current
// root-to-node path and float32 gradient buffers, all [layers, capacity,
// kv_heads, head_dim]. These ops do its per-call bookkeeping, K and V in one call:
//
//   kv_push       write rows [n, kv_heads, head_dim] (any strides, any dtype)
//                 into one layer's value slots;
//   kv_accumulate add dK/dV rows (any float dtype) into one layer's float32
//                 gradient slots; slots may repeat (every repeat is added);
//   kv_zero_grad  zero the gradient slots [lo, hi) of every layer.
//
// Row i goes to slot `start + index[i]` when an index (int32/int64 [n]) is given,
// else to slot `start + i`. Pushed slots must be distinct.
//
// The CUDA kernels are in kv_stack_cuda.cu; fake (meta) kernels for torch.compile
// and the pure-torch references are in dtree/kv_stack_ext.py.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "kv_stack.h"

namespace dtree {
namespace {

// parallel_for hands a thread at least this many bytes of work: below it the
// fork/join of a parallel region costs more than it saves (measured on 2 cores:
// 32 KB and 256 KB chunks tie at 150 KB per call; at 500 KB, 32 KB is 1.4x faster).
constexpr int64_t kGrainBytes = 32 * 1024;

// The int64 slot table of an indexed call (bounds-checked here, since a bad
// slot would write outside the stack), or an undefined tensor when the rows are
// contiguous from `start`.
at::Tensor slot_table(const std::optional<at::Tensor>& index, int64_t start, int64_t capacity, const char* what) {
  if (!index.has_value()) return {};
  at::Tensor slots = index->to(at::kLong).contiguous();
  const int64_t* p = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    const int64_t s = start + p[i];
    TORCH_CHECK(0 <= s && s < capacity, what, ": slot ", s, " (row ", i, ") out of range for capacity ", capacity);
  }
  return slots;
}

// Copies rows [n, heads, dim] (strided, the stack's dtype) into one layer.
// Byte copies, so one function serves every dtype.
void copy_rows(const at::Tensor& stack, int64_t layer, const at::Tensor& src, int64_t start, const int64_t* slots) {
  const int64_t n = src.size(0), heads = src.size(1), dim = src.size(2), es = src.element_size();
  const int64_t row_bytes = heads * dim * es;
  char* base = static_cast<char*>(stack.data_ptr()) + layer * stack.stride(0) * es;
  const char* s = static_cast<const char*>(src.const_data_ptr());
  const int64_t s0 = src.stride(0) * es, s1 = src.stride(1) * es, s2 = src.stride(2) * es;
  // a row whose heads lie back to back is one memcpy
  const bool flat = s2 == es && s1 == dim * es;
  at::parallel_for(0, n, std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(row_bytes, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      char* d = base + (start + (slots ? slots[t] : t)) * row_bytes;
      if (flat) {
        std::memcpy(d, s + t * s0, row_bytes);
        continue;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const char* sh = s + t * s0 + h * s1;
        char* dh = d + h * dim * es;
        if (s2 == es) {
          std::memcpy(dh, sh, dim * es);
        } else {
          for (int64_t j = 0; j < dim; ++j) std::memcpy(dh + j * es, sh + j * s2, es);
        }
      }
    }
  });
}

// d[j] += s[j * stride] for j < len; restrict (no aliasing) lets the compiler
// vectorize the unit-stride loop.
template <typename scalar_t>
void add_span(float* __restrict d, const scalar_t* __restrict s, int64_t len, int64_t stride) {
  if (stride == 1) {
    for (int64_t j = 0; j < len; ++j) d[j] += static_cast<float>(s[j]);
  } else {
    for (int64_t j = 0; j < len; ++j) d[j] += static_cast<float>(s[j * stride]);
  }
}

// Adds rows [n, heads, dim] (strided, scalar_t) into float32 rows of one layer.
template <typename scalar_t>
void add_rows(const at::Tensor& grad, int64_t layer, const at::Tensor& src, int64_t start, const int64_t* slots) {
  const int64_t n = src.size(0), dim = src.size(2), row = src.size(1) * dim;
  float* base = grad.data_ptr<float>() + layer * grad.stride(0);
  const scalar_t* s = src.const_data_ptr<scalar_t>();
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
  // a row whose heads lie back to back is one span (heads * dim), else one per head
  const int64_t span = s1 == dim * s2 ? row : dim;
  // columns [c0, c1) of row t; a column is (head, d) flattened
  auto add = [&](int64_t t, int64_t c0, int64_t c1) {
    float* d = base + (start + (slots ? slots[t] : t)) * row;
    for (int64_t c = c0; c < c1;) {
      const int64_t h = c / span, j = c - h * span, end = std::min(c1, (h + 1) * span);
      add_span(d + c, s + t * s0 + h * s1 + j * s2, end - c, s2);
      c = end;
    }
  };
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / int64_t(sizeof(float)));
  if (slots) {
    // Slots may repeat, so two rows can hit the same slot: split the columns
    // among threads and let each walk every row in order (deterministic, and the
    // same summation order as index_add_).
    at::parallel_for(0, row, grain, [&](int64_t c0, int64_t c1) {
      for (int64_t t = 0; t < n; ++t) add(t, c0, c1);
    });
  } else {
    at::parallel_for(0, n, std::max<int64_t>(1, grain / std::max<int64_t>(row, 1)), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) add(t, 0, row);
    });
  }
}

void push_cpu(const at::Tensor& stack_k, const at::Tensor& stack_v, int64_t layer, const at::Tensor& k,
              const at::Tensor& v, int64_t start, const std::optional<at::Tensor>& slots) {
  check_stack_pair(stack_k, stack_v, "kv_push");
  check_rows(stack_k, layer, k, v, start, slots, "kv_push");
  if (k.size(0) == 0) return;
  const at::Tensor table = slot_table(slots, start, stack_k.size(1), "kv_push");
  const int64_t* p = table.defined() ? table.const_data_ptr<int64_t>() : nullptr;
  // rows in another dtype are converted first, as Tensor.copy_ would
  const auto dtype = stack_k.scalar_type();
  copy_rows(stack_k, layer, k.scalar_type() == dtype ? k : k.to(dtype), start, p);
  copy_rows(stack_v, layer, v.scalar_type() == dtype ? v : v.to(dtype), start, p);
}

void accumulate_cpu(const at::Tensor& grad_k, const at::Tensor& grad_v, int64_t layer, const at::Tensor& dk,
                    const at::Tensor& dv, int64_t start, const std::optional<at::Tensor>& index) {
  check_stack_pair(grad_k, grad_v, "kv_accumulate");
  TORCH_CHECK(grad_k.scalar_type() == at::kFloat, "kv_accumulate: gradient buffers must be float32, got ",
              grad_k.scalar_type());
  check_rows(grad_k, layer, dk, dv, start, index, "kv_accumulate");
  TORCH_CHECK(dk.scalar_type() == dv.scalar_type(), "kv_accumulate: dK is ", dk.scalar_type(), " but dV is ",
              dv.scalar_type());
  if (dk.size(0) == 0) return;
  const at::Tensor table = slot_table(index, start, grad_k.size(1), "kv_accumulate");
  const int64_t* p = table.defined() ? table.const_data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dk.scalar_type(), "kv_accumulate", [&] {
    add_rows<scalar_t>(grad_k, layer, dk, start, p);
    add_rows<scalar_t>(grad_v, layer, dv, start, p);
  });
}

void zero_grad_cpu(const at::Tensor& grad_k, const at::Tensor& grad_v, int64_t lo, int64_t hi) {
  check_stack_pair(grad_k, grad_v, "kv_zero_grad");
  check_zero_range(grad_k, lo, hi);
  const int64_t es = grad_k.element_size(), layer_bytes = grad_k.stride(0) * es;
  const int64_t span = (hi - lo) * grad_k.stride(1) * es, offset = lo * grad_k.stride(1) * es;
  if (span == 0) return;
  char* bases[2] = {static_cast<char*>(grad_k.data_ptr()), static_cast<char*>(grad_v.data_ptr())};
  // one task per (layer, buffer): a contiguous memset each
  at::parallel_for(0, 2 * grad_k.size(0), std::max<int64_t>(1, kGrainBytes / span), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memset(bases[i % 2] + (i / 2) * layer_bytes + offset, 0, span);
  });
}

}  // namespace

// A fragment, so other dtree ops may live in the same namespace.
TORCH_LIBRARY_FRAGMENT(dtree, m) {
  // where the fake (meta) kernels are registered, imported on demand by FakeTensor
  m.set_python_module("dtree.kv_stack_ext");
  m.def("kv_push(Tensor(a!) stack_k, Tensor(b!) stack_v, int layer, Tensor k, Tensor v, SymInt start=0, "
        "Tensor? slots=None) -> ()");
  m.def("kv_accumulate(Tensor(a!) grad_k, Tensor(b!) grad_v, int layer, Tensor dk, Tensor dv, SymInt start=0, "
        "Tensor? index=None) -> ()");
  m.def("kv_zero_grad(Tensor(a!) grad_k, Tensor(b!) grad_v, SymInt lo, SymInt hi) -> ()");
}

TORCH_LIBRARY_IMPL(dtree, CPU, m) {
  m.impl("kv_push", TORCH_FN(push_cpu));
  m.impl("kv_accumulate", TORCH_FN(accumulate_cpu));
  m.impl("kv_zero_grad", TORCH_FN(zero_grad_cpu));
}

}  // namespace dtree
