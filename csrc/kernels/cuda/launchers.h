// Host entry points of the CUDA kernels (defined in the .cu files), callable from plain C++:
// no CUDA or torch types cross this boundary. Each returns a cudaError_t value (0 = success).
#pragma once

#include <cstdint>

#include "../kernel_args.h"

namespace mtds {
namespace cuda {

int launch_softmax_forward(const SoftmaxArgs& a, void* stream);
int launch_softmax_backward(const SoftmaxArgs& a, void* stream);
int launch_norm_forward(const NormArgs& a, void* stream);
int launch_norm_backward(const NormArgs& a, void* stream);

// Persistent blocks launch_norm_backward will use on the current device (rows of its
// [blocks, 2, hidden] workspace); 0 when the shape is not supported.
int norm_backward_blocks(int64_t rows, int64_t hidden, DType dtype, int64_t* blocks);

const char* error_string(int code);

}  // namespace cuda
}  // namespace mtds
