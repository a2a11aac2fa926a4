// CUDA kernels of the dtree KV-stack ops (schemas and semantics: kv_stack.cpp).
//
// Each op is one launch for K and V together (blockIdx.y picks the buffer) with a
// grid-stride loop over 16-byte vectors where shapes, strides and pointers allow,
// single elements otherwise. Indexed accumulation uses float atomics, so repeated
// slots are summed (in no fixed order); contiguous ranges cannot repeat and use
// plain read-add-write.

// c10/cuda only (not ATen/cuda/CUDAContext.h, which needs the cuBLAS and cuSPARSE
// headers that a bare CUDA toolkit may lack)
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "kv_stack.h"

namespace dtree {
namespace {

constexpr int kThreads = 256;
constexpr int kVecBytes = 16;

// N elements moved as one aligned load/store.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// A strided [rows, heads, dim] tensor, strides in elements.
template <typename T>
struct Rows {
  const T* ptr;
  int64_t s0, s1, s2;
};

template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  return {static_cast<const T*>(t.const_data_ptr()), t.stride(0), t.stride(1), t.stride(2)};
}

// Grid-stride launches: enough blocks to fill every SM (8 x 256 threads is the
// 2048-thread maximum per SM of sm_80/sm_90), never more blocks than items.
dim3 grid_for(int64_t items) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  const int64_t fill = int64_t(sms) * 8;
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min((items + kThreads - 1) / kThreads, fill))), 2);
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// Whether `t` ([rows, heads, dim]) can be read `vec` elements at a time: unit
// stride on dim, other strides (of dims longer than 1) and the base aligned.
bool vectorizable(const at::Tensor& t, int64_t vec) {
  if (t.size(2) % vec != 0 || (t.size(2) > 1 && t.stride(2) != 1)) return false;
  for (int d = 0; d < 2; ++d) {
    if (t.size(d) > 1 && t.stride(d) % vec != 0) return false;
  }
  return aligned(t.const_data_ptr(), vec * t.element_size());
}

// ---------------------------------------------------------------- push
// Rows t of k/v go to slot start + (slots ? slots[t] : t) of the layer whose
// first element is dst_k/dst_v. T is an unsigned type of the element's size: a
// push is a plain copy, so one kernel per element size serves every dtype.
template <typename T, int VEC, typename index_t>
__global__ void push_kernel(T* __restrict__ dst_k, T* __restrict__ dst_v, Rows<T> src_k, Rows<T> src_v,
                            const index_t* __restrict__ slots, int64_t start, int64_t rows, int64_t heads,
                            int64_t dim, int64_t capacity) {
  T* dst = blockIdx.y ? dst_v : dst_k;
  const Rows<T> src = blockIdx.y ? src_v : src_k;
  const int64_t vecs = dim / VEC, items = rows * heads * vecs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = (i % vecs) * VEC, th = i / vecs, h = th % heads, t = th / heads;
    const int64_t slot = start + (slots ? static_cast<int64_t>(slots[t]) : t);
    CUDA_KERNEL_ASSERT(0 <= slot && slot < capacity);
    const T* s = src.ptr + t * src.s0 + h * src.s1 + j * src.s2;
    T* d = dst + (slot * heads + h) * dim + j;
    if constexpr (VEC == 1) {
      *d = *s;
    } else {
      *reinterpret_cast<Pack<T, VEC>*>(d) = *reinterpret_cast<const Pack<T, VEC>*>(s);
    }
  }
}

template <typename T, typename index_t>
void launch_push(const at::Tensor& stack_k, const at::Tensor& stack_v, int64_t layer, const at::Tensor& k,
                 const at::Tensor& v, int64_t start, const index_t* slots) {
  constexpr int V = kVecBytes / sizeof(T);
  const int64_t rows = k.size(0), heads = k.size(1), dim = k.size(2), capacity = stack_k.size(1);
  T* dk = static_cast<T*>(stack_k.data_ptr()) + layer * stack_k.stride(0);
  T* dv = static_cast<T*>(stack_v.data_ptr()) + layer * stack_v.stride(0);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (vectorizable(k, V) && vectorizable(v, V) && aligned(dk, kVecBytes) && aligned(dv, kVecBytes)) {
    push_kernel<T, V, index_t><<<grid_for(rows * heads * dim / V), kThreads, 0, stream>>>(
        dk, dv, rows_of<T>(k), rows_of<T>(v), slots, start, rows, heads, dim, capacity);
  } else {
    push_kernel<T, 1, index_t><<<grid_for(rows * heads * dim), kThreads, 0, stream>>>(
        dk, dv, rows_of<T>(k), rows_of<T>(v), slots, start, rows, heads, dim, capacity);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void push_sized(const at::Tensor& stack_k, const at::Tensor& stack_v, int64_t layer, const at::Tensor& k,
                const at::Tensor& v, int64_t start, const std::optional<at::Tensor>& slots) {
  if (!slots.has_value()) {
    launch_push<T, int64_t>(stack_k, stack_v, layer, k, v, start, nullptr);
  } else if (slots->scalar_type() == at::kInt) {
    launch_push<T, int32_t>(stack_k, stack_v, layer, k, v, start, slots->const_data_ptr<int32_t>());
  } else {
    launch_push<T, int64_t>(stack_k, stack_v, layer, k, v, start, slots->const_data_ptr<int64_t>());
  }
}

void push_cuda(const at::Tensor& stack_k, const at::Tensor& stack_v, int64_t layer, const at::Tensor& k,
               const at::Tensor& v, int64_t start, const std::optional<at::Tensor>& slots) {
  check_stack_pair(stack_k, stack_v, "kv_push");
  check_rows(stack_k, layer, k, v, start, slots, "kv_push");
  if (k.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(stack_k.device());
  // rows in another dtype are converted first, as Tensor.copy_ would
  const auto dtype = stack_k.scalar_type();
  const at::Tensor kk = k.scalar_type() == dtype ? k : k.to(dtype);
  const at::Tensor vv = v.scalar_type() == dtype ? v : v.to(dtype);
  std::optional<at::Tensor> table;
  if (slots.has_value()) table = slots->contiguous();
  switch (stack_k.element_size()) {
    case 2: push_sized<uint16_t>(stack_k, stack_v, layer, kk, vv, start, table); break;
    case 4: push_sized<uint32_t>(stack_k, stack_v, layer, kk, vv, start, table); break;
    case 8: push_sized<uint64_t>(stack_k, stack_v, layer, kk, vv, start, table); break;
    default: TORCH_CHECK(false, "kv_push: unsupported stack dtype ", dtype);
  }
}

// ---------------------------------------------------------------- accumulate
// dst[0..VEC) += x, element-wise atomic (ATOMIC) or plain read-add-write. dst is
// aligned to min(16, 4 * VEC) bytes.
template <int VEC, bool ATOMIC>
__device__ __forceinline__ void add_floats(float* dst, const float (&x)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int c = 0; c < VEC; c += 4) {
      float4* p = reinterpret_cast<float4*>(dst + c);
      const float4 y = make_float4(x[c], x[c + 1], x[c + 2], x[c + 3]);
      if constexpr (ATOMIC) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(p, y);  // one 16-byte atomic (sm_90+), atomic per element
#else
        atomicAdd(&p->x, y.x);
        atomicAdd(&p->y, y.y);
        atomicAdd(&p->z, y.z);
        atomicAdd(&p->w, y.w);
#endif
      } else {
        float4 o = *p;
        o.x += y.x;
        o.y += y.y;
        o.z += y.z;
        o.w += y.w;
        *p = o;
      }
    }
  } else if constexpr (VEC == 2) {
    float2* p = reinterpret_cast<float2*>(dst);
    const float2 y = make_float2(x[0], x[1]);
    if constexpr (ATOMIC) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      atomicAdd(p, y);
#else
      atomicAdd(&p->x, y.x);
      atomicAdd(&p->y, y.y);
#endif
    } else {
      float2 o = *p;
      o.x += y.x;
      o.y += y.y;
      *p = o;
    }
  } else {
    static_assert(VEC == 1, "add_floats: VEC must be 1, 2 or a multiple of 4");
    if constexpr (ATOMIC) {
      atomicAdd(dst, x[0]);
    } else {
      *dst += x[0];
    }
  }
}

// Rows t of dk/dv are added into slot start + (index ? index[t] : t) of the
// float32 layer whose first element is grad_k/grad_v. Atomic iff indexed.
template <typename scalar_t, int VEC, typename index_t, bool ATOMIC>
__global__ void accumulate_kernel(float* __restrict__ grad_k, float* __restrict__ grad_v, Rows<scalar_t> src_k,
                                  Rows<scalar_t> src_v, const index_t* __restrict__ index, int64_t start,
                                  int64_t rows, int64_t heads, int64_t dim, int64_t capacity) {
  float* dst = blockIdx.y ? grad_v : grad_k;
  const Rows<scalar_t> src = blockIdx.y ? src_v : src_k;
  const int64_t vecs = dim / VEC, items = rows * heads * vecs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = (i % vecs) * VEC, th = i / vecs, h = th % heads, t = th / heads;
    const int64_t slot = start + (index ? static_cast<int64_t>(index[t]) : t);
    CUDA_KERNEL_ASSERT(0 <= slot && slot < capacity);
    const scalar_t* s = src.ptr + t * src.s0 + h * src.s1 + j * src.s2;
    float x[VEC];
    if constexpr (VEC == 1) {
      x[0] = static_cast<float>(*s);
    } else {
      const Pack<scalar_t, VEC> p = *reinterpret_cast<const Pack<scalar_t, VEC>*>(s);
#pragma unroll
      for (int c = 0; c < VEC; ++c) x[c] = static_cast<float>(p.v[c]);
    }
    add_floats<VEC, ATOMIC>(dst + (slot * heads + h) * dim + j, x);
  }
}

template <typename scalar_t, typename index_t, bool ATOMIC>
void launch_accumulate(const at::Tensor& grad_k, const at::Tensor& grad_v, int64_t layer, const at::Tensor& dk,
                       const at::Tensor& dv, int64_t start, const index_t* index) {
  constexpr int V = kVecBytes / sizeof(scalar_t);
  const int64_t rows = dk.size(0), heads = dk.size(1), dim = dk.size(2), capacity = grad_k.size(1);
  float* gk = grad_k.data_ptr<float>() + layer * grad_k.stride(0);
  float* gv = grad_v.data_ptr<float>() + layer * grad_v.stride(0);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // V float32 destinations per vector: 8, 16 or 32 bytes, so float2/float4 accesses
  // are aligned once the layer base is 16-byte aligned
  if (vectorizable(dk, V) && vectorizable(dv, V) && aligned(gk, kVecBytes) && aligned(gv, kVecBytes)) {
    accumulate_kernel<scalar_t, V, index_t, ATOMIC><<<grid_for(rows * heads * dim / V), kThreads, 0, stream>>>(
        gk, gv, rows_of<scalar_t>(dk), rows_of<scalar_t>(dv), index, start, rows, heads, dim, capacity);
  } else {
    accumulate_kernel<scalar_t, 1, index_t, ATOMIC><<<grid_for(rows * heads * dim), kThreads, 0, stream>>>(
        gk, gv, rows_of<scalar_t>(dk), rows_of<scalar_t>(dv), index, start, rows, heads, dim, capacity);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void accumulate_cuda(const at::Tensor& grad_k, const at::Tensor& grad_v, int64_t layer, const at::Tensor& dk,
                     const at::Tensor& dv, int64_t start, const std::optional<at::Tensor>& index) {
  check_stack_pair(grad_k, grad_v, "kv_accumulate");
  TORCH_CHECK(grad_k.scalar_type() == at::kFloat, "kv_accumulate: gradient buffers must be float32, got ",
              grad_k.scalar_type());
  check_rows(grad_k, layer, dk, dv, start, index, "kv_accumulate");
  TORCH_CHECK(dk.scalar_type() == dv.scalar_type(), "kv_accumulate: dK is ", dk.scalar_type(), " but dV is ",
              dv.scalar_type());
  if (dk.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(grad_k.device());
  std::optional<at::Tensor> table;
  if (index.has_value()) table = index->contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dk.scalar_type(), "kv_accumulate", [&] {
    if (!table.has_value()) {
      launch_accumulate<scalar_t, int64_t, false>(grad_k, grad_v, layer, dk, dv, start, nullptr);
    } else if (table->scalar_type() == at::kInt) {
      launch_accumulate<scalar_t, int32_t, true>(grad_k, grad_v, layer, dk, dv, start, table->const_data_ptr<int32_t>());
    } else {
      launch_accumulate<scalar_t, int64_t, true>(grad_k, grad_v, layer, dk, dv, start, table->const_data_ptr<int64_t>());
    }
  });
}

// ---------------------------------------------------------------- zero_grad
// Zeroes `span` bytes at `offset` in each of `layers` layers (`layer_bytes` apart)
// of both buffers, U (1 to 16 bytes) at a time; U divides every size and address.
template <typename U>
__global__ void zero_kernel(char* grad_k, char* grad_v, int64_t layers, int64_t layer_bytes, int64_t offset,
                            int64_t span) {
  char* base = (blockIdx.y ? grad_v : grad_k) + offset;
  const int64_t per_layer = span / int64_t(sizeof(U)), items = layers * per_layer;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t l = i / per_layer, o = i - l * per_layer;
    reinterpret_cast<U*>(base + l * layer_bytes)[o] = U{};
  }
}

template <typename U>
void launch_zero(char* gk, char* gv, int64_t layers, int64_t layer_bytes, int64_t offset, int64_t span) {
  zero_kernel<U><<<grid_for(layers * span / int64_t(sizeof(U))), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      gk, gv, layers, layer_bytes, offset, span);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void zero_grad_cuda(const at::Tensor& grad_k, const at::Tensor& grad_v, int64_t lo, int64_t hi) {
  check_stack_pair(grad_k, grad_v, "kv_zero_grad");
  check_zero_range(grad_k, lo, hi);
  const int64_t es = grad_k.element_size(), layers = grad_k.size(0), layer_bytes = grad_k.stride(0) * es;
  const int64_t offset = lo * grad_k.stride(1) * es, span = (hi - lo) * grad_k.stride(1) * es;
  if (span == 0 || layers == 0) return;
  const c10::cuda::CUDAGuard guard(grad_k.device());
  char* gk = static_cast<char*>(grad_k.data_ptr());
  char* gv = static_cast<char*>(grad_v.data_ptr());
  // the widest store that divides every size and address involved
  auto fits = [&](int64_t u) {
    return layer_bytes % u == 0 && offset % u == 0 && span % u == 0 && aligned(gk, u) && aligned(gv, u);
  };
  if (fits(16)) {
    launch_zero<uint4>(gk, gv, layers, layer_bytes, offset, span);
  } else if (fits(8)) {
    launch_zero<uint2>(gk, gv, layers, layer_bytes, offset, span);
  } else if (fits(4)) {
    launch_zero<uint32_t>(gk, gv, layers, layer_bytes, offset, span);
  } else if (fits(2)) {
    launch_zero<uint16_t>(gk, gv, layers, layer_bytes, offset, span);
  } else {
    launch_zero<uint8_t>(gk, gv, layers, layer_bytes, offset, span);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(dtree, CUDA, m) {
  m.impl("kv_push", TORCH_FN(push_cuda));
  m.impl("kv_accumulate", TORCH_FN(accumulate_cuda));
  m.impl("kv_zero_grad", TORCH_FN(zero_grad_cuda));
}

}  // namespace dtree
