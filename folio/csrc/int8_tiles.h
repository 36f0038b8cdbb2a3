// 8-bit weights tiled for the int8 dot-product kernel (int8_dot.cpp), as the 4-bit ones are: rows in
// tiles of 16, and for each tile and block of 32 values 512 bytes, byte (j, i, t) (j < 8, i < 16, t < 4)
// holding value 4j + t of the block for row i, stored as code + 128 (0..255: vpdpbusd's unsigned
// operand). One 64-byte load is then 16 rows x 4 values, and vpdpbusd against 4 activation bytes
// broadcast to every lane adds each row's 4 products into its own lane: a tile's 16 row sums come out
// in one register, with no horizontal additions (a row-major layout needs one per row, which for a
// 640-wide row costs as much as its products). The + 128 adds 128 * sum(activation codes) to each half
// block's sum, which the activations' `offsets` take back out.
//
// Scales are [N / 16, G, 16] (float16 where the file's are, else float32), a tile's rows side by side;
// groups are 16 (Q6_K: a half block each), 32 (Q8_0, Q5_0) or a multiple of 64.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

#include "int8_activations.h"

namespace folio_int8_dot {

constexpr int64_t INT8_TILE_BLOCK_BYTES = 16 * BLOCK;

inline float scale_at(const at::Half* s, int64_t i) { return to_float(s[i]); }
inline float scale_at(const float* s, int64_t i) { return s[i]; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load_scales(const at::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}
inline __m512 load_scales(const float* s) { return _mm512_loadu_ps(s); }

// out[t * 16 + i] = y[m0 + t, row i of the tile], for TILE activation rows. SPLIT: groups of 16, so each
// half block has its own scale. EXACT: the activations' residuals count (else they are zero, unread).
template <int TILE, bool SPLIT, bool EXACT, typename S>
inline void int8_tile(const uint8_t* codes, const S* scales, const QuantizedRows& q, const int32_t* group_of_block,
                      int64_t m0, int64_t K, float* out) {
  const int64_t B = K / BLOCK;
  __m512 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* block = codes + b * INT8_TILE_BLOCK_BYTES;
    // Per half block, codes and residuals apart: four independent vpdpbusd chains per activation row.
    __m512i sums[TILE][2], residual_sums[TILE][2];
    for (int t = 0; t < TILE; ++t)
      sums[t][0] = sums[t][1] = residual_sums[t][0] = residual_sums[t][1] = _mm512_setzero_si512();
    // Unrolled whole, so every register index is a constant: the accumulators stay in registers.
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i w = _mm512_loadu_si512(block + 64 * j);
      const int half = j / 4;
#pragma GCC unroll 4
      for (int t = 0; t < TILE; ++t) {
        const int64_t at = (m0 + t) * K + b * BLOCK + 4 * j;
        sums[t][half] = _mm512_dpbusd_epi32(sums[t][half], w, _mm512_set1_epi32(four_bytes(q.codes.data() + at)));
        if constexpr (EXACT)
          residual_sums[t][half] =
              _mm512_dpbusd_epi32(residual_sums[t][half], w, _mm512_set1_epi32(four_bytes(q.residuals.data() + at)));
      }
    }
    const S* group_scales = scales + group_of_block[b] * 16;
    const __m512 first = load_scales(group_scales);
    const __m512 second = SPLIT ? load_scales(group_scales + 16) : first;
    for (int t = 0; t < TILE; ++t) {
      const int64_t h = ((m0 + t) * B + b) * 2;
      // 256 * sum((code + 128) * w) + sum((residual + 128) * w) - offset, in units of scale / 256
      __m512i halves[2];
      for (int i = 0; i < 2; ++i)
        halves[i] = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(sums[t][i], 8), residual_sums[t][i]),
                                     _mm512_set1_epi32(q.offsets[h + i]));
      const __m512 x_scale = _mm512_set1_ps(q.scales[(m0 + t) * B + b] / RESIDUAL_STEPS);
      if (SPLIT) {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(halves[0]), _mm512_mul_ps(first, x_scale), acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(halves[1]), _mm512_mul_ps(second, x_scale), acc[t]);
      } else {
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(halves[0], halves[1]));
        acc[t] = _mm512_fmadd_ps(dots, _mm512_mul_ps(first, x_scale), acc[t]);
      }
    }
  }
  for (int t = 0; t < TILE; ++t) _mm512_storeu_ps(out + t * 16, acc[t]);
}
#else
template <int TILE, bool SPLIT, bool EXACT, typename S>
inline void int8_tile(const uint8_t* codes, const S* scales, const QuantizedRows& q, const int32_t* group_of_block,
                      int64_t m0, int64_t K, float* out) {
  const int64_t B = K / BLOCK;
  for (int t = 0; t < TILE; ++t) {
    const int8_t* xq = q.codes.data() + (m0 + t) * K;
    const int8_t* xr = q.residuals.data() + (m0 + t) * K;
    for (int64_t i = 0; i < 16; ++i) {
      float total = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t halves[2] = {0, 0};
        for (int64_t j = 0; j < 8; ++j)
          for (int64_t v = 0; v < 4; ++v) {
            const int32_t w = static_cast<int32_t>(codes[b * INT8_TILE_BLOCK_BYTES + j * 64 + i * 4 + v]) - 128;
            const int64_t k = b * BLOCK + 4 * j + v;
            halves[j / 4] += w * (256 * xq[k] + xr[k]);
          }
        const S* group_scales = scales + group_of_block[b] * 16;
        const float x_scale = q.scales[(m0 + t) * B + b] / RESIDUAL_STEPS;
        if (SPLIT) {
          total += x_scale * (scale_at(group_scales, i) * halves[0] + scale_at(group_scales + 16, i) * halves[1]);
        } else {
          total += x_scale * scale_at(group_scales, i) * static_cast<float>(halves[0] + halves[1]);
        }
      }
      out[t * 16 + i] = total;
    }
  }
}
#endif

}  // namespace folio_int8_dot
