// A row of attention scores into softmax weights, vectorized: its maximum, then exp(s - max) in place and
// their sum (the dense kernel, paged_decode_dense.h; the 8-bit cache's maximum, paged_decode.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec_exp.h"

namespace dense {

// The largest of s[0, n), n >= 1. Vectorized by hand: GCC left the plain loop a chain of scalar maxima,
// each waiting on the last: 12% of a 2,048-token smollm2 prefill (its attention 1.29x faster with this).
static inline float max_of(const float* s, int64_t n) {
  int64_t j = 0;
  float peak = s[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 a = _mm512_loadu_ps(s), b = a;
    for (j = 16; j + 32 <= n; j += 32) {  // two chains
      a = _mm512_max_ps(a, _mm512_loadu_ps(s + j));
      b = _mm512_max_ps(b, _mm512_loadu_ps(s + j + 16));
    }
    if (j + 16 <= n) a = _mm512_max_ps(a, _mm512_loadu_ps(s + j)), j += 16;
    peak = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
  }
#elif defined(__AVX2__)
  if (n >= 8) {
    __m256 a = _mm256_loadu_ps(s), b = a;
    for (j = 8; j + 16 <= n; j += 16) {
      a = _mm256_max_ps(a, _mm256_loadu_ps(s + j));
      b = _mm256_max_ps(b, _mm256_loadu_ps(s + j + 8));
    }
    if (j + 8 <= n) a = _mm256_max_ps(a, _mm256_loadu_ps(s + j)), j += 8;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(a, b));
    for (float lane : lanes) peak = std::max(peak, lane);
  }
#endif
  for (; j < n; ++j) peak = std::max(peak, s[j]);
  return peak;
}

// s[0, n) = exp(s - peak) in place; returns their sum.
static inline float exp_sum(float* s, int64_t n, float peak) {
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(peak);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    const __m512 e = folio_vec::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), m));
    _mm512_mask_storeu_ps(s + j, live, e);
    total = _mm512_mask_add_ps(total, live, total, e);
  }
  return _mm512_reduce_add_ps(total);
#elif defined(__AVX2__)
  const __m256 m = _mm256_set1_ps(peak);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = folio_vec::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - peak);
    sum += s[j];
  }
  return sum;
#else
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - peak);
    total += s[j];
  }
  return total;
#endif
}

}  // namespace dense
