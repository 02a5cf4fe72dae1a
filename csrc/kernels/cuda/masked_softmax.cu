// CUDA masked softmax (causal and padding), forward and backward, fp16 / bf16.
//
// One warp per row of sk <= 4096 scores: the row lives in registers (sk / 32 values per
// lane, padded to a power of two at compile time), so the input is read once with 16-byte
// loads and the output written once; max and sum are warp shuffles, no shared memory.
// Causal rows skip loading the excluded tail (about half the reads) and write zeros there.
// Semantics: kernel_args.h and docs/kernels.md. Requirements, checked by the Python side:
// sk % 8 == 0, 16-byte aligned pointers, sq <= sk when causal.
#include <cmath>

#include "common.cuh"
#include "launchers.h"

namespace mtds {
namespace cuda {
namespace {

constexpr int kWarps = 4;  // rows per block
constexpr int kMinLog2 = 5;
constexpr int kMaxLog2 = 12;
constexpr float kLog2e = 1.4426950408889634f;

// Per-lane layout of a row padded to 2^kLog2 columns: kIters packs of kVec elements,
// pack `it` of lane `l` at column (it * 32 + l) * kVec, so a warp's loads are contiguous.
template <typename T, int kLog2>
struct Row {
  static constexpr int kPerLane = (1 << kLog2) / 32;
  static constexpr int kMaxVec = 16 / int(sizeof(T));
  static constexpr int kVec = kPerLane < kMaxVec ? kPerLane : kMaxVec;
  static constexpr int kIters = kPerLane / kVec;
};

__device__ __forceinline__ int64_t causal_valid(int64_t i, int64_t sq, int64_t sk) {
  const int64_t v = i + 1 + sk - sq;
  return v < 0 ? 0 : (v > sk ? sk : v);
}

template <typename T, int kLog2>
__global__ void __launch_bounds__(kWarps * 32) softmax_forward_kernel(SoftmaxArgs a) {
  using R = Row<T, kLog2>;
  const int lane = threadIdx.x;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.y;
  if (row >= a.batches * a.heads * a.sq) return;  // whole warp: shuffles below stay legal
  const int64_t sk = a.sk, i = row % a.sq;
  const int64_t valid = a.causal ? causal_valid(i, a.sq, sk) : sk;
  const T* x = static_cast<const T*>(a.x) + row * sk;
  const uint8_t* mask = a.mask == nullptr ? nullptr
      : a.mask + (row / (a.heads * a.sq)) * a.mask_batch_stride + i * sk;

  // Scores in the exp2 domain (times log2 e): exp2f is one MUFU instruction.
  float v[R::kIters][R::kVec];
  float mx = -INFINITY;
  bool live = false;
#pragma unroll
  for (int it = 0; it < R::kIters; ++it) {
    const int64_t col = (int64_t(it) * 32 + lane) * R::kVec;
    if (col < valid) {
      const Pack<T, R::kVec> p = load_pack<T, R::kVec>(x + col);
      Pack<uint8_t, R::kVec> m = {};
      if (mask != nullptr) m = load_pack<uint8_t, R::kVec>(mask + col);
#pragma unroll
      for (int e = 0; e < R::kVec; ++e) {
        const bool keep = col + e < valid;
        const bool masked = m.v[e] != 0;
        const float s = masked ? kMaskedScore : to_float(p.v[e]) * a.scale;
        v[it][e] = keep ? s * kLog2e : -INFINITY;
        live |= keep && !masked;
        mx = fmaxf(mx, v[it][e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < R::kVec; ++e) v[it][e] = -INFINITY;
    }
  }
  mx = warp_max(mx);  // finite: every row keeps at least one entry (sq <= sk)
  float sum = 0.0f;
#pragma unroll
  for (int it = 0; it < R::kIters; ++it) {
#pragma unroll
    for (int e = 0; e < R::kVec; ++e) {
      v[it][e] = exp2f(v[it][e] - mx);  // exp2f(-inf) == 0
      sum += v[it][e];
    }
  }
  const float inv = 1.0f / warp_sum(sum);
  T* y = static_cast<T*>(a.out) + row * sk;
#pragma unroll
  for (int it = 0; it < R::kIters; ++it) {
    const int64_t col = (int64_t(it) * 32 + lane) * R::kVec;
    if (col < sk) {
      Pack<T, R::kVec> o;
#pragma unroll
      for (int e = 0; e < R::kVec; ++e) o.v[e] = from_float<T>(v[it][e] * inv);
      store_pack<T, R::kVec>(y + col, o);
    }
  }
  if (a.dead != nullptr) {
    const bool any_live = __any_sync(kFullMask, live);
    if (lane == 0) a.dead[row] = (mask != nullptr && !any_live) ? 1 : 0;
  }
}

// dx = scale * y * (dy - <y, dy>) on kept entries; 0 on the causal tail and on dead rows.
// dy and y stay in registers in their 16-bit form (half the registers of fp32 copies).
template <typename T, int kLog2>
__global__ void __launch_bounds__(kWarps * 32) softmax_backward_kernel(SoftmaxArgs a) {
  using R = Row<T, kLog2>;
  const int lane = threadIdx.x;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.y;
  if (row >= a.batches * a.heads * a.sq) return;
  const int64_t sk = a.sk;
  int64_t valid = a.causal ? causal_valid(row % a.sq, a.sq, sk) : sk;
  if (a.dead != nullptr && a.dead[row] != 0) valid = 0;
  const T* dy = static_cast<const T*>(a.x) + row * sk;
  const T* y = static_cast<const T*>(a.y) + row * sk;

  Pack<T, R::kVec> g[R::kIters], p[R::kIters];
  float dot = 0.0f;
#pragma unroll
  for (int it = 0; it < R::kIters; ++it) {
    const int64_t col = (int64_t(it) * 32 + lane) * R::kVec;
    if (col < valid) {
      g[it] = load_pack<T, R::kVec>(dy + col);
      p[it] = load_pack<T, R::kVec>(y + col);
#pragma unroll
      for (int e = 0; e < R::kVec; ++e) {
        if (col + e < valid) dot += to_float(g[it].v[e]) * to_float(p[it].v[e]);
      }
    }
  }
  dot = warp_sum(dot);
  T* dx = static_cast<T*>(a.out) + row * sk;
#pragma unroll
  for (int it = 0; it < R::kIters; ++it) {
    const int64_t col = (int64_t(it) * 32 + lane) * R::kVec;
    if (col < sk) {
      Pack<T, R::kVec> o;
#pragma unroll
      for (int e = 0; e < R::kVec; ++e) {
        float r = 0.0f;
        if (col + e < valid) {
          const float yv = to_float(p[it].v[e]);
          r = a.scale * yv * (to_float(g[it].v[e]) - dot);
        }
        o.v[e] = from_float<T>(r);
      }
      store_pack<T, R::kVec>(dx + col, o);
    }
  }
}

int ceil_log2(int64_t n) {
  int log2 = 0;
  while ((int64_t(1) << log2) < n) ++log2;
  return log2;
}

template <typename T, int kLog2>
int launch_one(const SoftmaxArgs& a, cudaStream_t stream, bool forward) {
  const int64_t rows = a.batches * a.heads * a.sq;
  const dim3 block(32, kWarps);
  const dim3 grid(static_cast<unsigned>((rows + kWarps - 1) / kWarps));
  if (forward) softmax_forward_kernel<T, kLog2><<<grid, block, 0, stream>>>(a);
  else softmax_backward_kernel<T, kLog2><<<grid, block, 0, stream>>>(a);
  return error_code(cudaGetLastError());
}

template <typename T>
int launch_typed(const SoftmaxArgs& a, cudaStream_t stream, bool forward) {
  const int log2 = ceil_log2(a.sk < 32 ? 32 : a.sk);
  switch (log2) {
    case 5: return launch_one<T, 5>(a, stream, forward);
    case 6: return launch_one<T, 6>(a, stream, forward);
    case 7: return launch_one<T, 7>(a, stream, forward);
    case 8: return launch_one<T, 8>(a, stream, forward);
    case 9: return launch_one<T, 9>(a, stream, forward);
    case 10: return launch_one<T, 10>(a, stream, forward);
    case 11: return launch_one<T, 11>(a, stream, forward);
    case 12: return launch_one<T, 12>(a, stream, forward);
    default: return error_code(cudaErrorInvalidValue);
  }
}

int launch(const SoftmaxArgs& a, void* stream, bool forward) {
  static_assert(kMinLog2 == 5 && kMaxLog2 == 12, "update the switch in launch_typed");
  if (a.sk <= 0 || a.sk % 8 != 0 || a.sk > (int64_t(1) << kMaxLog2) || (a.causal && a.sq > a.sk)) {
    return error_code(cudaErrorInvalidValue);
  }
  if (a.batches * a.heads * a.sq == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case DType::kFloat16: return launch_typed<__half>(a, s, forward);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(a, s, forward);
    default: return error_code(cudaErrorInvalidValue);  // fp32 takes the PyTorch path
  }
}

}  // namespace

int launch_softmax_forward(const SoftmaxArgs& a, void* stream) { return launch(a, stream, true); }

int launch_softmax_backward(const SoftmaxArgs& a, void* stream) { return launch(a, stream, false); }

const char* error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace cuda
}  // namespace mtds
