// Activations as the int8 dot-product kernels (int8_dot.cpp) take them: each row quantized to int8 in
// blocks of 32, with one float scale per block, the exact block sums, and the rounding error coded in
// 8 more bits. Shared helpers for those kernels.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace folio_int8_dot {

constexpr int64_t BLOCK = 32;  // activation block: one int8 scale per 32 values
constexpr int64_t HALF = BLOCK / 2;
// The kernels also take each activation's rounding error, in 1/256ths of the block's step: x ~
// scale * (code + residual / 256), 15 significant bits instead of 8. Activations have outlier channels
// (up to ~4000x the median on smollm2), and a block holding one leaves its other values a few steps
// of 8-bit codes. On smollm2 that was 1-2% error per layer, and next-token distributions ~10x further
// from fp32 than bf16's (development measurements); with the residual the difference is negligible
// (tests/oracle/test_packed_gguf_weights.py). At one activation row the doubled integer products cost
// no measurable time (loading and unpacking the weights dominates); at many rows they do, which is
// part of where the callers switch to a GEMM.
// `exact = false` leaves the residuals zero: 8-bit activations, as llama.cpp's Q8 ones, for callers
// who trade that accuracy for half the integer products (the kernels then skip the residual's).
constexpr float RESIDUAL_STEPS = 256.f;

struct QuantizedRows {            // x [M, K] as int8 blocks
  std::vector<int8_t> codes;      // [M, K]
  std::vector<int8_t> residuals;  // [M, K]: x - codes * scale in steps of scale / 256 (empty unless exact)
  std::vector<float> scales;      // [M, K / 32]
  // [M, K / 32]: what one unit of a block's integer dot product is worth: scale / 256 with the
  // residuals (the sum is 256 * codes' products + residuals'), scale without.
  std::vector<float> steps;
  std::vector<float> sums;        // [M, K / 32]: exact sums of x per block, for the 4-bit mins
  // For the 8-bit kernel, whose weight bytes are code + 128, so that a dot product carries 128 times
  // the activations' sum: the value each half block's [M, K / 16] and each block's [M, K / 32] integer
  // sum starts from to take it back out, in the same units.
  std::vector<int32_t> half_starts;
  std::vector<int32_t> block_starts;
  // [M, K], filled only where the tiles multiply 16-bit pairs (kWordProducts): each value as one 16-bit
  // integer, 256 * code + residual with the residuals, else the code (|value| <= 32,639).
  std::vector<int16_t> words;
};

// Whether the 8-bit tiles multiply 16-bit pairs (vpmaddwd) for want of AVX-512 VNNI's vpdpbusd: AVX2
// machines (Zen 3, most laptops). vpmaddubsw, AVX2's byte product, would saturate its 16-bit pair sums
// on their code + 128 bytes; 16-bit words are exact and take the residual in the same product, so that
// path does one multiply where vpdpbusd does two. The 4- and 5-bit tiles' codes (0..31) are small
// enough for vpmaddubsw (int4_tiles.h).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kWordProducts = false;
#elif defined(__AVX2__)
constexpr bool kWordProducts = true;
#else
constexpr bool kWordProducts = false;
#endif

// Rows of x split between the threads once there are enough values to pay for it.
constexpr int64_t kQuantizeGrain = 16384;

// What quantizing one block of 32 values gives besides its codes (and residuals): its scale, its sum,
// and its halves' integer totals (256 * codes + residuals with residuals, else codes).
struct BlockCodes {
  float scale, sum;
  int32_t half_totals[2];
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// A block 16 lanes at a time; false (nothing written) for a block too small to scale by its inverse
// (amax below ~1e-30), which quantize_block then takes.
template <typename T>
inline bool quantize_block_fast(const T* src, bool exact, int8_t* codes, int8_t* residuals, BlockCodes& out) {
  const __m512 v[2] = {load16(src), load16(src + HALF)};
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
  if (amax < 1e-30f) return false;
  out.scale = amax / 127.f;
  out.sum = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
  const __m512 inverse = _mm512_set1_ps(1.f / out.scale);
  for (int h = 0; h < 2; ++h) {
    const __m512 scaled = _mm512_mul_ps(v[h], inverse);
    const __m512i code = _mm512_cvtps_epi32(scaled);  // to nearest even, as std::nearbyint
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + h * HALF), _mm512_cvtsepi32_epi8(code));
    int32_t total = _mm512_reduce_add_epi32(code);
    if (exact) {
      const __m512 error = _mm512_mul_ps(_mm512_sub_ps(scaled, _mm512_cvtepi32_ps(code)), _mm512_set1_ps(RESIDUAL_STEPS));
      const __m512i residual = _mm512_max_epi32(_mm512_cvtps_epi32(error), _mm512_set1_epi32(-127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(residuals + h * HALF), _mm512_cvtsepi32_epi8(residual));
      total = 256 * total + _mm512_reduce_add_epi32(_mm512_min_epi32(residual, _mm512_set1_epi32(127)));
    }
    out.half_totals[h] = total;
  }
  return true;
}
#elif defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float lanes_sum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
// The AVX-512 version's steps 8 lanes at a time; the codes (|code| <= 127) narrow by a plain loop.
template <typename T>
inline bool quantize_block_fast(const T* src, bool exact, int8_t* codes, int8_t* residuals, BlockCodes& out) {
  const __m256 v[4] = {load8(src), load8(src + 8), load8(src + 16), load8(src + 24)};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const float amax = lanes_max(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                             _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude))));
  if (amax < 1e-30f) return false;
  out.scale = amax / 127.f;
  out.sum = lanes_sum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  const __m256 inverse = _mm256_set1_ps(1.f / out.scale);
  alignas(32) int32_t code_lanes[BLOCK], residual_lanes[BLOCK];
  for (int r = 0; r < 4; ++r) {
    const __m256 scaled = _mm256_mul_ps(v[r], inverse);
    const __m256i code = _mm256_cvtps_epi32(scaled);  // to nearest even, as std::nearbyint
    _mm256_store_si256(reinterpret_cast<__m256i*>(code_lanes + 8 * r), code);
    if (exact) {
      const __m256 error = _mm256_mul_ps(_mm256_sub_ps(scaled, _mm256_cvtepi32_ps(code)), _mm256_set1_ps(RESIDUAL_STEPS));
      const __m256i residual = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(error), _mm256_set1_epi32(-127)),
                                                _mm256_set1_epi32(127));
      _mm256_store_si256(reinterpret_cast<__m256i*>(residual_lanes + 8 * r), residual);
    }
  }
  out.half_totals[0] = out.half_totals[1] = 0;
  for (int64_t j = 0; j < BLOCK; ++j) {
    codes[j] = static_cast<int8_t>(code_lanes[j]);
    int32_t total = code_lanes[j];
    if (exact) {
      residuals[j] = static_cast<int8_t>(residual_lanes[j]);
      total = 256 * total + residual_lanes[j];
    }
    out.half_totals[j / HALF] += total;
  }
  return true;
}
#else
template <typename T>
inline bool quantize_block_fast(const T*, bool, int8_t*, int8_t*, BlockCodes&) {
  return false;
}
#endif

// The same, for any block, one value at a time.
template <typename T>
inline void quantize_block(const T* src, bool exact, int8_t* codes, int8_t* residuals, BlockCodes& out) {
  float amax = 0.f, sum = 0.f;
  for (int64_t j = 0; j < BLOCK; ++j) {
    const float v = static_cast<float>(src[j]);
    amax = std::max(amax, std::fabs(v));
    sum += v;
  }
  out.scale = amax / 127.f;
  out.sum = sum;
  // 1 / scale overflows (or flushes) for blocks below ~1e-37; those divide in double (rare, slower).
  const bool tiny = amax < 1e-30f;
  const float inverse = out.scale > 0.f ? 1.f / out.scale : 0.f;
  out.half_totals[0] = out.half_totals[1] = 0;
  for (int64_t j = 0; j < BLOCK; ++j) {
    const float v = static_cast<float>(src[j]);
    const float scaled = !tiny ? v * inverse : (amax > 0.f ? static_cast<float>(127.0 * v / amax) : 0.f);
    const float code = std::nearbyint(scaled);
    codes[j] = static_cast<int8_t>(code);
    int32_t total = static_cast<int32_t>(code);
    if (exact) {
      const float residual = std::nearbyint((scaled - code) * RESIDUAL_STEPS);  // |scaled - code| <= 1/2
      residuals[j] = static_cast<int8_t>(std::clamp(residual, -127.f, 127.f));
      total = 256 * total + residuals[j];
    }
    out.half_totals[j / HALF] += total;
  }
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K, bool with_offsets, bool exact = true) {
  const int64_t per_row = K / BLOCK, blocks = M * per_row;
  QuantizedRows q{std::vector<int8_t>(M * K), std::vector<int8_t>(exact ? M * K : 0), std::vector<float>(blocks),
                  std::vector<float>(blocks), std::vector<float>(blocks),
                  std::vector<int32_t>(with_offsets ? 2 * blocks : 0), std::vector<int32_t>(with_offsets ? blocks : 0),
                  std::vector<int16_t>(kWordProducts ? M * K : 0)};
  const float units = exact ? RESIDUAL_STEPS : 1.f;
  at::parallel_for(0, M, std::max<int64_t>(1, kQuantizeGrain / K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * per_row; i < end * per_row; ++i) {
      int8_t* codes = q.codes.data() + i * BLOCK;
      int8_t* residuals = exact ? q.residuals.data() + i * BLOCK : nullptr;
      BlockCodes block;
      if (!quantize_block_fast(x + i * BLOCK, exact, codes, residuals, block))
        quantize_block(x + i * BLOCK, exact, codes, residuals, block);
      q.scales[i] = block.scale;
      q.steps[i] = block.scale / units;
      q.sums[i] = block.sum;
      if (kWordProducts) {
        int16_t* words = q.words.data() + i * BLOCK;
        for (int64_t j = 0; j < BLOCK; ++j)
          words[j] = static_cast<int16_t>(exact ? 256 * codes[j] + residuals[j] : codes[j]);
      }
      if (with_offsets) {
        q.half_starts[2 * i] = -128 * block.half_totals[0];
        q.half_starts[2 * i + 1] = -128 * block.half_totals[1];
        q.block_starts[i] = -128 * (block.half_totals[0] + block.half_totals[1]);
      }
    }
  });
  return q;
}

inline float to_float(const at::Half& h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}
inline float to_float(float f) { return f; }

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline std::vector<int32_t> groups_of_blocks(int64_t K, int64_t group) {
  std::vector<int32_t> g(K / BLOCK + 1);
  for (int64_t b = 0; b <= K / BLOCK; ++b) g[b] = static_cast<int32_t>(std::min(b * BLOCK / group, K / group - 1));
  return g;
}

}  // namespace folio_int8_dot
