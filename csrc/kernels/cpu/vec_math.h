// Scalar building blocks written so that g++/clang -O3 vectorize the loops that use them:
// branch-free bf16 <-> fp32 conversions and a polynomial exp (std::exp does not vectorize
// without -ffast-math, which we avoid because it would also drop NaN/inf semantics).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// Hot loops are compiled three times (AVX-512, AVX2+FMA, baseline x86-64) and the loader
// picks the best one for the CPU at hand, so one binary (JIT cache or wheel) is both portable
// and fast. Elsewhere (aarch64, other compilers) the plain -O3 build is used.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(MTDS_NO_TARGET_CLONES)
#define MTDS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MTDS_CLONES
#endif

// Row kernels must be inlined into the cloned callers to be compiled for their target.
#define MTDS_INLINE inline __attribute__((always_inline))

namespace mtds {
namespace cpu {

MTDS_INLINE float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

MTDS_INLINE uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// Activation storage types. bf16 is kept as its raw 16 bits; rounding is to nearest even,
// NaN stays NaN -- the same results as c10::BFloat16 / torch's .to(torch.bfloat16).
struct F32 {
  using T = float;
  static MTDS_INLINE float load(float v) { return v; }
  static MTDS_INLINE float store(float v) { return v; }
};

struct BF16 {
  using T = uint16_t;
  static MTDS_INLINE float load(uint16_t v) { return bits_to_float(uint32_t(v) << 16); }
  static MTDS_INLINE uint16_t store(float v) {
    const uint32_t bits = float_to_bits(v);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return v != v ? uint16_t(0x7FC0) : uint16_t(rounded);
  }
};

// exp(x) for x <= 0 (softmax after subtracting the row max), to ~2 ulp:
// x = n ln2 + r with |r| <= ln2/2, exp(r) by the Cephes minimax polynomial, 2^n from the
// exponent bits. Results below ~1e-38 are flushed to exactly 0 so masked entries (-10000)
// and causal entries (-inf) give probability 0, as torch does in fp32. NaN propagates.
MTDS_INLINE float exp_nonpositive(float x) {
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693359375f;
  const float kLn2Lo = -2.12194440e-4f;
  const float kRound = 12582912.0f;  // 1.5 * 2^23: t + kRound rounds t to an integer
  const float xc = x < -87.0f ? -87.0f : (x > 0.0f ? 0.0f : x);
  const float t = xc * kLog2e + kRound;
  const float n = t - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // The low bits of t hold n (offset by kRound's mantissa); build 2^n from them.
  const int32_t k = int32_t(float_to_bits(t) - float_to_bits(kRound));
  const float two_n = bits_to_float(uint32_t(k + 127) << 23);
  const float e = p * two_n;
  return x < -87.0f ? 0.0f : (x != x ? x : e);
}

}  // namespace cpu
}  // namespace mtds
