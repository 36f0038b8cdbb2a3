// The greedy pick over an 8-bit LM head in two stages, exactly as the full product would pick it.
//
// With the activations' residual codes (int8_activations.h) each block's integer sum is 256 x the codes'
// products + the residuals' products, so the 8 + 8-bit logit of weight row i is the 8-bit one (codes
// alone, half the integer work) plus W_i . r, where r is the vector of residuals in their units
// (residual x scale / 256). Cauchy-Schwarz bounds that term by ||W_i|| ||r||. So only rows whose 8-bit
// logit plus that bound reaches the largest 8-bit logit minus its bound can hold the row's maximum.
// The 8-bit product runs tile by tile as the full one does, each tile's values folded at once into the
// row's largest lower bound and a list of tiles that may still reach it (no [M, N] logits are written).
// The tiles left are then multiplied again with the residuals, by the same tile kernel and in the same
// order as the full product, which gives the same float values, and the pick is made among them. On
// Gemma 3's 262,144-row head the bound leaves a handful of rows a request; a row whose bound leaves too
// many tiles, or whose values are not all finite, is left undecided for the caller's full product.
// The first pass can instead read the codes' six high bits (six_bit_pass.h): 3/4 of the bytes, for a
// bound wider by the weight's own error; the second pass is the same.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "int8_activations.h"
#include "int8_tiles.h"
#include "six_bit_pass.h"
#include "tile_passes.h"

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
template <typename T>
inline float bound_factor(const T* x, const QuantizedRows& q, int64_t m, int64_t K) {
  double residual_square = 0.0;
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = static_cast<float>(x[m * K + k]);
    if (!moderate(v)) return -1.f;
    amax = std::max(amax, std::fabs(v));
    const double r = static_cast<double>(q.residuals[m * K + k]) * q.scales[(m * K + k) / BLOCK] / RESIDUAL_STEPS;
    residual_square += r * r;
  }
  return static_cast<float>(1.001 * (std::sqrt(residual_square) + 1e-5 * std::sqrt(static_cast<double>(K)) * amax));
}

// With bfloat16 activations the full product's logits are rounded to bfloat16 (int8_dot.cpp gives y in
// x's dtype), and the pick is the first of the rows whose rounded value is the largest. Values that
// round alike lie within a bfloat16 step (at most 2^-7 of them) of each other, so the floor a tile must
// reach is lowered by 2^-6 of its size: every row that may round to the maximum's value stays.
constexpr float kBfloat16Reach = 1.f / 64.f;
template <typename T>
inline float reach(float floor) {
  if constexpr (std::is_same_v<T, at::BFloat16>) return floor - std::fabs(floor) * kBfloat16Reach;
  return floor;
}
template <typename T>
inline float as_output(float v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) return static_cast<float>(at::BFloat16(v));  // round to nearest even
  return v;
}

// How low and how high a tile's values for one activation row may lie once exact: over its `valid`
// lanes, the largest v - margin and v + margin, margin = c ||W_i|| (+ the six-bit pass's weight error,
// its float sum's rounding covered by 1e-4, where `weight_errors` is given). True where a value is not
// moderate. Vectorized for whole tiles: done for every tile and row, a scalar loop took a quarter of a
// 64-row pick over Gemma 3's head.
inline bool tile_reach(const float* v, const float* norms, const float* weight_errors, float c, int64_t valid,
                       float& low, float& high) {
#if defined(__AVX512F__)
  if (valid == TILE_ROWS) {
    const __m512 values = _mm512_loadu_ps(v);
    const __m512 errors =
        weight_errors ? _mm512_mul_ps(_mm512_loadu_ps(weight_errors), _mm512_set1_ps(1 + 1e-4f)) : _mm512_setzero_ps();
    const __m512 margin = _mm512_fmadd_ps(_mm512_set1_ps(c), _mm512_loadu_ps(norms), errors);
    low = _mm512_reduce_max_ps(_mm512_sub_ps(values, margin));
    high = _mm512_reduce_max_ps(_mm512_add_ps(values, margin));
    const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(values), _mm512_set1_epi32(0x7FFFFFFF));
    return _mm512_cmplt_epu32_mask(magnitude, _mm512_set1_epi32(static_cast<int32_t>(kModerateBits))) != 0xFFFF;
  }
#endif
  low = high = -std::numeric_limits<float>::infinity();
  bool wild = false;
  for (int64_t lane = 0; lane < valid; ++lane) {
    const float weight_error = weight_errors ? weight_errors[lane] * (1 + 1e-4f) : 0.f;
    const float margin = c * norms[lane] + weight_error;
    wild = wild || !moderate(v[lane]);
    low = std::max(low, v[lane] - margin);
    high = std::max(high, v[lane] + margin);
  }
  return wild;
}

// A tile that may hold row m's maximum: `high`, the most any of its rows' 8 + 8-bit values can be.
struct Candidate {
  int32_t row;
  int32_t tile;
  float high;
};

// Candidates one thread found for its tiles, and each row's floor so far (max of value - bound): a tile
// whose high is below a row's floor cannot hold its maximum. `wild` rows met a value that is not moderate.
// At `compact_at` candidates those under the floors so far are dropped (a row's floor rises as its
// tiles pass, so early ones mostly fall under it).
struct ThreadFinds {
  std::vector<float> floors;
  std::vector<Candidate> found;
  std::vector<char> wild;
  size_t compact_at = size_t{1} << 14;
  float six_bit_bounds[X_TILE * TILE_ROWS];  // the six-bit pass's weight-error bounds for the tile just made
  WideTile wide;  // the six-bit tile this thread multiplies, widened for VNNI
};

// For each row m of x [M, K] (float32 or bfloat16): best[m] = (the maximum of row m of x's 8 + 8-bit
// product with the tiled weight, in x's dtype, its first index, 0) and decided[m] = true; or
// decided[m] = false where the row is left to the caller's full product. `norms` [N]: each weight row's
// Euclidean norm. The first pass's values (8-bit activations times the 8-bit weight, or its six high
// bits) are folded into each row's floor and candidates as the tiles are multiplied, never stored.
template <bool SPLIT, typename S, typename T>
void greedy_rows(const T* x, int64_t M, int64_t K, const uint8_t* codes, const S* scales, int64_t N,
                 int64_t group, const float* norms, const uint8_t* six_bit, double* best, bool* decided) {
  const QuantizedRows codes_only = quantize_rows(x, M, K, /*with_offsets=*/true, /*exact=*/false);
  const QuantizedRows q = quantize_rows(x, M, K, /*with_offsets=*/true, /*exact=*/true);
  const int64_t B = K / BLOCK, G = K / group, tile_count = (N + TILE_ROWS - 1) / TILE_ROWS;
  const int64_t tile_bytes = B * INT8_TILE_BLOCK_BYTES;
  const bool six = six_bit != nullptr && !SPLIT;
  const std::vector<int32_t> group_of_block = groups_of_blocks(K, group);
  const SixBitRows six_rows = six ? six_bit_rows(codes_only, q, M, K) : SixBitRows{};
  std::vector<float> factor(M);
  for (int64_t m = 0; m < M; ++m) factor[m] = bound_factor(x, q, m, K);

  std::vector<ThreadFinds> finds(at::get_num_threads());
  for (ThreadFinds& f : finds) {
    f.floors.assign(M, -std::numeric_limits<float>::infinity());
    f.wild.assign(M, 0);
  }
  auto tile_fn = [&](int64_t tile, const uint8_t* c, int64_t m0, auto rows, float* out) {
    if (six) {
      six_bit_tile<decltype(rows)::value>(c, scales + tile * G * TILE_ROWS, codes_only, six_rows, group_of_block.data(),
                                          m0, K, out, finds[at::get_thread_num()].six_bit_bounds,
                                          finds[at::get_thread_num()].wide);
    } else {
      int8_tile<decltype(rows)::value, SPLIT, /*EXACT=*/false>(c, scales + tile * G * TILE_ROWS, codes_only,
                                                               group_of_block.data(), m0, K, out);
    }
  };
  auto take = [&](int64_t tile, int64_t m0, int64_t rows, const float* out) {
    ThreadFinds& mine = finds[at::get_thread_num()];
    const int64_t n0 = tile * TILE_ROWS, valid = std::min(TILE_ROWS, N - n0);
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t m = m0 + t;
      float low, high;
      const float* weight_errors = six ? mine.six_bit_bounds + t * TILE_ROWS : nullptr;
      const bool wild = tile_reach(out + t * TILE_ROWS, norms + n0, weight_errors, factor[m], valid, low, high);
      mine.wild[m] |= wild;
      mine.floors[m] = std::max(mine.floors[m], low);
      if (high >= reach<T>(mine.floors[m]))
        mine.found.push_back({static_cast<int32_t>(m), static_cast<int32_t>(tile), high});
    }
    if (mine.found.size() >= mine.compact_at) {
      auto below = [&](const Candidate& f) { return f.high < reach<T>(mine.floors[f.row]); };
      mine.found.erase(std::remove_if(mine.found.begin(), mine.found.end(), below), mine.found.end());
      mine.compact_at = std::max(mine.compact_at, 2 * mine.found.size());
    }
  };
  if (six) {
    over_tile_passes(M, N, six_bit, B * SIX_BIT_BLOCK_BYTES, tile_fn, take);
  } else {
    over_tile_passes(M, N, codes, tile_bytes, tile_fn, take);
  }

  // Each row's floor over all the tiles, and the tiles at or above it, ascending.
  std::vector<float> floors(M, -std::numeric_limits<float>::infinity());
  std::vector<char> undecidable(M, 0);
  for (int64_t m = 0; m < M; ++m) undecidable[m] = factor[m] < 0.f;
  for (const ThreadFinds& f : finds)
    for (int64_t m = 0; m < M; ++m) {
      floors[m] = std::max(floors[m], f.floors[m]);
      undecidable[m] |= f.wild[m];
    }
  std::vector<std::vector<int64_t>> tiles(M);
  for (const ThreadFinds& f : finds)
    for (const Candidate& found : f.found)
      if (found.high >= reach<T>(floors[found.row])) tiles[found.row].push_back(found.tile);
  // The second pass multiplies the tiles left, (row, tile) pairs dealt to the threads, so that one
  // row's many tiles (a close call: the six-bit bound can leave hundreds) are not one thread's work.
  // Past half the tiles the caller's full product is as cheap, and the row is left to it.
  const int64_t max_tiles = std::max<int64_t>(64, tile_count / 2);
  std::vector<int64_t> first_pair(M + 1, 0);
  for (int64_t m = 0; m < M; ++m) {
    std::sort(tiles[m].begin(), tiles[m].end());  // threads took contiguous ranges of tiles, in any order
    decided[m] = !undecidable[m] && static_cast<int64_t>(tiles[m].size()) <= max_tiles;
    first_pair[m + 1] = first_pair[m] + (decided[m] ? static_cast<int64_t>(tiles[m].size()) : 0);
  }
  std::vector<float> values(first_pair[M] * TILE_ROWS);
  at::parallel_for(0, first_pair[M], 4, [&](int64_t begin, int64_t end) {
    int64_t m = std::upper_bound(first_pair.begin(), first_pair.end(), begin) - first_pair.begin() - 1;
    for (int64_t pair = begin; pair < end; ++pair) {
      while (pair >= first_pair[m + 1]) ++m;
      const int64_t tile = tiles[m][pair - first_pair[m]];
      int8_tile<1, SPLIT, /*EXACT=*/true>(codes + tile * tile_bytes, scales + tile * G * TILE_ROWS, q,
                                          group_of_block.data(), m, K, values.data() + pair * TILE_ROWS);
    }
  });
  for (int64_t m = 0; m < M; ++m) {
    if (!decided[m]) continue;
    float top = -std::numeric_limits<float>::infinity();
    int64_t index = -1;
    for (int64_t pair = first_pair[m]; pair < first_pair[m + 1]; ++pair) {
      const int64_t n0 = tiles[m][pair - first_pair[m]] * TILE_ROWS, valid = std::min(TILE_ROWS, N - n0);
      for (int64_t lane = 0; lane < valid; ++lane) {
        const float value = as_output<T>(values[pair * TILE_ROWS + lane]);
        if (value > top) top = value, index = n0 + lane;  // the first of equal values stays
      }
    }
    best[3 * m] = top;
    best[3 * m + 1] = static_cast<double>(index);
    best[3 * m + 2] = 0.0;
  }
}

}  // namespace folio_int8_dot
