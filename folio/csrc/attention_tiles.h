// The vector pieces of the unquantized decode attention (paged_decode_dense.h): 16 keys at a time,
// transposed once so each query's scores need no per-key reduction, and the per-thread scratch of one
// task (the softmax between them: score_softmax.h). The same tiles in two 8-key halves with AVX2
// alone; plain loops where neither or a compile-time head size is missing.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "paged_slots.h"

namespace dense {

constexpr int64_t kTile = 16;        // keys per tile: one AVX-512 vector of float32 scores

// Calls f(std::integral_constant<int, nq>) for nq in 1..MAX (a runtime count to a template argument).
template <int MAX, typename F>
static inline void with_count(int64_t nq, F&& f) {
  if constexpr (MAX > 1) {
    if (nq < MAX) return with_count<MAX - 1>(nq, std::forward<F>(f));
  }
  f(std::integral_constant<int, MAX>{});
}

#if defined(__AVX512F__)
template <typename T>
static inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {  // bfloat16: the high half of a float32
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// In-register transpose: r[j][d] -> r[d][j], 16 x 16 float32 (64 shuffles).
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // t[i] lane l: r[i][4l], r[i+1][4l], r[i][4l+1], r[i+1][4l+1]
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // r[4k + c] lane l: column 4l + c of rows 4k .. 4k + 3
    const __m512d a = _mm512_castps_pd(t[4 * k]), b = _mm512_castps_pd(t[4 * k + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * k + 2]), d = _mm512_castps_pd(t[4 * k + 3]);
    r[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {  // gather each column's four 128-bit lanes (rows 0-3, 4-7, 8-11, 12-15)
    const __m512 even_lo = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    const __m512 odd_lo = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    const __m512 even_hi = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const __m512 odd_hi = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_f32x4(even_lo, even_hi, 0x88);       // column c
    t[4 + c] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88);     // column 4 + c
    t[8 + c] = _mm512_shuffle_f32x4(even_lo, even_hi, 0xdd);   // column 8 + c
    t[12 + c] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xdd);    // column 12 + c
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Scores of NQ queries (rows of q, stride qs) against one transposed tile kt [D][16] -> s (stride ss).
// Two accumulators per query (even and odd dims) so even 1-3 queries keep the FMA pipes busy.
template <int64_t D, int NQ>
static inline void score_block(const float* kt, const float* q, int64_t qs, float* s, int64_t ss) {
  __m512 even[NQ], odd[NQ];
  for (int i = 0; i < NQ; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kTile), k1 = _mm512_loadu_ps(kt + (d + 1) * kTile);
    for (int i = 0; i < NQ; ++i) {
      even[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * qs + d]), k0, even[i]);
      odd[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * qs + d + 1]), k1, odd[i]);
    }
  }
  for (int i = 0; i < NQ; ++i) _mm512_storeu_ps(s + i * ss, _mm512_add_ps(even[i], odd[i]));
}

// acc[i][from, from + D) += sum_j p[i][j] * V_j[from, from + D) for NQ queries over n <= 16 rows of V
// (float32), acc in registers.
template <int64_t D, int NQ>
static inline void accumulate_block(const float* const* vrows, int64_t n, const float* p, int64_t ps, float* acc,
                                    int64_t as, int64_t from) {
  constexpr int64_t VD = D / 16;
  __m512 a[NQ][VD];
  for (int i = 0; i < NQ; ++i)
    for (int64_t v = 0; v < VD; ++v) a[i][v] = _mm512_loadu_ps(acc + i * as + from + v * 16);
  for (int64_t j = 0; j < n; ++j) {
    __m512 row[VD];
    for (int64_t v = 0; v < VD; ++v) row[v] = _mm512_loadu_ps(vrows[j] + from + v * 16);
    for (int i = 0; i < NQ; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * ps + j]);
      for (int64_t v = 0; v < VD; ++v) a[i][v] = _mm512_fmadd_ps(w, row[v], a[i][v]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int64_t v = 0; v < VD; ++v) _mm512_storeu_ps(acc + i * as + from + v * 16, a[i][v]);
}

#elif defined(__AVX2__)
template <typename T>
static inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {  // bfloat16: the high half of a float32
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
}

// In-register transpose: r[j][d] -> r[d][j], 8 x 8 float32.
static inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int k = 0; k < 2; ++k) {  // rows 4k .. 4k + 3, per 128-bit lane: columns c of the four rows
    u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// score_block on 8-lane halves of the tile: keys 0-7 and 8-15, even and odd dims apart.
template <int64_t D, int NQ>
static inline void score_block(const float* kt, const float* q, int64_t qs, float* s, int64_t ss) {
  __m256 acc[NQ][2][2];
  for (int i = 0; i < NQ; ++i) acc[i][0][0] = acc[i][0][1] = acc[i][1][0] = acc[i][1][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    const __m256 k00 = _mm256_loadu_ps(kt + d * kTile), k01 = _mm256_loadu_ps(kt + d * kTile + 8);
    const __m256 k10 = _mm256_loadu_ps(kt + (d + 1) * kTile), k11 = _mm256_loadu_ps(kt + (d + 1) * kTile + 8);
    for (int i = 0; i < NQ; ++i) {
      const __m256 even = _mm256_set1_ps(q[i * qs + d]), odd = _mm256_set1_ps(q[i * qs + d + 1]);
      acc[i][0][0] = _mm256_fmadd_ps(even, k00, acc[i][0][0]);
      acc[i][1][0] = _mm256_fmadd_ps(even, k01, acc[i][1][0]);
      acc[i][0][1] = _mm256_fmadd_ps(odd, k10, acc[i][0][1]);
      acc[i][1][1] = _mm256_fmadd_ps(odd, k11, acc[i][1][1]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(s + i * ss + 8 * h, _mm256_add_ps(acc[i][h][0], acc[i][h][1]));
}

// accumulate_block for dims [from, from + CHUNK) of acc: CHUNK / 8 registers a query.
template <int64_t CHUNK, int NQ>
static inline void accumulate_block(const float* const* vrows, int64_t n, const float* p, int64_t ps, float* acc,
                                    int64_t as, int64_t from) {
  constexpr int64_t VD = CHUNK / 8;
  __m256 a[NQ][VD];
  for (int i = 0; i < NQ; ++i)
    for (int64_t v = 0; v < VD; ++v) a[i][v] = _mm256_loadu_ps(acc + i * as + from + v * 8);
  for (int64_t j = 0; j < n; ++j) {
    __m256 row[VD];
    for (int64_t v = 0; v < VD; ++v) row[v] = _mm256_loadu_ps(vrows[j] + from + v * 8);
    for (int i = 0; i < NQ; ++i) {
      const __m256 w = _mm256_set1_ps(p[i * ps + j]);
      for (int64_t v = 0; v < VD; ++v) a[i][v] = _mm256_fmadd_ps(w, row[v], a[i][v]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int64_t v = 0; v < VD; ++v) _mm256_storeu_ps(acc + i * as + from + v * 8, a[i][v]);
}
#endif

// The vector tiles need AVX-512 (or AVX2) and a head size that is a whole number of 16-float vectors.
template <int64_t HEAD_DIM>
constexpr bool kVectorTiles =
#if defined(__AVX512F__) || defined(__AVX2__)
    HEAD_DIM > 0 && HEAD_DIM % 16 == 0;
#else
    false;
#endif

// Per-thread scratch of one task.
struct Scratch {
  std::vector<float> q, scores, acc, kt, vt, totals;
  std::vector<int64_t> slots;
};

// Scores s[i][j] (stride ss) of queries q (nq x D, stride D) against the tile's keys at `slots` (n of
// them, padded to 16 with the last one), one KV head's rows of the cache k.
template <typename T, int64_t HEAD_DIM>
static inline void score_tile(const T* k, const int64_t* slots, int64_t n, int64_t row_stride, const float* q,
                              int64_t nq, int64_t D, float* s, int64_t ss, Scratch& w) {
#if defined(__AVX512F__)
  if constexpr (kVectorTiles<HEAD_DIM>) {
    for (int64_t c = 0; c < HEAD_DIM / 16; ++c) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j) r[j] = load16(k + slots[j] * row_stride + c * 16);
      transpose16(r);
      for (int d = 0; d < 16; ++d) _mm512_storeu_ps(w.kt.data() + (c * 16 + d) * kTile, r[d]);
    }
    constexpr int BLOCK = 6;  // 12 accumulators
    int64_t i = 0;
    for (; i + BLOCK <= nq; i += BLOCK) score_block<HEAD_DIM, BLOCK>(w.kt.data(), q + i * D, D, s + i * ss, ss);
    if (i < nq) {
      with_count<BLOCK - 1>(nq - i, [&](auto count) {
        score_block<HEAD_DIM, decltype(count)::value>(w.kt.data(), q + i * D, D, s + i * ss, ss);
      });
    }
    return;
  }
#elif defined(__AVX2__)
  if constexpr (kVectorTiles<HEAD_DIM>) {
    for (int64_t c = 0; c < HEAD_DIM / 8; ++c)
      for (int half = 0; half < 2; ++half) {
        __m256 r[8];
        for (int j = 0; j < 8; ++j) r[j] = load8(k + slots[8 * half + j] * row_stride + c * 8);
        transpose8(r);
        for (int d = 0; d < 8; ++d) _mm256_storeu_ps(w.kt.data() + (c * 8 + d) * kTile + 8 * half, r[d]);
      }
    constexpr int BLOCK = 3;  // 12 accumulators
    int64_t i = 0;
    for (; i + BLOCK <= nq; i += BLOCK) score_block<HEAD_DIM, BLOCK>(w.kt.data(), q + i * D, D, s + i * ss, ss);
    if (i < nq) {
      with_count<BLOCK - 1>(nq - i, [&](auto count) {
        score_block<HEAD_DIM, decltype(count)::value>(w.kt.data(), q + i * D, D, s + i * ss, ss);
      });
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* krow = k + slots[j] * row_stride;
    for (int64_t i = 0; i < nq; ++i) {
      const float* qi = q + i * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qi[d] * to_float(krow[d]);
      s[i * ss + j] = dot;
    }
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// acc[i] (stride HEAD_DIM) += sum_j p[i][j] * V_j for nq queries over n rows of V, CHUNK dims and
// BLOCK queries (accumulate_block) at a time.
template <int64_t HEAD_DIM, int64_t CHUNK, int BLOCK>
static inline void accumulate_chunks(const float* const* rows, int64_t n, const float* p, int64_t ps, int64_t nq,
                                     float* acc) {
  for (int64_t from = 0; from < HEAD_DIM; from += CHUNK) {
    int64_t i = 0;
    for (; i + BLOCK <= nq; i += BLOCK)
      accumulate_block<CHUNK, BLOCK>(rows, n, p + i * ps, ps, acc + i * HEAD_DIM, HEAD_DIM, from);
    if (i < nq) {
      with_count<BLOCK>(nq - i, [&](auto count) {
        accumulate_block<CHUNK, decltype(count)::value>(rows, n, p + i * ps, ps, acc + i * HEAD_DIM, HEAD_DIM, from);
      });
    }
  }
}
#endif

// acc[i] (stride D) += sum_j p[i][j] * V_j over the tile's n values at `slots`.
template <typename T, int64_t HEAD_DIM>
static inline void accumulate_tile(const T* v, const int64_t* slots, int64_t n, int64_t row_stride, const float* p,
                                   int64_t ps, int64_t nq, int64_t D, float* acc, Scratch& w) {
#if defined(__AVX512F__)
  if constexpr (kVectorTiles<HEAD_DIM>) {
    const float* rows[kTile];
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        rows[j] = v + slots[j] * row_stride;
      } else {  // widened once per tile, not once per block of queries
        float* wide = w.vt.data() + j * HEAD_DIM;
        const T* vrow = v + slots[j] * row_stride;
        for (int64_t c = 0; c < HEAD_DIM / 16; ++c) _mm512_storeu_ps(wide + c * 16, load16(vrow + c * 16));
        rows[j] = wide;
      }
    }
    // Dims 64 at a time (4 registers a query), as many queries as leave a register for each one's
    // weight and each V chunk: every V value loaded then serves BLOCK FMAs. 256 dims whole held one
    // query's 16 accumulators and no V, so each FMA loaded its V value again (Gemma 3's prefill
    // attention 1.24x, in one process).
    constexpr int64_t CHUNK = HEAD_DIM % 64 == 0 ? 64 : HEAD_DIM, VD = CHUNK / 16;
    constexpr int BLOCK = static_cast<int>(std::max<int64_t>(1, (32 - VD) / (VD + 1)));
    accumulate_chunks<HEAD_DIM, CHUNK, BLOCK>(rows, n, p, ps, nq, acc);
    return;
  }
#elif defined(__AVX2__)
  if constexpr (kVectorTiles<HEAD_DIM>) {
    const float* rows[kTile];
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        rows[j] = v + slots[j] * row_stride;
      } else {  // widened once per tile, not once per block of queries
        float* wide = w.vt.data() + j * HEAD_DIM;
        const T* vrow = v + slots[j] * row_stride;
        for (int64_t c = 0; c < HEAD_DIM / 8; ++c) _mm256_storeu_ps(wide + c * 8, load8(vrow + c * 8));
        rows[j] = wide;
      }
    }
    // dims in chunks of up to 64 (8 registers a query), two queries at a time: <= 16 accumulators' worth
    constexpr int64_t CHUNK = HEAD_DIM < 64 ? HEAD_DIM : 64;
    constexpr int BLOCK = CHUNK == 64 ? 1 : 2;
    accumulate_chunks<HEAD_DIM, CHUNK, BLOCK>(rows, n, p, ps, nq, acc);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* vrow = v + slots[j] * row_stride;
    for (int64_t i = 0; i < nq; ++i) {
      const float weight = p[i * ps + j];
      float* a = acc + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += weight * to_float(vrow[d]);
    }
  }
}

}  // namespace dense
