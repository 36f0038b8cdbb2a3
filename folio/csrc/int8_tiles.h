// 8-bit weights tiled for the int8 dot-product kernel (int8_dot.cpp), as the 4-bit ones are: rows in
// tiles of 16, and for each tile and block of 32 values 512 bytes, byte (j, i, t) (j < 8, i < 16, t < 4)
// holding value 4j + t of the block for row i, stored as code + 128 (0..255: vpdpbusd's unsigned
// operand). One 64-byte load is then 16 rows x 4 values, and vpdpbusd against 4 activation bytes
// broadcast to every lane adds each row's 4 products into its own lane: a tile's 16 row sums come out
// in one register, with no horizontal additions (a row-major layout needs one per row, which for a
// 640-wide row costs as much as its products). The + 128 adds 128 * sum(activation codes) to each half
// block's sum, which the activations' `half_starts` and `block_starts` take back out.
//
// Scales are [N / 16, G, 16] (float16 where the file's are, else float32), a tile's rows side by side;
// groups are 16 (Q6_K: a half block each), 32 (Q8_0, Q5_0) or a multiple of 64.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int8_activations.h"

namespace folio_int8_dot {

constexpr int64_t TILE_ROWS = 16;  // weight rows a tile holds side by side, one per AVX-512 lane
constexpr int64_t TILE_BLOCK_BYTES = TILE_ROWS * BLOCK / 2;  // a 4-bit tile's bytes per block of 32
constexpr int64_t INT8_TILE_BLOCK_BYTES = TILE_ROWS * BLOCK;

// Decode reads each weight once a step, from memory. On a 2-core Zen 3 the hardware prefetcher left the
// AVX2 tile loops at about half the speed they run on weights in cache: each block's loads waited on
// memory, then its products on nothing. Asking for the lines PREFETCH_BYTES of codes ahead of the block
// being multiplied (and for the scales, mins and fifth bits as far ahead in their own rows) overlaps
// the two. Interleaved in one process: a 49,152 x 576 4-bit weight 8.7 -> 10.5 GB/s on one thread and
// 15.1 -> 17.2 on two; smollm2's decode layers 1.07x, its 8-bit LM head 1.12x. Tiles lie back to back,
// and their scales too, so near a tile's end the lines asked for are the next tile's. The AVX-512 VNNI
// loops had none until a 2-core Intel Xeon (Emerald Rapids) showed the same: whole batch-1 steps 1.13x
// (smollm2) and 1.10x (Gemma 3), every round; 2 KiB or 8 KiB ahead did no better there.
constexpr int64_t PREFETCH_BYTES = 4096;

// Prefetches [from + ahead, from + ahead + bytes) into L1: the lines as far ahead of `from` as its row
// holds per block of codes, `ahead` being PREFETCH_BYTES scaled to that row.
inline void prefetch_ahead(const void* from, int64_t ahead, int64_t bytes) {
  const char* p = static_cast<const char*>(from) + ahead;
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(p + at, _MM_HINT_T0);
}

// 5-bit codes are 4-bit tiles (int8_dot.cpp) plus their fifth bits, FIFTH_BIT_BLOCK_BYTES per tile and
// block: eight 64-bit masks, mask 2j + h (h = 0: the low nibbles of the tile's 64 bytes at 64j, 1: the
// high ones) with bit 4i + t set where that nibble's code is 16 more. A mask selects the bytes of one
// unpacked register, so the fifth bits cost one masked add per register (Q5_0, Q5_1, Q5_K: 5.5 to 6
// bits a weight held, against 8.5 as 8-bit tiles).
constexpr int64_t FIFTH_BIT_BLOCK_BYTES = 8 * 8;

inline uint64_t fifth_bits(const uint8_t* fifth, int64_t b, int mask) {
  uint64_t bits;
  std::memcpy(&bits, fifth + b * FIFTH_BIT_BLOCK_BYTES + 8 * mask, sizeof(bits));
  return bits;
}
inline int32_t fifth_bit(const uint8_t* fifth, int64_t b, int mask, int64_t byte) {
  return static_cast<int32_t>((fifth_bits(fifth, b, mask) >> byte) & 1);
}
#if defined(__AVX2__)  // AVX-512 builds too: the six-bit pass (six_bit_pass.h) runs AVX2 for 1-2 rows
inline __m256 load_scales8(const at::Half* s) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))); }
inline __m256 load_scales8(const float* s) { return _mm256_loadu_ps(s); }
#endif
#if defined(__AVX512BW__)
inline __mmask64 fifth_mask(const uint8_t* fifth, int64_t b, int mask) { return _cvtu64_mask64(fifth_bits(fifth, b, mask)); }

// Register j (< 4) of a 4-bit tile's block b (int4_tiles.h) unpacked to a code a byte: `low` holds values
// 4j + t of the tile's rows, `high` values 16 + 4j + t; FIVE: their fifth bits added.
template <bool FIVE>
inline void unpack_codes(const uint8_t* block, const uint8_t* fifth, int64_t b, int j, __m512i& low, __m512i& high) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(0x10);
  const __m512i packed = _mm512_loadu_si512(block + 64 * j);
  low = _mm512_and_si512(packed, nibble);
  high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  if constexpr (FIVE) {
    low = _mm512_mask_add_epi8(low, fifth_mask(fifth, b, 2 * j), low, sixteen);
    high = _mm512_mask_add_epi8(high, fifth_mask(fifth, b, 2 * j + 1), high, sixteen);
  }
}
#elif defined(__AVX2__)
// 16 in each byte of half `half` (32 bytes) of an unpacked register whose bit in fifth-bit mask `mask` is set.
inline __m256i fifth_sixteens(const uint8_t* fifth, int64_t b, int mask, int half) {
  const uint32_t bits = static_cast<uint32_t>(fifth_bits(fifth, b, mask) >> (32 * half));
  // byte k of the result takes byte k / 8 of `bits`, then its own bit k % 8 of that
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// unpack_codes for half `half` of register j: the tile's rows 8 * half to 8 * half + 7.
template <bool FIVE>
inline void unpack_codes_half(const uint8_t* block, const uint8_t* fifth, int64_t b, int j, int half, __m256i& low,
                              __m256i& high) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32 * half));
  low = _mm256_and_si256(packed, nibble);
  high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
  if constexpr (FIVE) {
    low = _mm256_add_epi8(low, fifth_sixteens(fifth, b, 2 * j, half));
    high = _mm256_add_epi8(high, fifth_sixteens(fifth, b, 2 * j + 1, half));
  }
}

// Four 16-bit activation words broadcast to every 64-bit lane: the values a tile register's rows hold.
inline __m256i four_words(const int16_t* p) {
  int64_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi64x(v);
}

// 16-bit products of 16 bytes (4 rows x 4 values, widened) with four_words, summed in pairs: each row's
// two pair sums in adjacent 32-bit lanes. rows_of_pairs then adds those pairs: rows 0-7 in order.
inline __m256i pair_sums(__m256i wide_bytes, __m256i words) { return _mm256_madd_epi16(wide_bytes, words); }
inline __m256i rows_of_pairs(__m256i rows_0_3, __m256i rows_4_7) {
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(rows_0_3, rows_4_7), 0xD8);
}
#endif

inline float scale_at(const at::Half* s, int64_t i) { return to_float(s[i]); }
inline float scale_at(const float* s, int64_t i) { return s[i]; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load_scales(const at::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}
inline __m512 load_scales(const float* s) { return _mm512_loadu_ps(s); }

// What the integer sum of block i's half h (SPLIT) or whole block starts from.
template <bool SPLIT>
inline __m512i start_of(const QuantizedRows& q, int64_t i, int h) {
  return _mm512_set1_epi32(SPLIT ? q.half_starts[2 * i + h] : q.block_starts[i]);
}

// out[t * 16 + i] = y[m0 + t, row i of the tile], for TILE activation rows. SPLIT: groups of 16, so each
// half block has its own scale. EXACT: the activations' residuals count (else they are empty, unread).
template <int TILE, bool SPLIT, bool EXACT, typename S>
inline void int8_tile(const uint8_t* codes, const S* scales, const QuantizedRows& q, const int32_t* group_of_block,
                      int64_t m0, int64_t K, float* out) {
  const int64_t B = K / BLOCK;
  constexpr int SUMS = SPLIT ? 2 : 1;  // integer sums per block: one per scale
  // vpdpbusd chains per sum: with few activation rows, two (even and odd j), so that consecutive ones
  // do not wait on each other's latency; with more, the rows' chains interleave enough.
  constexpr int CHAINS = TILE >= 3 ? 1 : 2;
  __m512 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* block = codes + b * INT8_TILE_BLOCK_BYTES;
    prefetch_ahead(block, PREFETCH_BYTES, INT8_TILE_BLOCK_BYTES);
    prefetch_ahead(scales + group_of_block[b] * TILE_ROWS,
                   PREFETCH_BYTES * TILE_ROWS * SUMS * static_cast<int64_t>(sizeof(S)) / INT8_TILE_BLOCK_BYTES, 1);
    // Codes and residuals apart. Each sum takes back the + 128's share (`start`): with many rows, its
    // last chain starts there, which saves a subtraction per block; with few, that load would wait at
    // the head of a short chain, so it is added at the end.
    __m512i sums[TILE][SUMS][CHAINS], residual_sums[TILE][SUMS][CHAINS];
    for (int t = 0; t < TILE; ++t)
      for (int h = 0; h < SUMS; ++h)
        for (int c = 0; c < CHAINS; ++c) {
          const __m512i first = CHAINS == 1 ? start_of<SPLIT>(q, (m0 + t) * B + b, h) : _mm512_setzero_si512();
          sums[t][h][c] = EXACT ? _mm512_setzero_si512() : first;
          if constexpr (EXACT) residual_sums[t][h][c] = first;
        }
    // Unrolled whole, so every register index is a constant: the accumulators stay in registers.
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i w = _mm512_loadu_si512(block + 64 * j);
      const int h = SPLIT ? j / 4 : 0, c = j % CHAINS;
#pragma GCC unroll 4
      for (int t = 0; t < TILE; ++t) {
        const int64_t at = (m0 + t) * K + b * BLOCK + 4 * j;
        sums[t][h][c] = _mm512_dpbusd_epi32(sums[t][h][c], w, _mm512_set1_epi32(four_bytes(q.codes.data() + at)));
        if constexpr (EXACT)
          residual_sums[t][h][c] =
              _mm512_dpbusd_epi32(residual_sums[t][h][c], w, _mm512_set1_epi32(four_bytes(q.residuals.data() + at)));
      }
    }
    const S* group_scales = scales + group_of_block[b] * 16;
    __m512 w_scales[SUMS];
    for (int h = 0; h < SUMS; ++h) w_scales[h] = load_scales(group_scales + 16 * h);
    for (int t = 0; t < TILE; ++t) {
      const __m512 step = _mm512_set1_ps(q.steps[(m0 + t) * B + b]);
      for (int h = 0; h < SUMS; ++h) {
        __m512i code_sum = sums[t][h][0], residual_sum = residual_sums[t][h][0];
        if constexpr (CHAINS == 2) {
          const __m512i start = start_of<SPLIT>(q, (m0 + t) * B + b, h);
          code_sum = _mm512_add_epi32(code_sum, sums[t][h][1]);
          if constexpr (EXACT) {
            residual_sum = _mm512_add_epi32(_mm512_add_epi32(residual_sum, residual_sums[t][h][1]), start);
          } else {
            code_sum = _mm512_add_epi32(code_sum, start);
          }
        }
        // exact: 256 * sum(codes' products) + sum(residuals' products), in units of step
        const __m512i total = EXACT ? _mm512_add_epi32(_mm512_slli_epi32(code_sum, 8), residual_sum) : code_sum;
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(w_scales[h], step), acc[t]);
      }
    }
  }
  for (int t = 0; t < TILE; ++t) _mm512_storeu_ps(out + t * 16, acc[t]);
}
#elif defined(__AVX2__)
// The same sums with 16-bit pair products (kWordProducts): each 32-byte half of a 64-byte tile register
// (8 rows x 4 values) is widened to two registers of 16-bit words, code + 128 - 128, and multiplied by
// the activations' words, whose residual rides in the same product. The float steps are the AVX-512
// path's, in its order.
template <int TILE, bool SPLIT, bool EXACT, typename S>
inline void int8_tile(const uint8_t* codes, const S* scales, const QuantizedRows& q, const int32_t* group_of_block,
                      int64_t m0, int64_t K, float* out) {
  const int64_t B = K / BLOCK;
  constexpr int SUMS = SPLIT ? 2 : 1;  // integer sums per block: one per scale
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int half = 0; half < 2; ++half) {  // the tile's rows 8 * half to 8 * half + 7
    __m256 acc[TILE];
    for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const uint8_t* block = codes + b * INT8_TILE_BLOCK_BYTES + 32 * half;
      const S* group_scales = scales + group_of_block[b] * 16 + 8 * half;
      if (half == 0) {  // a block's scales: 16 x sizeof(S) bytes to its 512 of codes
        prefetch_ahead(block, PREFETCH_BYTES, INT8_TILE_BLOCK_BYTES);
        prefetch_ahead(group_scales, PREFETCH_BYTES * 16 * static_cast<int64_t>(sizeof(S)) / INT8_TILE_BLOCK_BYTES, 1);
      }
      for (int h = 0; h < SUMS; ++h) {
        __m256i sums[TILE][2];  // rows 0-3 and 4-7 of the half, two pair sums a row
        for (int t = 0; t < TILE; ++t) sums[t][0] = sums[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = h * (8 / SUMS); j < (h + 1) * (8 / SUMS); ++j) {
          const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j)), flip);
          const __m256i w_low = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
          const __m256i w_high = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
#pragma GCC unroll 4
          for (int t = 0; t < TILE; ++t) {
            const __m256i x = four_words(q.words.data() + (m0 + t) * K + b * BLOCK + 4 * j);
            sums[t][0] = _mm256_add_epi32(sums[t][0], pair_sums(w_low, x));
            sums[t][1] = _mm256_add_epi32(sums[t][1], pair_sums(w_high, x));
          }
        }
        const __m256 w_scales = load_scales8(group_scales + 16 * h);
        for (int t = 0; t < TILE; ++t) {
          const __m256 step = _mm256_set1_ps(q.steps[(m0 + t) * B + b]);
          const __m256i total = rows_of_pairs(sums[t][0], sums[t][1]);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(w_scales, step), acc[t]);
        }
      }
    }
    for (int t = 0; t < TILE; ++t) _mm256_storeu_ps(out + t * 16 + 8 * half, acc[t]);
  }
}
#else
template <int TILE, bool SPLIT, bool EXACT, typename S>
inline void int8_tile(const uint8_t* codes, const S* scales, const QuantizedRows& q, const int32_t* group_of_block,
                      int64_t m0, int64_t K, float* out) {
  const int64_t B = K / BLOCK;
  for (int t = 0; t < TILE; ++t) {
    const int8_t* xq = q.codes.data() + (m0 + t) * K;
    for (int64_t i = 0; i < 16; ++i) {
      float total = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t halves[2] = {0, 0};
        for (int64_t j = 0; j < 8; ++j)
          for (int64_t v = 0; v < 4; ++v) {
            const int32_t w = static_cast<int32_t>(codes[b * INT8_TILE_BLOCK_BYTES + j * 64 + i * 4 + v]) - 128;
            const int64_t k = b * BLOCK + 4 * j + v;
            halves[j / 4] += EXACT ? w * (256 * xq[k] + q.residuals[(m0 + t) * K + k]) : w * xq[k];
          }
        const S* group_scales = scales + group_of_block[b] * 16;
        const float step = q.steps[(m0 + t) * B + b];
        if (SPLIT) {
          total += step * (scale_at(group_scales, i) * halves[0] + scale_at(group_scales + 16, i) * halves[1]);
        } else {
          total += step * scale_at(group_scales, i) * static_cast<float>(halves[0] + halves[1]);
        }
      }
      out[t * 16 + i] = total;
    }
  }
}
#endif

}  // namespace folio_int8_dot
