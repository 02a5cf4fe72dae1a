// CUDA LayerNorm / RMSNorm, forward and backward, fp32 / fp16 / bf16 activations, fp32
// statistics and parameters (semantics in kernel_args.h).
//
// One block per row; each thread keeps kVpt packs of 8 elements of the row in registers, so
// x is read once (16-byte loads) and the statistics use two passes over registers. The
// backward runs a persistent grid: each block walks rows blockIdx.x, + gridDim.x, ... and
// keeps its columns' dweight/dbias partial sums in registers (a thread owns the same columns
// in every row), writing one partial row per block; a small kernel then sums the partials in
// a fixed order (deterministic, no atomics). x and dy are read from memory once.
// Requirements (checked by the Python side): hidden % 8 == 0, hidden <= 8192, 16-byte
// aligned pointers.
#include "common.cuh"
#include "launchers.h"

namespace mtds {
namespace cuda {
namespace {

constexpr int kVec = 8;
constexpr int kMaxThreads = 512;

// 4 packs per thread need more registers (the backward holds x, dy and two accumulators):
// cap those blocks at 256 threads, which lets the compiler use up to 255 registers.
template <int kVpt>
constexpr int max_threads() { return kVpt >= 4 ? 256 : kMaxThreads; }

struct Config {
  int vpt = 0;      // packs per thread: 1, 2 or 4
  int threads = 0;  // multiple of 32, <= kMaxThreads
};

// Fewest packs per thread that keep a block at <= 256 threads, else 2 packs with up to 512
// threads (fp32, whose packs are twice the registers). hidden <= 8192 either way.
// vpt = 0: not supported.
Config choose_config(int64_t hidden, DType dtype) {
  Config c;
  if (hidden <= 0 || hidden % kVec != 0) return c;
  const int64_t packs = hidden / kVec;
  const int max_vpt = dtype == DType::kFloat32 ? 2 : 4;
  int vpt = 1;
  while (vpt < max_vpt && (packs + vpt - 1) / vpt > 256) vpt *= 2;
  const int64_t threads = ((packs + vpt - 1) / vpt + 31) / 32 * 32;
  if (threads > (vpt >= 4 ? 256 : kMaxThreads)) return c;
  c.vpt = vpt;
  c.threads = static_cast<int>(threads);
  return c;
}

template <typename T, int kVpt>
__global__ void __launch_bounds__(max_threads<kVpt>()) norm_forward_kernel(NormArgs a) {
  __shared__ float scratch[64];
  const int64_t row = blockIdx.x, n = a.hidden, packs = n / kVec;
  const T* x = static_cast<const T*>(a.x) + row * n;
  float v[kVpt][kVec];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    const int64_t pk = threadIdx.x + int64_t(k) * blockDim.x;
    if (pk < packs) {
      load_floats<T, kVec>(x + pk * kVec, v[k]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum += v[k][e];
    }
  }
  const float mean = a.rms ? 0.0f : block_sum2(sum, 0.0f, scratch).x / float(n);
  float sq = 0.0f;
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    if (threadIdx.x + int64_t(k) * blockDim.x < packs) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) sq += (v[k][e] - mean) * (v[k][e] - mean);
    }
  }
  const float rstd = rsqrtf(block_sum2(sq, 0.0f, scratch).x / float(n) + a.eps);
  T* y = static_cast<T*>(a.out) + row * n;
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    const int64_t pk = threadIdx.x + int64_t(k) * blockDim.x;
    if (pk < packs) {
      float w[kVec], b[kVec] = {};
      load_floats<float, kVec>(a.weight + pk * kVec, w);
      if (a.bias != nullptr) load_floats<float, kVec>(a.bias + pk * kVec, b);
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[k][e] = (v[k][e] - mean) * rstd * w[e] + b[e];
      store_floats<T, kVec>(y + pk * kVec, v[k]);
    }
  }
  if (threadIdx.x == 0) {
    if (a.mean != nullptr) a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
}

// One row of the backward for this thread's packs: dx, plus its dweight/dbias share.
//   xhat = (x - mean) * rstd, g = dy * w,
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm: without mean(g)).
template <typename T, int kVpt>
__device__ __forceinline__ void norm_backward_row(const NormArgs& a, int64_t row, float* scratch,
                                                  float (&acc_w)[kVpt][kVec],
                                                  float (&acc_b)[kVpt][kVec]) {
  const int64_t n = a.hidden, packs = n / kVec;
  const float mean = a.mean != nullptr ? a.mean[row] : 0.0f, rstd = a.rstd[row];
  const T* x = static_cast<const T*>(a.x) + row * n;
  const T* dy = static_cast<const T*>(a.dy) + row * n;
  Pack<T, kVec> xs[kVpt], gs[kVpt];  // raw 16-bit copies: half the registers of fp32
  float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    const int64_t pk = threadIdx.x + int64_t(k) * blockDim.x;
    if (pk < packs) {
      xs[k] = load_pack<T, kVec>(x + pk * kVec);
      gs[k] = load_pack<T, kVec>(dy + pk * kVec);
      float w[kVec];
      load_floats<float, kVec>(a.weight + pk * kVec, w);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float d = to_float(gs[k].v[e]), xhat = (to_float(xs[k].v[e]) - mean) * rstd;
        sum_g += d * w[e];
        sum_gx += d * w[e] * xhat;
        acc_w[k][e] += d * xhat;
        acc_b[k][e] += d;
      }
    }
  }
  const float2 sums = block_sum2(sum_g, sum_gx, scratch);
  const float mean_g = a.rms ? 0.0f : sums.x / float(n), mean_gx = sums.y / float(n);
  T* dx = static_cast<T*>(a.out) + row * n;
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    const int64_t pk = threadIdx.x + int64_t(k) * blockDim.x;
    if (pk < packs) {
      float w[kVec], out[kVec];
      load_floats<float, kVec>(a.weight + pk * kVec, w);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float xhat = (to_float(xs[k].v[e]) - mean) * rstd;
        out[e] = rstd * (to_float(gs[k].v[e]) * w[e] - mean_g - xhat * mean_gx);
      }
      store_floats<T, kVec>(dx + pk * kVec, out);
    }
  }
}

template <typename T, int kVpt>
__global__ void __launch_bounds__(max_threads<kVpt>()) norm_backward_kernel(NormArgs a) {
  __shared__ float scratch[64];
  float acc_w[kVpt][kVec] = {}, acc_b[kVpt][kVec] = {};
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    norm_backward_row<T, kVpt>(a, row, scratch, acc_w, acc_b);
  }
  const int64_t n = a.hidden, packs = n / kVec;
  float* part = a.workspace + int64_t(blockIdx.x) * 2 * n;  // [dweight | dbias] of this block
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    const int64_t pk = threadIdx.x + int64_t(k) * blockDim.x;
    if (pk < packs) {
      store_floats<float, kVec>(part + pk * kVec, acc_w[k]);
      store_floats<float, kVec>(part + n + pk * kVec, acc_b[k]);
    }
  }
}

// dweight[c] (and dbias[c]) = sum over blocks of the partials, blocks split across
// threadIdx.y and combined in shared memory in a fixed order.
constexpr int kReduceCols = 32, kReduceRows = 8;

__global__ void __launch_bounds__(kReduceCols * kReduceRows) norm_param_reduce_kernel(NormArgs a) {
  __shared__ float sw[kReduceRows][kReduceCols], sb[kReduceRows][kReduceCols];
  const int64_t n = a.hidden, col = int64_t(blockIdx.x) * kReduceCols + threadIdx.x;
  float w = 0.0f, b = 0.0f;
  if (col < n) {
    for (int64_t blk = threadIdx.y; blk < a.blocks; blk += kReduceRows) {
      w += a.workspace[blk * 2 * n + col];
      b += a.workspace[blk * 2 * n + n + col];
    }
  }
  sw[threadIdx.y][threadIdx.x] = w;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    for (int r = 1; r < kReduceRows; ++r) {
      w += sw[r][threadIdx.x];
      b += sb[r][threadIdx.x];
    }
    a.dweight[col] = w;
    if (a.dbias != nullptr) a.dbias[col] = b;
  }
}

// Calls fn.template run<T, kVpt>() for the dtype and packs per thread (a functor rather
// than a C++20 template lambda, so the file also builds as C++17).
template <typename Fn>
int dispatch(DType dtype, int vpt, const Fn& fn) {
  switch (dtype) {
    case DType::kFloat32:
      if (vpt == 1) return fn.template run<float, 1>();
      if (vpt == 2) return fn.template run<float, 2>();
      break;
    case DType::kFloat16:
      if (vpt == 1) return fn.template run<__half, 1>();
      if (vpt == 2) return fn.template run<__half, 2>();
      if (vpt == 4) return fn.template run<__half, 4>();
      break;
    case DType::kBFloat16:
      if (vpt == 1) return fn.template run<__nv_bfloat16, 1>();
      if (vpt == 2) return fn.template run<__nv_bfloat16, 2>();
      if (vpt == 4) return fn.template run<__nv_bfloat16, 4>();
      break;
  }
  return error_code(cudaErrorInvalidValue);
}

struct ForwardLaunch {
  const NormArgs& a;
  Config c;
  cudaStream_t stream;
  template <typename T, int kVpt>
  int run() const {
    norm_forward_kernel<T, kVpt><<<static_cast<unsigned>(a.rows), c.threads, 0, stream>>>(a);
    return error_code(cudaGetLastError());
  }
};

struct BackwardLaunch {
  const NormArgs& a;
  Config c;
  cudaStream_t stream;
  template <typename T, int kVpt>
  int run() const {
    norm_backward_kernel<T, kVpt><<<static_cast<unsigned>(a.blocks), c.threads, 0, stream>>>(a);
    return error_code(cudaGetLastError());
  }
};

struct Occupancy {
  Config c;
  int* per_sm;
  template <typename T, int kVpt>
  int run() const {
    return error_code(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        per_sm, norm_backward_kernel<T, kVpt>, c.threads, 0));
  }
};

}  // namespace

int launch_norm_forward(const NormArgs& a, void* stream) {
  const Config c = choose_config(a.hidden, a.dtype);
  if (c.vpt == 0) return error_code(cudaErrorInvalidValue);
  if (a.rows == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  return dispatch(a.dtype, c.vpt, ForwardLaunch{a, c, s});
}

int norm_backward_blocks(int64_t rows, int64_t hidden, DType dtype, int64_t* blocks) {
  const Config c = choose_config(hidden, dtype);
  *blocks = 0;
  if (c.vpt == 0) return error_code(cudaErrorInvalidValue);
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return error_code(err);
  int per_sm = 0;
  err = static_cast<cudaError_t>(dispatch(dtype, c.vpt, Occupancy{c, &per_sm}));
  if (err != cudaSuccess) return error_code(err);
  const int64_t resident = int64_t(sms) * (per_sm > 0 ? per_sm : 1);
  *blocks = rows < resident ? rows : resident;
  return 0;
}

int launch_norm_backward(const NormArgs& a, void* stream) {
  const Config c = choose_config(a.hidden, a.dtype);
  if (c.vpt == 0 || a.blocks <= 0 || a.workspace == nullptr) return error_code(cudaErrorInvalidValue);
  if (a.rows == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  const int err = dispatch(a.dtype, c.vpt, BackwardLaunch{a, c, s});
  if (err != 0) return err;
  const dim3 grid(static_cast<unsigned>((a.hidden + kReduceCols - 1) / kReduceCols));
  norm_param_reduce_kernel<<<grid, dim3(kReduceCols, kReduceRows), 0, s>>>(a);
  return error_code(cudaGetLastError());
}

}  // namespace cuda
}  // namespace mtds
