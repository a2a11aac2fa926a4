// CUDA implementations of the KV-stack ops declared in stack_ops.cpp.
//
// Layouts: a layer's stack slots are [capacity, heads, dim] contiguous (KVStack.k[layer],
// KVStack.grad_k[layer]); a call's own rows are [rows, heads, dim] with any row and head
// strides and a unit last stride. One block per row (and per tensor: K is blockIdx.y == 0,
// V is 1), so K and V of one op are one launch. The slot offset is read from device memory.
//
// Bitwise contract with the torch fallback (dtree/ops/stack_ops_torch.py): every float
// operation is a single rounded multiply or add (__fmul_rn / __fadd_rn, never contracted
// into an FMA) in the same order as the fallback's torch ops, so both give identical bits.
// The segmented reduction adds a slot's rows one after another in a fixed order (no atomics):
// two runs, and the fallback, produce the same sums.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace dtree_stack {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// A [rows, heads, dim] view: element (r, h, d) at r * s0 + h * s1 + d.
struct Rows {
  int64_t s0, s1;
  int dim;
};

template <typename T, typename R>
__global__ void push_kv_kernel(
    T* __restrict__ k_slots, T* __restrict__ v_slots, const int64_t* __restrict__ slot_lo,
    const T* __restrict__ k, const T* __restrict__ v, const R* __restrict__ cos, const R* __restrict__ sin,
    Rows kr, Rows vr, int heads, int rot, int64_t cos_s0, int64_t capacity) {
  const int64_t t = blockIdx.x;
  const int64_t slot = *slot_lo + t;
  if (slot < 0 || slot >= capacity) return;  // the wrapper checks the host-side range first
  if (blockIdx.y == 0) {
    const int half = rot / 2;
    T* dst = k_slots + slot * heads * kr.dim;
    for (int e = threadIdx.x; e < heads * kr.dim; e += blockDim.x) {
      const int h = e / kr.dim, d = e - h * kr.dim;
      const T* src = k + t * kr.s0 + h * kr.s1;
      if (d < rot) {
        // HF's rotate_half convention: x * cos + cat(-x2, x1) * sin, in the op-math type
        const R x = static_cast<R>(src[d]);
        const R partner = d < half ? -static_cast<R>(src[d + half]) : static_cast<R>(src[d - half]);
        const R c = cos[t * cos_s0 + d], s = sin[t * cos_s0 + d];
        dst[e] = static_cast<T>(add_rn(mul_rn(x, c), mul_rn(partner, s)));
      } else {
        dst[e] = src[d];
      }
    }
  } else {
    T* dst = v_slots + slot * heads * vr.dim;
    for (int e = threadIdx.x; e < heads * vr.dim; e += blockDim.x) {
      const int h = e / vr.dim, d = e - h * vr.dim;
      dst[e] = v[t * vr.s0 + h * vr.s1 + d];
    }
  }
}

// out[t] = (slots[lo + t] + g[t]) in S (the slots' type), rounded once to O.
template <typename S, typename O>
__device__ __forceinline__ void seed_rows(
    const S* __restrict__ slots, const O* __restrict__ g, O* __restrict__ out, Rows gr, int heads, int64_t t,
    int64_t slot) {
  const int width = heads * gr.dim;
  const S* src = slots + slot * width;
  O* dst = out + t * width;
  for (int e = threadIdx.x; e < width; e += blockDim.x) {
    S acc = src[e];
    if (g != nullptr) {
      const int h = e / gr.dim, d = e - h * gr.dim;
      acc = add_rn(acc, static_cast<S>(g[t * gr.s0 + h * gr.s1 + d]));
    }
    dst[e] = static_cast<O>(acc);
  }
}

template <typename S, typename O>
__global__ void seed_grad_kernel(
    const S* __restrict__ gk_slots, const S* __restrict__ gv_slots, const int64_t* __restrict__ slot_lo,
    const O* __restrict__ gk, const O* __restrict__ gv, O* __restrict__ out_k, O* __restrict__ out_v, Rows kr,
    Rows vr, int heads, int64_t capacity) {
  const int64_t t = blockIdx.x;
  const int64_t slot = *slot_lo + t;
  if (slot < 0 || slot >= capacity) return;
  if (blockIdx.y == 0) {
    seed_rows<S, O>(gk_slots, gk, out_k, kr, heads, t, slot);
  } else {
    seed_rows<S, O>(gv_slots, gv, out_v, vr, heads, t, slot);
  }
}

template <typename S>
__global__ void zero_slots_kernel(
    S* __restrict__ grad_k, S* __restrict__ grad_v, const int64_t* __restrict__ slot_lo, int64_t capacity,
    int64_t k_width, int64_t v_width) {
  const int64_t slot = *slot_lo + blockIdx.x;
  if (slot < 0 || slot >= capacity) return;
  const int64_t layer = blockIdx.y;
  const bool is_k = blockIdx.z == 0;
  const int64_t width = is_k ? k_width : v_width;
  S* dst = (is_k ? grad_k : grad_v) + (layer * capacity + slot) * width;
  for (int64_t e = threadIdx.x; e < width; e += blockDim.x) dst[e] = S(0);
}

// Rows j of one slot are consecutive in sorted_slots; the first of them sums the slot's
// rows in j order into the slot, the others return.
template <typename S, typename G>
__global__ void segment_add_kernel(
    S* __restrict__ gk_slots, S* __restrict__ gv_slots, const int64_t* __restrict__ sorted_slots,
    const int64_t* __restrict__ order, const G* __restrict__ dk, const G* __restrict__ dv, Rows kr, Rows vr,
    int heads, int64_t n, int64_t capacity) {
  const int64_t j = blockIdx.x;
  const int64_t slot = sorted_slots[j];
  if ((j > 0 && sorted_slots[j - 1] == slot) || slot < 0 || slot >= capacity) return;
  __shared__ int64_t end;
  if (threadIdx.x == 0) {
    int64_t e = j + 1;
    while (e < n && sorted_slots[e] == slot) ++e;
    end = e;
  }
  __syncthreads();
  const bool is_k = blockIdx.y == 0;
  const Rows r = is_k ? kr : vr;
  const G* src = is_k ? dk : dv;
  const int width = heads * r.dim;
  S* dst = (is_k ? gk_slots : gv_slots) + slot * width;
  for (int e = threadIdx.x; e < width; e += blockDim.x) {
    const int h = e / r.dim, d = e - h * r.dim;
    S acc = dst[e];
    for (int64_t i = j; i < end; ++i) acc = add_rn(acc, static_cast<S>(src[order[i] * r.s0 + h * r.s1 + d]));
    dst[e] = acc;
  }
}

template <typename T>
__global__ void gather_slots_kernel(
    const T* __restrict__ k_slots, const T* __restrict__ v_slots, const int64_t* __restrict__ index,
    T* __restrict__ out_k, T* __restrict__ out_v, int64_t k_width, int64_t v_width, int64_t capacity) {
  const int64_t j = blockIdx.x;
  const int64_t slot = index[j];
  if (slot < 0 || slot >= capacity) return;
  const bool is_k = blockIdx.y == 0;
  const int64_t width = is_k ? k_width : v_width;
  const T* src = (is_k ? k_slots : v_slots) + slot * width;
  T* dst = (is_k ? out_k : out_v) + j * width;
  for (int64_t e = threadIdx.x; e < width; e += blockDim.x) dst[e] = src[e];
}

// ------------------------------------------------------------------------ host side
void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "dtree_stack: ", name, " must be a CUDA tensor, got ", t.device());
}

void check_slots(const at::Tensor& slots, const char* name) {
  check_cuda(slots, name);
  TORCH_CHECK(slots.dim() == 3 && slots.is_contiguous(), "dtree_stack: ", name,
              " must be contiguous [capacity, heads, dim], got shape ", slots.sizes());
}

// A call's rows [rows, heads, dim] with a unit last stride.
Rows rows_of(const at::Tensor& t, const at::Tensor& slots, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.dim() == 3 && t.size(1) == slots.size(1) && t.size(2) == slots.size(2), "dtree_stack: ", name,
              " must be [rows, ", slots.size(1), ", ", slots.size(2), "], got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 || t.size(2) == 1, "dtree_stack: ", name, " needs a unit last stride");
  return Rows{t.stride(0), t.stride(1), static_cast<int>(t.size(2))};
}

const int64_t* offset_ptr(const at::Tensor& slot_lo) {
  check_cuda(slot_lo, "slot_lo");
  TORCH_CHECK(slot_lo.scalar_type() == at::kLong && slot_lo.numel() == 1,
              "dtree_stack: slot_lo must be a one-element int64 tensor");
  return slot_lo.data_ptr<int64_t>();
}

void push_kv(at::Tensor k_slots, at::Tensor v_slots, const at::Tensor& slot_lo, const at::Tensor& k,
             const at::Tensor& v, const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin) {
  check_slots(k_slots, "k_slots");
  check_slots(v_slots, "v_slots");
  const Rows kr = rows_of(k, k_slots, "k"), vr = rows_of(v, v_slots, "v");
  TORCH_CHECK(k.size(0) == v.size(0), "dtree_stack: k and v have ", k.size(0), " and ", v.size(0), " rows");
  TORCH_CHECK(k.scalar_type() == k_slots.scalar_type() && v.scalar_type() == v_slots.scalar_type() &&
                  k.scalar_type() == v.scalar_type(),
              "dtree_stack.push_kv: k, v and the stack must share a dtype");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "dtree_stack.push_kv: give both cos and sin, or neither");
  const int64_t rows = k.size(0);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(k.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(rows), 2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k.scalar_type(), "dtree_stack.push_kv", [&] {
    using R = at::opmath_type<scalar_t>;
    const R* cos_ptr = nullptr;
    const R* sin_ptr = nullptr;
    int rot = 0;
    int64_t cos_s0 = 0;
    if (cos.has_value()) {
      const at::Tensor& c = *cos;
      const at::Tensor& s = *sin;
      check_cuda(c, "cos");
      check_cuda(s, "sin");
      TORCH_CHECK(c.scalar_type() == c10::CppTypeToScalarType<R>::value && s.scalar_type() == c.scalar_type(),
                  "dtree_stack.push_kv: cos and sin must be in the op-math dtype ", c10::CppTypeToScalarType<R>::value);
      TORCH_CHECK(c.dim() == 2 && c.size(0) == rows && c.sizes() == s.sizes() && c.stride(1) == 1 &&
                      c.strides() == s.strides(),
                  "dtree_stack.push_kv: cos and sin must be [rows, rotary_dim] with one layout, got ", c.sizes(),
                  " and ", s.sizes());
      rot = static_cast<int>(c.size(1));
      TORCH_CHECK(rot % 2 == 0 && rot <= kr.dim, "dtree_stack.push_kv: rotary_dim ", rot,
                  " must be even and at most the key head dim ", kr.dim);
      cos_ptr = c.data_ptr<R>();
      sin_ptr = s.data_ptr<R>();
      cos_s0 = c.stride(0);
    }
    push_kv_kernel<scalar_t, R><<<grid, kThreads, 0, stream>>>(
        k_slots.data_ptr<scalar_t>(), v_slots.data_ptr<scalar_t>(), offset_ptr(slot_lo), k.data_ptr<scalar_t>(),
        v.data_ptr<scalar_t>(), cos_ptr, sin_ptr, kr, vr, static_cast<int>(k_slots.size(1)), rot, cos_s0,
        k_slots.size(0));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<at::Tensor, at::Tensor> seed_grad(const at::Tensor& gk_slots, const at::Tensor& gv_slots,
                                             const at::Tensor& slot_lo, const std::optional<at::Tensor>& gk,
                                             const std::optional<at::Tensor>& gv, int64_t rows,
                                             at::ScalarType k_dtype, at::ScalarType v_dtype) {
  check_slots(gk_slots, "grad_k_slots");
  check_slots(gv_slots, "grad_v_slots");
  TORCH_CHECK(k_dtype == v_dtype, "dtree_stack.seed_grad: K and V dtypes differ");
  TORCH_CHECK(gk_slots.scalar_type() == gv_slots.scalar_type(), "dtree_stack.seed_grad: slot dtypes differ");
  auto out_k = at::empty({rows, gk_slots.size(1), gk_slots.size(2)}, gk_slots.options().dtype(k_dtype));
  auto out_v = at::empty({rows, gv_slots.size(1), gv_slots.size(2)}, gv_slots.options().dtype(v_dtype));
  Rows kr{0, 0, static_cast<int>(gk_slots.size(2))}, vr{0, 0, static_cast<int>(gv_slots.size(2))};
  if (gk.has_value()) {
    kr = rows_of(*gk, gk_slots, "gk");
    TORCH_CHECK(gk->size(0) == rows && gk->scalar_type() == k_dtype, "dtree_stack.seed_grad: gk must be [rows] in k_dtype");
  }
  if (gv.has_value()) {
    vr = rows_of(*gv, gv_slots, "gv");
    TORCH_CHECK(gv->size(0) == rows && gv->scalar_type() == v_dtype, "dtree_stack.seed_grad: gv must be [rows] in v_dtype");
  }
  if (rows == 0) return {out_k, out_v};
  const bool slots_double = gk_slots.scalar_type() == at::kDouble;
  TORCH_CHECK(slots_double ? k_dtype == at::kDouble : gk_slots.scalar_type() == at::kFloat && k_dtype != at::kDouble,
              "dtree_stack.seed_grad: float32 slots with a 16/32-bit dtype, or float64 slots with float64");
  const c10::cuda::CUDAGuard guard(gk_slots.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(rows), 2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_dtype, "dtree_stack.seed_grad", [&] {
    using S = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    seed_grad_kernel<S, scalar_t><<<grid, kThreads, 0, stream>>>(
        gk_slots.data_ptr<S>(), gv_slots.data_ptr<S>(), offset_ptr(slot_lo),
        gk.has_value() ? gk->data_ptr<scalar_t>() : nullptr, gv.has_value() ? gv->data_ptr<scalar_t>() : nullptr,
        out_k.data_ptr<scalar_t>(), out_v.data_ptr<scalar_t>(), kr, vr, static_cast<int>(gk_slots.size(1)),
        gk_slots.size(0));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out_k, out_v};
}

void zero_slots(at::Tensor grad_k, at::Tensor grad_v, const at::Tensor& slot_lo, int64_t rows) {
  check_cuda(grad_k, "grad_k");
  check_cuda(grad_v, "grad_v");
  TORCH_CHECK(grad_k.dim() == 4 && grad_v.dim() == 4 && grad_k.is_contiguous() && grad_v.is_contiguous() &&
                  grad_k.size(0) == grad_v.size(0) && grad_k.size(1) == grad_v.size(1) &&
                  grad_k.scalar_type() == grad_v.scalar_type(),
              "dtree_stack.zero_slots: grad_k and grad_v must be contiguous [layers, capacity, heads, dim] of one dtype");
  if (rows == 0 || grad_k.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(grad_k.device());
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(grad_k.size(0)), 2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_k.scalar_type(), "dtree_stack.zero_slots", [&] {
    zero_slots_kernel<scalar_t><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        grad_k.data_ptr<scalar_t>(), grad_v.data_ptr<scalar_t>(), offset_ptr(slot_lo), grad_k.size(1),
        grad_k.size(2) * grad_k.size(3), grad_v.size(2) * grad_v.size(3));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void segment_add(at::Tensor gk_slots, at::Tensor gv_slots, const at::Tensor& sorted_slots, const at::Tensor& order,
                 const at::Tensor& dk, const at::Tensor& dv) {
  check_slots(gk_slots, "grad_k_slots");
  check_slots(gv_slots, "grad_v_slots");
  check_cuda(sorted_slots, "sorted_slots");
  check_cuda(order, "order");
  const Rows kr = rows_of(dk, gk_slots, "dk"), vr = rows_of(dv, gv_slots, "dv");
  const int64_t n = sorted_slots.numel();
  TORCH_CHECK(sorted_slots.scalar_type() == at::kLong && order.scalar_type() == at::kLong && order.numel() == n &&
                  sorted_slots.is_contiguous() && order.is_contiguous() && dk.size(0) == n && dv.size(0) == n,
              "dtree_stack.segment_add: sorted_slots and order must be contiguous int64 [n] for n = ", dk.size(0),
              " rows of dk and dv");
  TORCH_CHECK(gk_slots.scalar_type() == gv_slots.scalar_type() && dk.scalar_type() == dv.scalar_type(),
              "dtree_stack.segment_add: K and V slots (and dk, dv) must share a dtype");
  const bool slots_double = gk_slots.scalar_type() == at::kDouble;
  TORCH_CHECK(slots_double || (gk_slots.scalar_type() == at::kFloat && dk.scalar_type() != at::kDouble),
              "dtree_stack.segment_add: float32 slots with 16/32-bit gradients, or float64 slots");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(gk_slots.device());
  const dim3 grid(static_cast<unsigned>(n), 2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dk.scalar_type(), "dtree_stack.segment_add", [&] {
    auto launch = [&](auto slot_zero) {
      using S = decltype(slot_zero);
      segment_add_kernel<S, scalar_t><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          gk_slots.data_ptr<S>(), gv_slots.data_ptr<S>(), sorted_slots.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
          dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), kr, vr, static_cast<int>(gk_slots.size(1)), n,
          gk_slots.size(0));
    };
    if (slots_double) {
      launch(double(0));
    } else {
      launch(float(0));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<at::Tensor, at::Tensor> gather_slots(const at::Tensor& k_slots, const at::Tensor& v_slots,
                                                const at::Tensor& index) {
  check_slots(k_slots, "k_slots");
  check_slots(v_slots, "v_slots");
  check_cuda(index, "index");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous(),
              "dtree_stack.gather_slots: index must be a contiguous int64 [n]");
  TORCH_CHECK(k_slots.scalar_type() == v_slots.scalar_type(), "dtree_stack.gather_slots: K and V slot dtypes differ");
  const int64_t n = index.numel();
  auto out_k = at::empty({n, k_slots.size(1), k_slots.size(2)}, k_slots.options());
  auto out_v = at::empty({n, v_slots.size(1), v_slots.size(2)}, v_slots.options());
  if (n == 0) return {out_k, out_v};
  const c10::cuda::CUDAGuard guard(k_slots.device());
  const dim3 grid(static_cast<unsigned>(n), 2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_slots.scalar_type(), "dtree_stack.gather_slots", [&] {
    gather_slots_kernel<scalar_t><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        k_slots.data_ptr<scalar_t>(), v_slots.data_ptr<scalar_t>(), index.data_ptr<int64_t>(),
        out_k.data_ptr<scalar_t>(), out_v.data_ptr<scalar_t>(), k_slots.size(1) * k_slots.size(2),
        v_slots.size(1) * v_slots.size(2), k_slots.size(0));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out_k, out_v};
}

}  // namespace

TORCH_LIBRARY_IMPL(dtree_stack, CUDA, m) {
  m.impl("push_kv", &push_kv);
  m.impl("seed_grad", &seed_grad);
  m.impl("zero_slots", &zero_slots);
  m.impl("segment_add", &segment_add);
  m.impl("gather_slots", &gather_slots);
}

}  // namespace dtree_stack
