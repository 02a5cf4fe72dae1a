// CPU LayerNorm / RMSNorm rows with fp32 statistics (semantics in kernel_args.h).
// Two-pass statistics (mean, then squared deviations) over a row that stays in cache:
// as cheap as one pass here and free of the cancellation of E[x^2] - E[x]^2.
#pragma once

#include <cmath>
#include <cstdint>

#include "../kernel_args.h"
#include "vec_math.h"

namespace mtds {
namespace cpu {

template <class IO>
MTDS_INLINE void norm_forward_row(const typename IO::T* x, const float* w, const float* b,
                                  typename IO::T* y, int64_t n, float eps, bool rms,
                                  float* mean_out, float* rstd_out) {
  float mean = 0.0f;
  if (!rms) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) sum += IO::load(x[j]);
    mean = sum / float(n);
  }
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < n; ++j) {
    const float d = IO::load(x[j]) - mean;
    sq += d * d;
  }
  const float rstd = 1.0f / std::sqrt(sq / float(n) + eps);
  if (b != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] = IO::store((IO::load(x[j]) - mean) * rstd * w[j] + b[j]);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] = IO::store((IO::load(x[j]) - mean) * rstd * w[j]);
  }
  if (mean_out != nullptr) *mean_out = mean;
  *rstd_out = rstd;
}

// dx for one row, and this row's share of dweight / dbias added to acc_w / acc_b:
//   xhat = (x - mean) * rstd, g = dy * w,
//   LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat));  RMSNorm drops mean(g).
template <class IO>
MTDS_INLINE void norm_backward_row(const typename IO::T* dy, const typename IO::T* x,
                                   const float* w, typename IO::T* dx, float mean, float rstd,
                                   int64_t n, bool rms, float* acc_w, float* acc_b) {
  float sum_g = 0.0f, sum_gx = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_gx)
  for (int64_t j = 0; j < n; ++j) {
    const float d = IO::load(dy[j]);
    const float xhat = (IO::load(x[j]) - mean) * rstd;
    const float g = d * w[j];
    sum_g += g;
    sum_gx += g * xhat;
    acc_w[j] += d * xhat;
  }
  if (acc_b != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) acc_b[j] += IO::load(dy[j]);
  }
  const float a = rms ? 0.0f : sum_g / float(n);
  const float c = sum_gx / float(n);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float xhat = (IO::load(x[j]) - mean) * rstd;
    dx[j] = IO::store(rstd * (IO::load(dy[j]) * w[j] - a - xhat * c));
  }
}

template <class IO>
MTDS_INLINE void norm_forward_rows(const NormArgs& a, int64_t r0, int64_t r1) {
  const auto* x = static_cast<const typename IO::T*>(a.x);
  auto* y = static_cast<typename IO::T*>(a.out);
  const int64_t n = a.hidden;
  for (int64_t r = r0; r < r1; ++r) {
    norm_forward_row<IO>(x + r * n, a.weight, a.bias, y + r * n, n, a.eps, a.rms != 0,
                         a.mean == nullptr ? nullptr : a.mean + r, a.rstd + r);
  }
}

// Rows [r0, r1) of the backward, accumulating their dweight/dbias into acc (2 x hidden,
// zeroed by the caller): one such partial per block keeps the sum deterministic.
template <class IO>
MTDS_INLINE void norm_backward_rows(const NormArgs& a, int64_t r0, int64_t r1, float* acc) {
  const auto* dy = static_cast<const typename IO::T*>(a.dy);
  const auto* x = static_cast<const typename IO::T*>(a.x);
  auto* dx = static_cast<typename IO::T*>(a.out);
  const int64_t n = a.hidden;
  float* acc_b = a.dbias == nullptr ? nullptr : acc + n;
  for (int64_t r = r0; r < r1; ++r) {
    const float mean = a.mean == nullptr ? 0.0f : a.mean[r];
    norm_backward_row<IO>(dy + r * n, x + r * n, a.weight, dx + r * n, mean, a.rstd[r], n,
                          a.rms != 0, acc, acc_b);
  }
}

}  // namespace cpu
}  // namespace mtds
