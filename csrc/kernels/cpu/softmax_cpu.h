// CPU masked softmax, one row of [batches, heads, sq, sk] at a time (semantics in
// kernel_args.h and docs/kernels.md). Each row is read once into an fp32 scratch row that
// stays in L1/L2, so the input is read once and the output written once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../kernel_args.h"
#include "vec_math.h"

namespace mtds {
namespace cpu {

// Number of leading entries of row i that the causal mask keeps (bottom-right aligned, so
// a query block at the end of a longer key sequence -- a KV cache -- sees all earlier keys).
MTDS_INLINE int64_t causal_valid(int64_t i, int64_t sq, int64_t sk) {
  return std::min(std::max(i + 1 + sk - sq, int64_t(0)), sk);
}

// Scaled, masked scores of one row into buf[0, valid); returns their max. *live counts the
// entries the mask keeps (a row with none is "dead": uniform output, zero gradient).
// The mask bytes are first widened to 32 bits (`wide`, scratch): g++ 12 does not vectorize a
// byte-mask select on float lanes under AVX-512, but vectorizes both of these loops fully.
template <class IO>
MTDS_INLINE float softmax_load_row(const typename IO::T* x, const uint8_t* mask, float* buf,
                                   uint32_t* wide, int64_t valid, float scale, int64_t* live) {
  float mx = -INFINITY;
  if (mask != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < valid; ++j) wide[j] = mask[j];
    int32_t kept = 0;
#pragma omp simd reduction(max : mx) reduction(+ : kept)
    for (int64_t j = 0; j < valid; ++j) {
      const float scaled = IO::load(x[j]) * scale;  // computed either way: a select vectorizes
      const float v = wide[j] != 0 ? kMaskedScore : scaled;
      kept += wide[j] == 0 ? 1 : 0;
      buf[j] = v;
      mx = v > mx ? v : mx;
    }
    *live = kept;
  } else {
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < valid; ++j) {
      const float v = IO::load(x[j]) * scale;
      buf[j] = v;
      mx = v > mx ? v : mx;
    }
    *live = valid;
  }
  return mx;
}

template <class IO>
MTDS_INLINE void softmax_forward_row(const typename IO::T* x, const uint8_t* mask,
                                     typename IO::T* y, uint8_t* dead, float* buf,
                                     uint32_t* wide, int64_t sk, int64_t valid, float scale) {
  int64_t live = 0;
  const float mx = softmax_load_row<IO>(x, mask, buf, wide, valid, scale, &live);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < valid; ++j) {
    const float e = exp_nonpositive(buf[j] - mx);
    buf[j] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < valid; ++j) y[j] = IO::store(buf[j] * inv);
  // Causally excluded tail: probability exactly 0 (IO::store(0) is all-zero bits).
  std::fill(y + valid, y + sk, IO::store(0.0f));
  if (dead != nullptr) *dead = (mask != nullptr && live == 0) ? 1 : 0;
}

// dx = scale * y * (dy - <y, dy>) on the causally kept entries, 0 elsewhere and on dead
// rows (their output does not depend on the input).
template <class IO>
MTDS_INLINE void softmax_backward_row(const typename IO::T* dy, const typename IO::T* y,
                                      typename IO::T* dx, bool is_dead, int64_t sk,
                                      int64_t valid, float scale) {
  if (is_dead) valid = 0;
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < valid; ++j) dot += IO::load(dy[j]) * IO::load(y[j]);
#pragma omp simd
  for (int64_t j = 0; j < valid; ++j) {
    const float yj = IO::load(y[j]);
    dx[j] = IO::store(scale * yj * (IO::load(dy[j]) - dot));
  }
  std::fill(dx + valid, dx + sk, IO::store(0.0f));
}

// Rows [r0, r1) of the forward; row r is (batch, head, i) = (r / (heads*sq), ., r % sq).
template <class IO>
MTDS_INLINE void softmax_forward_rows(const SoftmaxArgs& a, int64_t r0, int64_t r1, float* buf,
                                      uint32_t* wide) {
  const auto* x = static_cast<const typename IO::T*>(a.x);
  auto* y = static_cast<typename IO::T*>(a.out);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r % a.sq;
    const int64_t valid = a.causal ? causal_valid(i, a.sq, a.sk) : a.sk;
    const uint8_t* mask = a.mask == nullptr ? nullptr
        : a.mask + (r / (a.heads * a.sq)) * a.mask_batch_stride + i * a.sk;
    uint8_t* dead = a.dead == nullptr ? nullptr : a.dead + r;
    softmax_forward_row<IO>(x + r * a.sk, mask, y + r * a.sk, dead, buf, wide, a.sk, valid,
                            a.scale);
  }
}

template <class IO>
MTDS_INLINE void softmax_backward_rows(const SoftmaxArgs& a, int64_t r0, int64_t r1) {
  const auto* dy = static_cast<const typename IO::T*>(a.x);
  const auto* y = static_cast<const typename IO::T*>(a.y);
  auto* dx = static_cast<typename IO::T*>(a.out);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t valid = a.causal ? causal_valid(r % a.sq, a.sq, a.sk) : a.sk;
    const bool is_dead = a.dead != nullptr && a.dead[r] != 0;
    softmax_backward_row<IO>(dy + r * a.sk, y + r * a.sk, dx + r * a.sk, is_dead, a.sk, valid,
                             a.scale);
  }
}

}  // namespace cpu
}  // namespace mtds
