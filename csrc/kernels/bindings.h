// pybind11 bindings shared by the CPU and the CUDA module, so both expose the same functions
// with the same arguments (pointers as Python ints, checked by megatron/fused_kernels/ops.py).
// The including translation unit defines the run_* functions declared here.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernel_args.h"

// Hash of the sources this binary was built from (megatron/fused_kernels/build.py passes
// it as an identifier, since flags go through a shell); lets the loader reject stale builds.
#define MTDS_STRINGIFY_(x) #x
#define MTDS_STRINGIFY(x) MTDS_STRINGIFY_(x)
#ifdef MTDS_SOURCE_HASH_ID
#define MTDS_SOURCE_HASH MTDS_STRINGIFY(MTDS_SOURCE_HASH_ID)
#else
#define MTDS_SOURCE_HASH ""
#endif

namespace mtds {

void run_softmax_forward(const SoftmaxArgs& a, void* stream);
void run_softmax_backward(const SoftmaxArgs& a, void* stream);
void run_norm_forward(const NormArgs& a, void* stream);
void run_norm_backward(const NormArgs& a, void* stream);
int64_t norm_backward_blocks(int64_t rows, int64_t hidden, int32_t dtype);
const char* target_description();

namespace bind {

namespace py = pybind11;
using Ptr = uintptr_t;

template <typename P>
inline P* ptr(Ptr p) {
  return reinterpret_cast<P*>(p);
}

inline DType dtype_of(int32_t code) {
  if (code < 0 || code > 2) throw std::invalid_argument("unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

inline void softmax_forward(Ptr x, Ptr mask, Ptr out, Ptr dead, int64_t batches, int64_t heads,
                            int64_t sq, int64_t sk, int64_t mask_batch_stride, float scale,
                            bool causal, int32_t dtype, Ptr stream) {
  SoftmaxArgs a{ptr<const void>(x), nullptr, ptr<const uint8_t>(mask), ptr<void>(out),
                ptr<uint8_t>(dead), batches, heads, sq, sk, mask_batch_stride, scale,
                causal ? 1 : 0, dtype_of(dtype)};
  run_softmax_forward(a, ptr<void>(stream));
}

inline void softmax_backward(Ptr dy, Ptr y, Ptr dead, Ptr dx, int64_t batches, int64_t heads,
                             int64_t sq, int64_t sk, float scale, bool causal, int32_t dtype,
                             Ptr stream) {
  SoftmaxArgs a{ptr<const void>(dy), ptr<const void>(y), nullptr, ptr<void>(dx),
                ptr<uint8_t>(dead), batches, heads, sq, sk, 0, scale, causal ? 1 : 0,
                dtype_of(dtype)};
  run_softmax_backward(a, ptr<void>(stream));
}

inline void norm_forward(Ptr x, Ptr weight, Ptr bias, Ptr out, Ptr mean, Ptr rstd, int64_t rows,
                         int64_t hidden, float eps, bool rms, int32_t dtype, Ptr stream) {
  NormArgs a{ptr<const void>(x), nullptr, ptr<const float>(weight), ptr<const float>(bias),
             ptr<void>(out), ptr<float>(mean), ptr<float>(rstd), nullptr, nullptr, nullptr,
             rows, hidden, 0, eps, rms ? 1 : 0, dtype_of(dtype)};
  run_norm_forward(a, ptr<void>(stream));
}

inline void norm_backward(Ptr dy, Ptr x, Ptr weight, Ptr mean, Ptr rstd, Ptr dx, Ptr dweight,
                          Ptr dbias, Ptr workspace, int64_t blocks, int64_t rows, int64_t hidden,
                          bool rms, int32_t dtype, Ptr stream) {
  NormArgs a{ptr<const void>(x), ptr<const void>(dy), ptr<const float>(weight), nullptr,
             ptr<void>(dx), ptr<float>(mean), ptr<float>(rstd), ptr<float>(dweight),
             ptr<float>(dbias), ptr<float>(workspace), rows, hidden, blocks, 0.0f,
             rms ? 1 : 0, dtype_of(dtype)};
  run_norm_backward(a, ptr<void>(stream));
}

inline void define(py::module_& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("softmax_forward", &softmax_forward, nogil);
  m.def("softmax_backward", &softmax_backward, nogil);
  m.def("norm_forward", &norm_forward, nogil);
  m.def("norm_backward", &norm_backward, nogil);
  m.def("norm_backward_blocks", &norm_backward_blocks,
        "Rows of the [blocks, 2, hidden] fp32 workspace norm_backward needs (0: none).");
  m.def("target", &target_description, "What the module was compiled for / runs on.");
  m.def("source_hash", []() { return std::string(MTDS_SOURCE_HASH); });
}

}  // namespace bind
}  // namespace mtds
