// pybind11 glue of the CUDA module: turns launcher error codes into Python exceptions.
// Plain C++ (no CUDA, no torch headers): the kernels sit behind launchers.h.
#include <stdexcept>
#include <string>

#include "../bindings.h"
#include "launchers.h"

namespace mtds {
namespace {

void check(int code, const char* what) {
  if (code != 0) {
    throw std::runtime_error(std::string("megatron-tds CUDA ") + what + ": " +
                             cuda::error_string(code));
  }
}

}  // namespace

void run_softmax_forward(const SoftmaxArgs& a, void* stream) {
  check(cuda::launch_softmax_forward(a, stream), "masked softmax forward");
}

void run_softmax_backward(const SoftmaxArgs& a, void* stream) {
  check(cuda::launch_softmax_backward(a, stream), "masked softmax backward");
}

void run_norm_forward(const NormArgs& a, void* stream) {
  check(cuda::launch_norm_forward(a, stream), "layer norm forward");
}

void run_norm_backward(const NormArgs& a, void* stream) {
  check(cuda::launch_norm_backward(a, stream), "layer norm backward");
}

int64_t norm_backward_blocks(int64_t rows, int64_t hidden, int32_t dtype) {
  int64_t blocks = 0;
  check(cuda::norm_backward_blocks(rows, hidden, bind::dtype_of(dtype), &blocks),
        "layer norm backward sizing");
  return blocks;
}

const char* target_description() { return "cuda (sm_80, sm_90 SASS; compute_90 PTX)"; }

}  // namespace mtds

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-tds fused kernels, CUDA (csrc/kernels/cuda)";
  mtds::bind::define(m);
}
