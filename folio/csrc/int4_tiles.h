// The 4-bit (and 5-bit) tile kernel of int8_dot.cpp, and what its widened path needs.
//
// 4-bit weights are tiled: rows in tiles of 16, and for each tile and block of 32 values, 256 bytes where
// byte (j, i, t) (j < 4, i < 16, t < 4) holds value 4j + t of the block for row i in its low nibble and
// value 16 + 4j + t in its high one. One 64-byte load then gives, after an AND (or a shift and an AND),
// 16 rows x 4 values, and vpdpbusd against 4 activation bytes broadcast to every lane adds each row's 4
// products into its own lane. 5-bit codes add their fifth bits (int8_tiles.h). Scales and mins are
// float16 [N / 16, G, 16], a tile's 16 rows side by side: W = code * scale + min.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "int8_activations.h"
#include "int8_tiles.h"

namespace folio_int8_dot {

// out[t][i] += the mins' share, sum_g mins[g][i] * (sum of x over group g), for TILE activation rows.
template <int TILE>
inline void add_mins(const at::Half* mins, const float* group_sums, int64_t m0, int64_t G, float* out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  __m512 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm512_loadu_ps(out + t * TILE_ROWS);
  for (int64_t g = 0; g < G; ++g) {
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * TILE_ROWS)));
    for (int t = 0; t < TILE; ++t) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(group_sums[(m0 + t) * G + g]), acc[t]);
  }
  for (int t = 0; t < TILE; ++t) _mm512_storeu_ps(out + t * TILE_ROWS, acc[t]);
#elif defined(__AVX2__)
  for (int half = 0; half < 2; ++half) {
    __m256 acc[TILE];
    for (int t = 0; t < TILE; ++t) acc[t] = _mm256_loadu_ps(out + t * TILE_ROWS + 8 * half);
    for (int64_t g = 0; g < G; ++g) {
      const __m256 m = load_scales8(mins + g * TILE_ROWS + 8 * half);
      for (int t = 0; t < TILE; ++t) acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(group_sums[(m0 + t) * G + g]), acc[t]);
    }
    for (int t = 0; t < TILE; ++t) _mm256_storeu_ps(out + t * TILE_ROWS + 8 * half, acc[t]);
  }
#else
  for (int t = 0; t < TILE; ++t)
    for (int64_t i = 0; i < TILE_ROWS; ++i)
      for (int64_t g = 0; g < G; ++g)
        out[t * TILE_ROWS + i] += to_float(mins[g * TILE_ROWS + i]) * group_sums[(m0 + t) * G + g];
#endif
}

// out[t][i] = y[m0 + t, row i of the tile], for TILE activation rows; EXACT: with the residuals. FIVE:
// 5-bit codes, whose fifth bits (`fifth`, FIFTH_BIT_BLOCK_BYTES a block) add 16 to the nibbles they mark.
template <int TILE, bool EXACT, bool FIVE>
inline void int4_tile(const uint8_t* codes, const uint8_t* fifth, const at::Half* scales, const at::Half* mins,
                      const QuantizedRows& q, const float* group_sums, const int32_t* group_of_block, int64_t m0,
                      int64_t K, int64_t G, float* out) {
  const int64_t B = K / BLOCK;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  __m512 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* block = codes + b * TILE_BLOCK_BYTES;
    prefetch_ahead(block, PREFETCH_BYTES, TILE_BLOCK_BYTES);  // as the AVX2 path: see int8_tiles.h
    prefetch_ahead(scales + group_of_block[b] * TILE_ROWS, PREFETCH_BYTES / 8, 1);
    prefetch_ahead(mins + group_of_block[b] * TILE_ROWS, PREFETCH_BYTES / 8, 1);
    if constexpr (FIVE) prefetch_ahead(fifth + b * FIFTH_BIT_BLOCK_BYTES, PREFETCH_BYTES / 4, FIFTH_BIT_BLOCK_BYTES);
    // Low and high nibbles, codes and residuals apart: up to four vpdpbusd chains per activation row,
    // so consecutive ones do not wait on each other's latency.
    __m512i sums[TILE][2], residual_sums[TILE][2];
    for (int t = 0; t < TILE; ++t)
      sums[t][0] = sums[t][1] = residual_sums[t][0] = residual_sums[t][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i low, high;
      unpack_codes<FIVE>(block, fifth, b, j, low, high);
#pragma GCC unroll 4
      for (int t = 0; t < TILE; ++t) {
        const int64_t at = (m0 + t) * K + b * BLOCK + 4 * j;
        sums[t][0] = _mm512_dpbusd_epi32(sums[t][0], low, _mm512_set1_epi32(four_bytes(q.codes.data() + at)));
        sums[t][1] = _mm512_dpbusd_epi32(sums[t][1], high, _mm512_set1_epi32(four_bytes(q.codes.data() + at + 16)));
        if constexpr (EXACT) {
          const int8_t* r = q.residuals.data() + at;
          residual_sums[t][0] = _mm512_dpbusd_epi32(residual_sums[t][0], low, _mm512_set1_epi32(four_bytes(r)));
          residual_sums[t][1] = _mm512_dpbusd_epi32(residual_sums[t][1], high, _mm512_set1_epi32(four_bytes(r + 16)));
        }
      }
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + group_of_block[b] * TILE_ROWS)));
    for (int t = 0; t < TILE; ++t) {
      // exact: 256 * sum(code * w) + sum(residual * w), in units of step
      const __m512i code_sum = _mm512_add_epi32(sums[t][0], sums[t][1]);
      const __m512i total =
          EXACT ? _mm512_add_epi32(_mm512_slli_epi32(code_sum, 8), _mm512_add_epi32(residual_sums[t][0], residual_sums[t][1]))
                : code_sum;
      const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(q.steps[(m0 + t) * B + b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, acc[t]);
    }
  }
  for (int t = 0; t < TILE; ++t) _mm512_storeu_ps(out + t * TILE_ROWS, acc[t]);
#elif defined(__AVX2__)
  // Byte products (vpmaddubsw: the codes, 0..31, unsigned, times the activations' int8 codes and, EXACT,
  // residuals, both within +-127), added in 16-bit lanes over a block. Each product is at most 31 x 127,
  // so a lane's two products per vpmaddubsw, over the block's 4 registers, stay below 2^15 for one
  // nibble (8 x 3,937); the low and high nibbles' sums are widened apart (vpmaddwd by ones) before
  // they add. Integers, as on VNNI: the same sums, twice the products per instruction of 16-bit words.
  const __m256i ones = _mm256_set1_epi16(1);
  // With one or two activation rows both halves of a block go in one pass (each 64-byte line of codes
  // holds both halves' bytes, read once; a pass per half read each tile twice and issued its prefetches
  // only in the first: smollm2's decode layers 1.09x, in one process); with more, half by half, their
  // accumulators in registers.
  constexpr bool BOTH = TILE <= 2;
  for (int outer = 0; outer < (BOTH ? 1 : 2); ++outer) {
    __m256 acc[BOTH ? 2 : 1][TILE];
    for (int h = 0; h < (BOTH ? 2 : 1); ++h)
      for (int t = 0; t < TILE; ++t) acc[h][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      if (outer == 0) {  // a block's scales and mins: 32 bytes each to its 256 of codes; fifth bits 64
        prefetch_ahead(codes + b * TILE_BLOCK_BYTES, PREFETCH_BYTES, TILE_BLOCK_BYTES);
        prefetch_ahead(scales + group_of_block[b] * TILE_ROWS, PREFETCH_BYTES / 8, 1);
        prefetch_ahead(mins + group_of_block[b] * TILE_ROWS, PREFETCH_BYTES / 8, 1);
        if constexpr (FIVE) prefetch_ahead(fifth + b * FIFTH_BIT_BLOCK_BYTES, PREFETCH_BYTES / 4, FIFTH_BIT_BLOCK_BYTES);
      }
#pragma GCC unroll 2
      for (int inner = 0; inner < (BOTH ? 2 : 1); ++inner) {
        const int half = BOTH ? inner : outer;  // the tile's rows 8 * half to 8 * half + 7
        // [t][nibble]: 16-bit sums, rows 0-7 of the half, two lanes a row
        __m256i sums[TILE][2], residual_sums[TILE][2];
        for (int t = 0; t < TILE; ++t)
          sums[t][0] = sums[t][1] = residual_sums[t][0] = residual_sums[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          __m256i low, high;
          unpack_codes_half<FIVE>(codes + b * TILE_BLOCK_BYTES, fifth, b, j, half, low, high);
#pragma GCC unroll 4
          for (int t = 0; t < TILE; ++t) {
            const int64_t at = (m0 + t) * K + b * BLOCK + 4 * j;
            const int8_t* x = q.codes.data() + at;
            sums[t][0] = _mm256_add_epi16(sums[t][0], _mm256_maddubs_epi16(low, _mm256_set1_epi32(four_bytes(x))));
            sums[t][1] = _mm256_add_epi16(sums[t][1], _mm256_maddubs_epi16(high, _mm256_set1_epi32(four_bytes(x + 16))));
            if constexpr (EXACT) {
              const int8_t* r = q.residuals.data() + at;
              residual_sums[t][0] = _mm256_add_epi16(residual_sums[t][0], _mm256_maddubs_epi16(low, _mm256_set1_epi32(four_bytes(r))));
              residual_sums[t][1] = _mm256_add_epi16(residual_sums[t][1], _mm256_maddubs_epi16(high, _mm256_set1_epi32(four_bytes(r + 16))));
            }
          }
        }
        const __m256 s = load_scales8(scales + group_of_block[b] * TILE_ROWS + 8 * half);
        for (int t = 0; t < TILE; ++t) {
          // a row's lanes added: rows 0-7 in order
          const __m256i code_sum = _mm256_add_epi32(_mm256_madd_epi16(sums[t][0], ones), _mm256_madd_epi16(sums[t][1], ones));
          __m256i total = code_sum;
          if constexpr (EXACT) {
            const __m256i residual_sum =
                _mm256_add_epi32(_mm256_madd_epi16(residual_sums[t][0], ones), _mm256_madd_epi16(residual_sums[t][1], ones));
            total = _mm256_add_epi32(_mm256_slli_epi32(code_sum, 8), residual_sum);
          }
          const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(q.steps[(m0 + t) * B + b]));
          __m256& a = acc[BOTH ? half : 0][t];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, a);
        }
      }
    }
    for (int h = 0; h < (BOTH ? 2 : 1); ++h)
      for (int t = 0; t < TILE; ++t) _mm256_storeu_ps(out + t * TILE_ROWS + 8 * (BOTH ? h : outer), acc[h][t]);
  }
#else
  for (int t = 0; t < TILE; ++t) {
    const int8_t* xq = q.codes.data() + (m0 + t) * K;
    for (int64_t i = 0; i < TILE_ROWS; ++i) {
      float total = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t dot = 0;
        for (int64_t j = 0; j < 4; ++j)
          for (int64_t v = 0; v < 4; ++v) {
            const uint8_t byte = codes[b * TILE_BLOCK_BYTES + j * 64 + i * 4 + v];
            const int64_t low = b * BLOCK + 4 * j + v, high_k = low + 16;
            const int32_t xl = EXACT ? 256 * xq[low] + q.residuals[(m0 + t) * K + low] : xq[low];
            const int32_t xh = EXACT ? 256 * xq[high_k] + q.residuals[(m0 + t) * K + high_k] : xq[high_k];
            int32_t code_low = byte & 0x0F, code_high = byte >> 4;
            if (FIVE) {
              code_low += 16 * fifth_bit(fifth, b, 2 * j, i * 4 + v);
              code_high += 16 * fifth_bit(fifth, b, 2 * j + 1, i * 4 + v);
            }
            dot += code_low * xl + code_high * xh;
          }
        total += to_float(scales[group_of_block[b] * TILE_ROWS + i]) * q.steps[(m0 + t) * B + b] * static_cast<float>(dot);
      }
      out[t * TILE_ROWS + i] = total;
    }
  }
#endif
  add_mins<TILE>(mins, group_sums, m0, G, out);
}

// This thread's current tile, widened on its first pass: one for every row count's tile kernel.
struct WidenedTile {
  std::vector<uint8_t> codes;  // the 8-bit tile layout (int8_tiles.h)
  bool symmetric = false;      // codes stored as code - 16 (+ 128), the mins folded in
};
inline WidenedTile& widened_tile() {
  thread_local WidenedTile wide;
  return wide;
}

// Whether every min of a 5-bit tile is -16 * its scale (Q5_0: scale * (code - 16)): the codes then fit
// int8 as code - 16, and the mins' products (~6% of a widened tile's work) fall away.
inline bool mins_are_minus_16_scales(const at::Half* scales, const at::Half* mins, int64_t G) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m512 minus_16 = _mm512_set1_ps(-16.f);
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * TILE_ROWS)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * TILE_ROWS)));
    if (_mm512_cmp_ps_mask(m, _mm512_mul_ps(s, minus_16), _CMP_EQ_OQ) != 0xFFFF) return false;
  }
  return true;
#else
  for (int64_t v = 0; v < G * TILE_ROWS; ++v)
    if (to_float(mins[v]) != -16.f * to_float(scales[v])) return false;
  return true;
#endif
}

}  // namespace folio_int8_dot
