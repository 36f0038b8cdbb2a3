// The six high bits of an 8-bit weight's codes in tiles of their own, and the approximate product over
// them that the greedy pick (int8_greedy.h) runs as its first pass in place of the 8-bit one.
//
// An LM head is most of what a small model reads per token at batch 1 (Gemma 3 270M: 178 of ~260 MB),
// and the greedy pick needs only the rows near the top. With code + 128 = 4h + l (h < 64, l < 4), the
// weight W~ = s (4h + 1.5 - 128) differs from W by s (l - 1.5), at most 1.5 s a value, and its tiles
// hold 6 bits a value: the first pass reads 3/4 of the codes. The bound grows by x . (W - W~), at most
// 1.5 sum_g s_ig ||x_g||_1, which the pass accumulates beside each value from the scales it reads anyway.
// On the catalog's Q8_0 heads (codes over the full 8 bits) the second pass then keeps a median of 2
// tiles a row (Gemma 3: 16,384 tiles, 86 at the 99th percentile; smollm2: 3,072, 116), against 4 and 6
// with a Cauchy-Schwarz bound ||x|| ||W_i - W~_i|| (measured on their greedy requests).
//
// Layout, per tile of 16 rows and block of 32 values, SIX_BIT_BLOCK_BYTES:
//   bytes [0, 256): h's low four bits as int4_tiles.h lays out 4-bit codes: byte 64j + 4i + t (j < 4,
//     i < 16, t < 4) holds value 4j + t of row i in its low nibble and value 16 + 4j + t in its high one;
//   bytes [256, 384): h's top two bits, byte 256 + 64n + 32(i / 8) + 4(i % 8) + t holding in bits 2j,
//     2j + 1 those of the value whose nibble is nibble n (0 low, 1 high) of byte 64j + 4i + t.
// A 32-byte load of the top bits then serves one half (8 rows) of four unpacked registers.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8_activations.h"
#include "int8_tiles.h"

namespace folio_int8_dot {

constexpr int64_t SIX_BIT_BLOCK_BYTES = TILE_BLOCK_BYTES + TILE_BLOCK_BYTES / 2;
// 2 (l - 1.5) = 2l - 3, so that the approximate code 2 (4h + 1.5 - 128) = 8h - 253 is an integer.
constexpr int32_t kSixBitOffset = 253;

// h of value 4j + t (n = 0) or 16 + 4j + t (n = 1) of row i, from a tile's block of six-bit codes.
inline int32_t six_bit_code(const uint8_t* block, int j, int64_t i, int t, int n) {
  const uint8_t nibbles = block[64 * j + 4 * i + t];
  const uint8_t tops = block[TILE_BLOCK_BYTES + 64 * n + 32 * (i / 8) + 4 * (i % 8) + t];
  return (n == 0 ? nibbles & 0x0F : nibbles >> 4) | (((tops >> (2 * j)) & 3) << 4);
}

// Six-bit tiles [T, B * SIX_BIT_BLOCK_BYTES] from 8-bit ones [T, B * INT8_TILE_BLOCK_BYTES] (int8_tiles.h),
// and for each of the N rows: ||W~_i|| (which the bound's norms must cover) and ||W_i - W~_i|| (how near
// the six bits stand: the caller's test of whether they are worth a first pass), each rounded up by
// 0.01%. scales: [T, G, 16].
template <typename S>
void six_bit_tiles(const uint8_t* tiles, const S* scales, int64_t T, int64_t B, int64_t G, int64_t N, uint8_t* six,
                   float* approx_norms, float* residual_norms) {
  const int64_t group_blocks = B / G;  // groups are whole blocks here
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      double approx[TILE_ROWS] = {}, residual[TILE_ROWS] = {};
      for (int64_t b = 0; b < B; ++b) {
        const uint8_t* from = tiles + (tile * B + b) * INT8_TILE_BLOCK_BYTES;
        uint8_t* to = six + (tile * B + b) * SIX_BIT_BLOCK_BYTES;
        std::memset(to, 0, SIX_BIT_BLOCK_BYTES);
        for (int j = 0; j < 4; ++j)
          for (int64_t i = 0; i < TILE_ROWS; ++i) {
            const double s = scale_at(scales + (tile * G + b / group_blocks) * TILE_ROWS, i);
            for (int t = 0; t < 4; ++t)
              for (int n = 0; n < 2; ++n) {
                const uint8_t u = from[64 * (j + 4 * n) + 4 * i + t];  // value 16n + 4j + t
                const uint8_t h = u >> 2;
                to[64 * j + 4 * i + t] |= static_cast<uint8_t>((h & 0x0F) << (4 * n));
                to[TILE_BLOCK_BYTES + 64 * n + 32 * (i / 8) + 4 * (i % 8) + t] |= static_cast<uint8_t>((h >> 4) << (2 * j));
                const double w = s * (4.0 * h + 1.5 - 128.0), r = s * ((u & 3) - 1.5);
                approx[i] += w * w;
                residual[i] += r * r;
              }
          }
      }
      for (int64_t i = 0; i < TILE_ROWS && tile * TILE_ROWS + i < N; ++i) {
        approx_norms[tile * TILE_ROWS + i] = static_cast<float>(std::sqrt(approx[i]) * (1 + 1e-4));
        residual_norms[tile * TILE_ROWS + i] = static_cast<float>(std::sqrt(residual[i]) * (1 + 1e-4));
      }
    }
  });
}

// What the first pass takes per activation row and block of 32, [M, K / 32] each: -253 x the sum of
// the block's codes (the 8h - 253 codes' offset); half the codes' step (the 8h - 253 codes count
// half-steps); and 1.5 ||x^_b||_1 rounded up, x^ the 8 + 8-bit values the full product multiplies
// (`exact`), for the bound.
struct SixBitRows {
  std::vector<int32_t> offsets;
  std::vector<float> half_steps;
  std::vector<float> spans;
};
inline SixBitRows six_bit_rows(const QuantizedRows& codes_only, const QuantizedRows& exact, int64_t M, int64_t K) {
  const int64_t blocks = M * (K / BLOCK);
  SixBitRows rows{std::vector<int32_t>(blocks), std::vector<float>(blocks), std::vector<float>(blocks)};
  for (int64_t mb = 0; mb < blocks; ++mb) {
    int32_t sum = 0;
    double span = 0.0;
    for (int64_t k = mb * BLOCK; k < (mb + 1) * BLOCK; ++k) {
      sum += codes_only.codes[k];
      span += std::fabs(256.0 * exact.codes[k] + exact.residuals[k]);
    }
    rows.offsets[mb] = -kSixBitOffset * sum;
    rows.half_steps[mb] = 0.5f * codes_only.steps[mb];
    rows.spans[mb] = static_cast<float>(1.5 * (1 + 1e-5) * span * exact.steps[mb]);
  }
  return rows;
}

#if defined(__AVX2__)
// The top bits of register j, from the 32 bytes that hold them, moved to bits 4 and 5 of each byte.
inline __m256i six_bit_tops(__m256i tops, int j) {
  const __m256i bits_4_5 = _mm256_set1_epi8(0x30);
  switch (j) {  // 16-bit shifts: the bits they carry across a byte's edge fall outside the mask
    case 0: return _mm256_and_si256(_mm256_slli_epi16(tops, 4), bits_4_5);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(tops, 2), bits_4_5);
    case 2: return _mm256_and_si256(tops, bits_4_5);
    default: return _mm256_and_si256(_mm256_srli_epi16(tops, 2), bits_4_5);
  }
}
#endif

// A tile's six-bit codes widened to the bytes VNNI multiplies, h (0..63) a byte: per block and j < 4, 64
// bytes of the values in the low nibbles of the block's bytes 64j..64j+63, then 64 of the high ones'.
// Widened once per tile into a thread's buffer, then read from L1 by every pass of activation rows.
constexpr int64_t SIX_BIT_WIDE_BLOCK_BYTES = 512;
struct WideTile {
  std::vector<uint8_t> bytes;  // B * SIX_BIT_WIDE_BLOCK_BYTES
  const uint8_t* from = nullptr;  // the six-bit tile they hold
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // as load_scales
template <typename S>
inline void six_bit_widen(const uint8_t* six, const S* scales, const int32_t* group_of_block, int64_t B,
                          WideTile& wide) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), bits_4_5 = _mm512_set1_epi8(0x30);
  wide.bytes.resize(B * SIX_BIT_WIDE_BLOCK_BYTES);
  wide.from = six;
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* block = six + b * SIX_BIT_BLOCK_BYTES;
    prefetch_ahead(block, PREFETCH_BYTES, SIX_BIT_BLOCK_BYTES);
    prefetch_ahead(scales + group_of_block[b] * TILE_ROWS,
                   PREFETCH_BYTES * TILE_ROWS * static_cast<int64_t>(sizeof(S)) / SIX_BIT_BLOCK_BYTES, 1);
    // byte 4i + t of the top bits' halves: those of row i's low (first) and high (second) nibbles
    const __m512i tops_low = _mm512_loadu_si512(block + TILE_BLOCK_BYTES);
    const __m512i tops_high = _mm512_loadu_si512(block + TILE_BLOCK_BYTES + 64);
    uint8_t* to = wide.bytes.data() + b * SIX_BIT_WIDE_BLOCK_BYTES;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i packed = _mm512_loadu_si512(block + 64 * j);
      // bits 2j and 2j + 1 of the top bits moved to bits 4 and 5 (16-bit shifts: what crosses a byte's
      // edge falls outside the mask)
      const int up = 4 - 2 * j;
      const __m512i top_low = up >= 0 ? _mm512_slli_epi16(tops_low, up) : _mm512_srli_epi16(tops_low, -up);
      const __m512i top_high = up >= 0 ? _mm512_slli_epi16(tops_high, up) : _mm512_srli_epi16(tops_high, -up);
      _mm512_storeu_si512(to + 128 * j,
                          _mm512_ternarylogic_epi32(_mm512_and_si512(packed, nibble), top_low, bits_4_5, 0xF8));
      _mm512_storeu_si512(to + 128 * j + 64, _mm512_ternarylogic_epi32(
                                                 _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble), top_high,
                                                 bits_4_5, 0xF8));
    }
  }
}

// six_bit_tile with VNNI, for three or more activation rows, where the pass is bound by its products,
// not by memory (a batch's greedy pick). The tile is widened once (six_bit_widen), so a pass of rows does
// only its products and each block's float steps; one vpdpbusd adds 64 products where AVX2 needs two
// vpmaddubsw, a vpmaddwd and two additions for the same. The integer sums are the AVX2 path's (exact:
// no pair saturates) and the float steps the same, lane by lane, so the values are the same. Each row's
// low and high nibbles sum in their own chains, to overlap latencies.
template <int TILE, typename S>
inline void six_bit_tile_vnni(const uint8_t* wide, const S* scales, const QuantizedRows& q, const SixBitRows& rows,
                              const int32_t* group_of_block, int64_t m0, int64_t K, float* out, float* bounds) {
  const int64_t B = K / BLOCK;
  __m512 acc[TILE], bound[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = bound[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* block = wide + b * SIX_BIT_WIDE_BLOCK_BYTES;
    __m512i low_sums[TILE], high_sums[TILE];
    for (int t = 0; t < TILE; ++t) low_sums[t] = high_sums[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i low = _mm512_loadu_si512(block + 128 * j), high = _mm512_loadu_si512(block + 128 * j + 64);
#pragma GCC unroll 4
      for (int t = 0; t < TILE; ++t) {
        const int8_t* x = q.codes.data() + (m0 + t) * K + b * BLOCK + 4 * j;
        low_sums[t] = _mm512_dpbusd_epi32(low_sums[t], low, _mm512_set1_epi32(four_bytes(x)));
        high_sums[t] = _mm512_dpbusd_epi32(high_sums[t], high, _mm512_set1_epi32(four_bytes(x + 16)));
      }
    }
    const __m512 s = load_scales(scales + group_of_block[b] * TILE_ROWS);
    for (int t = 0; t < TILE; ++t) {
      const int64_t mb = (m0 + t) * B + b;
      const __m512i sums = _mm512_add_epi32(low_sums[t], high_sums[t]);
      const __m512i total = _mm512_add_epi32(_mm512_slli_epi32(sums, 3), _mm512_set1_epi32(rows.offsets[mb]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(s, _mm512_set1_ps(rows.half_steps[mb])),
                               acc[t]);
      bound[t] = _mm512_fmadd_ps(s, _mm512_set1_ps(rows.spans[mb]), bound[t]);
    }
  }
  for (int t = 0; t < TILE; ++t) {
    _mm512_storeu_ps(out + t * TILE_ROWS, acc[t]);
    _mm512_storeu_ps(bounds + t * TILE_ROWS, bound[t]);
  }
}
#endif

// out[t * 16 + i] = x~[m0 + t] . W~_i for the tile's 16 rows, x~ the activations' 8-bit codes (q without
// residuals) and W~ as above: sum over blocks of s_i dx_b (8 h.codes - 253 sum(codes)) / 2; and
// bounds[t * 16 + i] = sum over blocks of s_i x spans[b] >= |x^ . (W_i - W~_i)|. With one or two
// activation rows, AVX2 on AVX-512 machines too: it is bound by memory, not by its products. On a
// 2-core Xeon it reads Gemma 3's copy at ~20 GB/s, the machine's read peak; a VNNI version ran 0.98x
// with the same prefetches (0.78x without). Bytes 0..63 times codes -127..127 sum in vpmaddubsw's 16-bit
// pairs to at most 16,002, two registers' to 32,004.
template <int TILE, typename S>
inline void six_bit_tile(const uint8_t* six, const S* scales, const QuantizedRows& q, const SixBitRows& rows,
                         const int32_t* group_of_block, int64_t m0, int64_t K, float* out, float* bounds,
                         WideTile& wide) {
  const int64_t B = K / BLOCK;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // as load_scales
  if constexpr (TILE >= 3) {
    if (wide.from != six) six_bit_widen(six, scales, group_of_block, B, wide);
    six_bit_tile_vnni<TILE>(wide.bytes.data(), scales, q, rows, group_of_block, m0, K, out, bounds);
    return;
  }
#endif
#if defined(__AVX2__)
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  // With one or two activation rows both halves of a block go in one pass (each 64-byte line of codes
  // holds a row group's halves, read once); with more, half by half, their accumulators in registers.
  constexpr bool BOTH = TILE <= 2;
  for (int outer = 0; outer < (BOTH ? 1 : 2); ++outer) {
    __m256 acc[BOTH ? 2 : 1][TILE], bound[BOTH ? 2 : 1][TILE];
    for (int h = 0; h < (BOTH ? 2 : 1); ++h)
      for (int t = 0; t < TILE; ++t) acc[h][t] = bound[h][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const uint8_t* block = six + b * SIX_BIT_BLOCK_BYTES;
      if (outer == 0) {
        prefetch_ahead(block, PREFETCH_BYTES, SIX_BIT_BLOCK_BYTES);
        prefetch_ahead(scales + group_of_block[b] * TILE_ROWS,
                       PREFETCH_BYTES * TILE_ROWS * static_cast<int64_t>(sizeof(S)) / SIX_BIT_BLOCK_BYTES, 1);
      }
#pragma GCC unroll 2
      for (int inner = 0; inner < (BOTH ? 2 : 1); ++inner) {
        const int half = BOTH ? inner : outer;  // the tile's rows 8 * half to 8 * half + 7
        const __m256i* tops = reinterpret_cast<const __m256i*>(block + TILE_BLOCK_BYTES + 32 * half);
        const __m256i tops_low = _mm256_loadu_si256(tops), tops_high = _mm256_loadu_si256(tops + 2);
        __m256i sums[TILE];
        for (int t = 0; t < TILE; ++t) sums[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32 * half));
          const __m256i low = _mm256_or_si256(_mm256_and_si256(packed, nibble), six_bit_tops(tops_low, j));
          const __m256i high =
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble), six_bit_tops(tops_high, j));
#pragma GCC unroll 4
          for (int t = 0; t < TILE; ++t) {
            const int8_t* x = q.codes.data() + (m0 + t) * K + b * BLOCK + 4 * j;
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_set1_epi32(four_bytes(x))),
                                                   _mm256_maddubs_epi16(high, _mm256_set1_epi32(four_bytes(x + 16))));
            sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(pairs, ones));
          }
        }
        const __m256 s = load_scales8(scales + group_of_block[b] * TILE_ROWS + 8 * half);
        for (int t = 0; t < TILE; ++t) {
          const int64_t mb = (m0 + t) * B + b;
          const __m256i total = _mm256_add_epi32(_mm256_slli_epi32(sums[t], 3), _mm256_set1_epi32(rows.offsets[mb]));
          __m256& a = acc[BOTH ? half : 0][t];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(s, _mm256_set1_ps(rows.half_steps[mb])), a);
          bound[BOTH ? half : 0][t] = _mm256_fmadd_ps(s, _mm256_set1_ps(rows.spans[mb]), bound[BOTH ? half : 0][t]);
        }
      }
    }
    for (int h = 0; h < (BOTH ? 2 : 1); ++h)
      for (int t = 0; t < TILE; ++t) {
        _mm256_storeu_ps(out + t * TILE_ROWS + 8 * (BOTH ? h : outer), acc[h][t]);
        _mm256_storeu_ps(bounds + t * TILE_ROWS + 8 * (BOTH ? h : outer), bound[h][t]);
      }
  }
#else
  for (int t = 0; t < TILE; ++t) {
    const int8_t* xq = q.codes.data() + (m0 + t) * K;
    for (int64_t i = 0; i < TILE_ROWS; ++i) {
      float total = 0.f, bound = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t dot = 0;
        for (int j = 0; j < 4; ++j)
          for (int t4 = 0; t4 < 4; ++t4)
            for (int n = 0; n < 2; ++n)
              dot += six_bit_code(six + b * SIX_BIT_BLOCK_BYTES, j, i, t4, n) * xq[b * BLOCK + 16 * n + 4 * j + t4];
        const int64_t mb = (m0 + t) * B + b;
        const float s = scale_at(scales + group_of_block[b] * TILE_ROWS, i);
        total += static_cast<float>(8 * dot + rows.offsets[mb]) * (s * rows.half_steps[mb]);
        bound += s * rows.spans[mb];
      }
      out[t * TILE_ROWS + i] = total;
      bounds[t * TILE_ROWS + i] = bound;
    }
  }
#endif
}

}  // namespace folio_int8_dot
