// Scalar building blocks of the fused CPU kernels (fused.cpp, fused_layers.cpp), written for
// the vectoriser: no branches (selects only), no calls, reductions over kLanes independent
// accumulators. Internal to those files; they are built with -O3 -fno-math-errno.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// On a function holding such loops: GCC compiles it for AVX-512, for AVX2 + FMA and for the
// baseline, and picks one at load time by the CPU (ifunc). Elsewhere the baseline only.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define WEFT_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define WEFT_VECTOR_CLONES
#endif
// The helpers below inline into such clones (a plain `inline` function of the baseline target
// is not inlined into a function of another target; it would run as a baseline call).
#define WEFT_SIMD_INLINE inline __attribute__((always_inline))

namespace weft::model::simd {

constexpr int kLanes = 16;  // one AVX-512 register of floats

// Cephes-style exp for arguments <= 0 (the softmax after the max is subtracted, the sigmoid of
// -|x|, the Gaussian of GELU's derivative); relative error below 2e-7 in [-87, 0], exactly 0
// below -87 (hidden keys come in as -inf).
WEFT_SIMD_INLINE float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = std::max(x, -87.0f);
  // n = round(x / ln 2) by the 1.5 * 2^23 trick (plain adds, vectorisable without SSE4.1).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return underflow ? 0.0f : y * scale;
}

// erf by the rational approximation Eigen and XLA use for float (odd degree-13 numerator, even
// degree-8 denominator on [-4, 4]; outside, erf is ±1 in float): absolute error below 1e-6.
WEFT_SIMD_INLINE float erf(float x) {
  x = std::min(std::max(x, -4.0f), 4.0f);
  const float x2 = x * x;
  float p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
  p = x2 * p + -2.10102402082508e-06f;
  p = x2 * p + -5.69250639462346e-05f;
  p = x2 * p + -7.34990630326855e-04f;
  p = x2 * p + -2.95459980854025e-03f;
  p = x2 * p + -1.60960333262415e-02f;
  float q = x2 * -1.45660718464996e-05f + -2.13374055278905e-04f;
  q = x2 * q + -1.68282697438203e-03f;
  q = x2 * q + -7.37332916720468e-03f;
  q = x2 * q + -1.42647390514189e-02f;
  return x * p / q;
}

// The logistic function 1 / (1 + e^-x), from exp(-|x|) so the exponent never overflows.
WEFT_SIMD_INLINE float sigmoid(float x) {
  const float e = exp_nonpositive(-std::abs(x));
  return (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

// bf16 <-> fp32 by bit operations (round to nearest even; NaN stays NaN).
WEFT_SIMD_INLINE float load(const float* p, int64_t i) { return p[i]; }
WEFT_SIMD_INLINE float load(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(p[i].x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
WEFT_SIMD_INLINE void store(float* p, int64_t i, float v) { p[i] = v; }
WEFT_SIMD_INLINE void store(c10::BFloat16* p, int64_t i, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  p[i].x = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// Reductions over kLanes interleaved accumulators, folded pairwise at the end: a fixed order
// (the same result whatever the vector width), and no long serial chain of adds.
WEFT_SIMD_INLINE float lane_max(const float* x, int64_t n) {
  float m[kLanes];
  for (int l = 0; l < kLanes; ++l) m[l] = -std::numeric_limits<float>::infinity();
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int l = 0; l < kLanes; ++l) m[l] = m[l] > x[k + l] ? m[l] : x[k + l];
  for (; k < n; ++k) m[0] = m[0] > x[k] ? m[0] : x[k];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) m[l] = m[l] > m[l + w] ? m[l] : m[l + w];
  return m[0];
}

WEFT_SIMD_INLINE float lane_sum(const float* x, int64_t n) {
  float s[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int l = 0; l < kLanes; ++l) s[l] += x[k + l];
  for (; k < n; ++k) s[0] += x[k];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) s[l] += s[l + w];
  return s[0];
}

// Σ a·b.
WEFT_SIMD_INLINE float lane_dot(const float* a, const float* b, int64_t n) {
  float s[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int l = 0; l < kLanes; ++l) s[l] += a[k + l] * b[k + l];
  for (; k < n; ++k) s[0] += a[k] * b[k];
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) s[l] += s[l + w];
  return s[0];
}

// f(T{}) with T = float or c10::BFloat16 per `type` (the caller checked it is one of them).
template <typename F>
void dispatch_float_bf16(c10::ScalarType type, const F& f) {
  if (type == c10::ScalarType::Float)
    f(float{});
  else
    f(c10::BFloat16{});
}

}  // namespace weft::model::simd
