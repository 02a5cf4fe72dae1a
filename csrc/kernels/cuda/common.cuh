// Device helpers for the fused kernels: dtype conversion, 16-byte packed loads and stores,
// warp and block reductions. Plain CUDA (no torch headers), so every .cu file compiles with
// nvcc alone; written to build under torch's -D__CUDA_NO_HALF_OPERATORS__ and friends
// (conversions go through the intrinsics, never through implicit operators).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../kernel_args.h"

namespace mtds {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

// Round to nearest even, as torch's .to(dtype) does.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// N elements moved as one aligned access (16 bytes for 8 halves or 4 floats).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& pack) {
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

// Loads N elements as floats; N * sizeof(T) may exceed 16 bytes (fp32 x 8): split then.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  constexpr int kChunk = (16 / int(sizeof(T))) < N ? (16 / int(sizeof(T))) : N;
#pragma unroll
  for (int c = 0; c < N; c += kChunk) {
    const Pack<T, kChunk> pack = load_pack<T, kChunk>(p + c);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) out[c + e] = to_float(pack.v[e]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[N]) {
  constexpr int kChunk = (16 / int(sizeof(T))) < N ? (16 / int(sizeof(T))) : N;
#pragma unroll
  for (int c = 0; c < N; c += kChunk) {
    Pack<T, kChunk> pack;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) pack.v[e] = from_float<T>(in[c + e]);
    store_pack<T, kChunk>(p + c, pack);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Sum of (a, b) over the block, returned to every thread. `scratch` holds 2 * 32 floats;
// the leading __syncthreads makes back-to-back calls safe.
__device__ __forceinline__ float2 block_sum2(float a, float b, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  __syncthreads();
  if (lane == 0) {
    scratch[warp] = a;
    scratch[32 + warp] = b;
  }
  __syncthreads();
  a = lane < warps ? scratch[lane] : 0.0f;
  b = lane < warps ? scratch[32 + lane] : 0.0f;
  return make_float2(warp_sum(a), warp_sum(b));
}

inline int error_code(cudaError_t err) { return static_cast<int>(err); }

}  // namespace cuda
}  // namespace mtds
