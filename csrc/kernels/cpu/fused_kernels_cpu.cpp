// CPU twins of the CUDA fused kernels: masked softmax (causal / padding) and LayerNorm /
// RMSNorm, forward and backward, fp32 and bf16 activations. One translation unit, only
// ATen/Parallel.h from torch (at::parallel_for over rows), so a cold build takes seconds.
#include <ATen/Parallel.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "../bindings.h"
#include "layer_norm_cpu.h"
#include "softmax_cpu.h"

namespace mtds {
namespace cpu {

// Entry points per dtype, each cloned per instruction set (MTDS_CLONES): the row templates
// are force-inlined into them, so they are vectorized for AVX-512 / AVX2 / SSE2.
#define MTDS_DEFINE_ENTRIES(IO, suffix)                                                       \
  MTDS_CLONES void softmax_fwd_##suffix(const SoftmaxArgs& a, int64_t r0, int64_t r1,          \
                                        float* buf, uint32_t* wide) {                         \
    softmax_forward_rows<IO>(a, r0, r1, buf, wide);                                           \
  }                                                                                           \
  MTDS_CLONES void softmax_bwd_##suffix(const SoftmaxArgs& a, int64_t r0, int64_t r1) {        \
    softmax_backward_rows<IO>(a, r0, r1);                                                     \
  }                                                                                           \
  MTDS_CLONES void norm_fwd_##suffix(const NormArgs& a, int64_t r0, int64_t r1) {              \
    norm_forward_rows<IO>(a, r0, r1);                                                         \
  }                                                                                           \
  MTDS_CLONES void norm_bwd_##suffix(const NormArgs& a, int64_t r0, int64_t r1, float* acc) {  \
    norm_backward_rows<IO>(a, r0, r1, acc);                                                   \
  }

MTDS_DEFINE_ENTRIES(F32, f32)
MTDS_DEFINE_ENTRIES(BF16, bf16)
#undef MTDS_DEFINE_ENTRIES

MTDS_CLONES void sum_partials(const float* partials, int64_t blocks, int64_t n, float* out) {
  std::fill(out, out + n, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* p = partials + b * 2 * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] += p[j];
  }
}

bool is_bf16(DType dtype) {
  if (dtype == DType::kFloat16) throw std::invalid_argument("the CPU kernels take fp32 or bf16");
  return dtype == DType::kBFloat16;
}

// Rows per parallel task: enough work (~16K elements) to amortize the task overhead.
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace cpu

void run_softmax_forward(const SoftmaxArgs& a, void*) {
  const bool bf16 = cpu::is_bf16(a.dtype);
  const int64_t rows = a.batches * a.heads * a.sq;
  at::parallel_for(0, rows, cpu::grain_rows(a.sk), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(a.sk);  // fp32 scratch row, reused across this task's rows
    std::vector<uint32_t> wide(a.mask != nullptr ? a.sk : 0);  // the mask row, widened
    if (bf16) cpu::softmax_fwd_bf16(a, r0, r1, buf.data(), wide.data());
    else cpu::softmax_fwd_f32(a, r0, r1, buf.data(), wide.data());
  });
}

void run_softmax_backward(const SoftmaxArgs& a, void*) {
  const bool bf16 = cpu::is_bf16(a.dtype);
  const int64_t rows = a.batches * a.heads * a.sq;
  at::parallel_for(0, rows, cpu::grain_rows(a.sk), [&](int64_t r0, int64_t r1) {
    if (bf16) cpu::softmax_bwd_bf16(a, r0, r1);
    else cpu::softmax_bwd_f32(a, r0, r1);
  });
}

void run_norm_forward(const NormArgs& a, void*) {
  const bool bf16 = cpu::is_bf16(a.dtype);
  at::parallel_for(0, a.rows, cpu::grain_rows(a.hidden), [&](int64_t r0, int64_t r1) {
    if (bf16) cpu::norm_fwd_bf16(a, r0, r1);
    else cpu::norm_fwd_f32(a, r0, r1);
  });
}

// dx row by row; dweight/dbias as one fp32 partial per block of rows, summed in block order
// at the end, so the result does not depend on how the threads were scheduled.
void run_norm_backward(const NormArgs& a, void*) {
  const bool bf16 = cpu::is_bf16(a.dtype);
  const int64_t n = a.hidden;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(a.rows, at::get_num_threads()));
  std::vector<float> partials(blocks * 2 * n, 0.0f);  // [blocks, (dweight, dbias), hidden]
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = a.rows * b / blocks, r1 = a.rows * (b + 1) / blocks;
      float* acc = partials.data() + b * 2 * n;
      if (bf16) cpu::norm_bwd_bf16(a, r0, r1, acc);
      else cpu::norm_bwd_f32(a, r0, r1, acc);
    }
  });
  cpu::sum_partials(partials.data(), blocks, n, a.dweight);
  if (a.dbias != nullptr) cpu::sum_partials(partials.data() + n, blocks, n, a.dbias);
}

int64_t norm_backward_blocks(int64_t, int64_t, int32_t) { return 0; }

const char* target_description() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(MTDS_NO_TARGET_CLONES)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "cpu (x86-64-v4: AVX-512)";
  if (__builtin_cpu_supports("x86-64-v3")) return "cpu (x86-64-v3: AVX2+FMA)";
  return "cpu (x86-64 baseline)";
#else
  return "cpu";
#endif
}

}  // namespace mtds

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-tds fused kernels, CPU (csrc/kernels/cpu)";
  mtds::bind::define(m);
}
