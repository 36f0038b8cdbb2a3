// The greedy pick over an 8-bit LM head in two stages, exactly as the full product would pick it.
//
// With the activations' residual codes (int8_activations.h) each block's integer sum is 256 x the codes'
// products + the residuals' products, so the 8 + 8-bit logit of weight row i is the 8-bit one (codes
// alone, half the integer work) plus W_i . r, where r is the vector of residuals in their units
// (residual x scale / 256). Cauchy-Schwarz bounds that term by ||W_i|| ||r||. So after the 8-bit
// product, only rows whose 8-bit logit plus that bound reaches the largest 8-bit logit minus its bound
// can hold the row's maximum; their tiles are multiplied again with the residuals, by the same tile
// kernel and in the same order as the full product, which gives the same float values, and the pick is
// made among them. On Gemma 3's 262,144-row head the bound leaves a handful of rows (its 8-bit product
// is ~2x faster at 64 activation rows); a row whose bound leaves too many tiles, or whose values are not
// all finite, is left undecided for the caller's full product.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "int8_activations.h"
#include "int8_tiles.h"

namespace folio_int8_dot {

// |v| below 1e30 by its bits (the kernels build with -ffast-math, where std::isfinite may fold away):
// far from overflow, and false for NaN and infinities.
constexpr uint32_t kModerateBits = 0x7149F2CAu;  // the bits of 1e30f
inline bool moderate(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7FFFFFFFu) < kModerateBits;
}

// The bound's factor for activation row m: c with |exact_i - approx_i| <= c * ||W_i|| for every weight
// row i, both sides as computed in float. ||r|| is the residual term's bound; the float rounding of both
// products (each under (B + 3) x 2^-24 of sum |terms| <= ||W_i||_1 amax <= sqrt(K) ||W_i|| amax) is
// covered by 1e-5 sqrt(K) amax, ~3x over; and 0.1% more for the bound's own rounding. Negative: a
// value of the row is not moderate.
inline float bound_factor(const float* x, const QuantizedRows& q, int64_t m, int64_t K) {
  double residual_square = 0.0;
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    if (!moderate(x[m * K + k])) return -1.f;
    amax = std::max(amax, std::fabs(x[m * K + k]));
    const double r = static_cast<double>(q.residuals[m * K + k]) * q.scales[(m * K + k) / BLOCK] / RESIDUAL_STEPS;
    residual_square += r * r;
  }
  return static_cast<float>(1.001 * (std::sqrt(residual_square) + 1e-5 * std::sqrt(static_cast<double>(K)) * amax));
}

// The tiles (ascending) holding every weight row i with approx[i] + c norms[i] >= max_j(approx[j] - c
// norms[j]); false if a value is not moderate or more than max_tiles tiles hold one.
inline bool candidate_tiles(const float* approx, const float* norms, int64_t N, float c, int64_t max_tiles,
                            std::vector<int64_t>& tiles) {
  tiles.clear();
  float floor = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), limit = _mm512_set1_epi32(static_cast<int>(kModerateBits));
  const __m512 factor = _mm512_set1_ps(c);
  __m512 floors = _mm512_set1_ps(floor);
  __mmask16 wild = 0;
  for (; i + 16 <= N; i += 16) {
    const __m512 v = _mm512_loadu_ps(approx + i);
    wild |= _mm512_cmpge_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), magnitude), limit);
    floors = _mm512_max_ps(floors, _mm512_fnmadd_ps(factor, _mm512_loadu_ps(norms + i), v));
  }
  if (wild) return false;
  floor = _mm512_reduce_max_ps(floors);
#endif
  for (; i < N; ++i) {
    if (!moderate(approx[i])) return false;
    floor = std::max(floor, approx[i] - c * norms[i]);
  }
  auto take = [&](int64_t row) {
    const int64_t tile = row / TILE_ROWS;
    if (tiles.empty() || tiles.back() != tile) tiles.push_back(tile);
  };
  i = 0;
#if defined(__AVX512F__)
  floors = _mm512_set1_ps(floor);
  for (; i + 16 <= N; i += 16) {
    const __m512 high = _mm512_fmadd_ps(factor, _mm512_loadu_ps(norms + i), _mm512_loadu_ps(approx + i));
    for (__mmask16 hits = _mm512_cmp_ps_mask(high, floors, _CMP_GE_OQ); hits; hits &= hits - 1) {
      take(i + __builtin_ctz(hits));
      if (static_cast<int64_t>(tiles.size()) > max_tiles) return false;
    }
  }
#endif
  for (; i < N; ++i)
    if (approx[i] + c * norms[i] >= floor) {
      take(i);
      if (static_cast<int64_t>(tiles.size()) > max_tiles) return false;
    }
  return true;
}

// For each row m of x [M, K]: given `approx` [M, N], x's 8-bit product with the tiled weight, and `norms`
// [N], each weight row's Euclidean norm, best[m] = (the maximum of the 8 + 8-bit product's row m, its
// first index, 0) and decided[m] = true; or decided[m] = false where the row is left to the caller.
template <bool SPLIT, typename S>
void greedy_rows(const float* x, int64_t M, int64_t K, const uint8_t* codes, const S* scales, int64_t N,
                 int64_t group, const float* norms, const float* approx, double* best, bool* decided) {
  const QuantizedRows q = quantize_rows(x, M, K, /*with_offsets=*/true, /*exact=*/true);
  const int64_t B = K / BLOCK, G = K / group, tile_count = (N + TILE_ROWS - 1) / TILE_ROWS;
  const std::vector<int32_t> group_of_block = groups_of_blocks(K, group);
  const int64_t max_tiles = std::max<int64_t>(64, tile_count / 16);
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> tiles;
    float out[TILE_ROWS];
    for (int64_t m = begin; m < end; ++m) {
      const float c = bound_factor(x, q, m, K);
      decided[m] = c >= 0.f && candidate_tiles(approx + m * N, norms, N, c, max_tiles, tiles);
      if (!decided[m]) continue;
      float top = -std::numeric_limits<float>::infinity();
      int64_t index = -1;
      for (const int64_t tile : tiles) {
        int8_tile<1, SPLIT, /*EXACT=*/true>(codes + tile * B * INT8_TILE_BLOCK_BYTES, scales + tile * G * TILE_ROWS, q,
                                            group_of_block.data(), m, K, out);
        const int64_t n0 = tile * TILE_ROWS, valid = std::min(TILE_ROWS, N - n0);
        for (int64_t lane = 0; lane < valid; ++lane)
          if (out[lane] > top) top = out[lane], index = n0 + lane;  // the first of equal values stays
      }
      best[3 * m] = top;
      best[3 * m + 1] = static_cast<double>(index);
      best[3 * m + 2] = 0.0;
    }
  });
}

}  // namespace folio_int8_dot
