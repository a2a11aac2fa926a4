// The KV-stack ops' schemas (namespace dtree_stack) and the Python module that loads them.
//
// Importing dtree._stack_ops_cuda registers the ops; they are called as
// torch.ops.dtree_stack.<name>. Their contracts, and the torch fallback with the same
// contract, are in dtree/ops/stack_ops.py and dtree/ops/stack_ops_torch.py; the CUDA
// implementations are in stack_ops_cuda.cu. Every slot offset is read on the device
// (slot_lo: a one-element int32/int64 CUDA tensor), so a call's stack ops can be
// captured in a CUDA graph and replayed with other offsets.

#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(dtree_stack, m) {
  // k_slots[lo + t] = rotary(k[t]) (rotary only when cos/sin are given), v_slots[lo + t] = v[t]
  m.def(
      "push_kv(Tensor(a!) k_slots, Tensor(b!) v_slots, Tensor slot_lo, Tensor k, Tensor v, "
      "Tensor? cos, Tensor? sin) -> ()");
  // (grad_slots[lo + t] + g[t]).to(dtype) for K and V; g None: the slots alone
  m.def(
      "seed_grad(Tensor grad_k_slots, Tensor grad_v_slots, Tensor slot_lo, Tensor? gk, Tensor? gv, "
      "int rows, ScalarType k_dtype, ScalarType v_dtype) -> (Tensor, Tensor)");
  // grad_k[:, lo:lo + rows] = 0 and grad_v[:, lo:lo + rows] = 0, every layer
  m.def("zero_slots(Tensor(a!) grad_k, Tensor(b!) grad_v, Tensor slot_lo, int rows) -> ()");
  // grad_slots[sorted_slots[j]] += src[order[j]] for j = 0, 1, ..., one slot's rows in that order
  m.def(
      "segment_add(Tensor(a!) grad_k_slots, Tensor(b!) grad_v_slots, Tensor sorted_slots, Tensor order, "
      "Tensor dk, Tensor dv) -> ()");
  // (k_slots[index], v_slots[index])
  m.def("gather_slots(Tensor k_slots, Tensor v_slots, Tensor index) -> (Tensor, Tensor)");
}

extern "C" {
// `import dtree._stack_ops_cuda` loads this library, whose static initializers run the
// registrations above; the module itself is empty.
PyObject* PyInit__stack_ops_cuda(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_stack_ops_cuda", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
