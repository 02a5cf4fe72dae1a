// Arguments shared by the CPU (cpu/) and CUDA (cuda/) fused kernels.
//
// The bindings take raw pointers and sizes (checked by megatron/fused_kernels/ops.py) instead
// of at::Tensor, so neither side includes the heavy torch C++ headers: the CPU module builds
// in seconds, and the CUDA sources compile with nothing but the CUDA toolkit (which is what
// the nvcc compile check in tests/test_fused_build.py relies on).
#pragma once

#include <cstdint>

namespace mtds {

// Element type of the activations; statistics and parameters are always fp32.
enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// The value a masked-out (mask != 0) score takes after scaling, as Megatron's
// attention_mask_func does. Causally excluded entries are -inf instead (probability 0).
constexpr float kMaskedScore = -10000.0f;

// Masked softmax over the last dim of contiguous scores [batches, heads, sq, sk].
//   forward:  out = softmax(mask ? -10000 : x * scale), causal entries j > i + sk - sq -> 0;
//             dead[row] = 1 when a mask was given and hides every non-causal entry of row.
//   backward: out = scale * y * (x - sum(x * y)) with x = dL/dy, 0 on dead rows.
struct SoftmaxArgs {
  const void* x;              // forward: scores; backward: gradient of the probabilities
  const void* y;              // backward: probabilities from the forward
  const uint8_t* mask;        // [mask_batches, 1, sq, sk], nonzero = masked out; may be null
  void* out;                  // forward: probabilities; backward: gradient of the scores
  uint8_t* dead;              // [batches * heads * sq]; may be null
  int64_t batches, heads, sq, sk;
  int64_t mask_batch_stride;  // 0 when one mask serves every batch, else sq * sk
  float scale;
  int32_t causal;
  DType dtype;
};

// LayerNorm / RMSNorm over the last dim of contiguous x [rows, hidden].
//   LayerNorm: y = (x - mean) * rstd * w + b;   RMSNorm (rms = 1): y = x * rstd * w.
//   rstd = 1 / sqrt(var + eps) (LayerNorm) or 1 / sqrt(mean(x^2) + eps) (RMSNorm), in fp32.
struct NormArgs {
  const void* x;         // [rows, hidden] activations
  const void* dy;        // backward: gradient of the output, [rows, hidden]
  const float* weight;   // [hidden]
  const float* bias;     // [hidden]; null for RMSNorm
  void* out;             // forward: y; backward: dx (activation dtype)
  float* mean;           // [rows]; null for RMSNorm
  float* rstd;           // [rows]
  float* dweight;        // backward: [hidden]
  float* dbias;          // backward: [hidden]; null without bias
  float* workspace;      // CUDA backward: [blocks, 2, hidden] per-block partial sums
  int64_t rows, hidden;
  int64_t blocks;        // CUDA backward: persistent blocks (rows of workspace)
  float eps;
  int32_t rms;
  DType dtype;
};

}  // namespace mtds
