// Tiled 4-, 5- and 8-bit weights (int8_dot.cpp, int8_tiles.h) widened back to float32, bfloat16 or
// float16 [N, K], for many activation rows: one GEMM on the widened weight then beats the dot products.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <optional>
#include <type_traits>

#include "int8_activations.h"
#include "int8_tiles.h"

namespace folio_int8_dot {

// dst[0 .. 32) = src, rounded to O (to nearest even, as torch's conversions round).
template <typename O>
inline void store_block(O* dst, const float* src) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<O, at::BFloat16>) {
    for (int64_t k = 0; k < BLOCK; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
    return;
  }
#endif
  for (int64_t k = 0; k < BLOCK; ++k) dst[k] = static_cast<O>(src[k]);
}

// What a weight is widened to: `dtype` where f below writes it, else float32 (then converted).
inline at::ScalarType widened_dtype(at::ScalarType dtype) {
  const bool written = dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf;
  return written ? dtype : torch::kFloat32;
}

// Calls f(typed pointer) for a widened weight's output: float32, bfloat16 or float16.
template <typename F>
inline void with_output(torch::Tensor& out, F f) {
  if (out.scalar_type() == torch::kBFloat16) {
    f(out.data_ptr<at::BFloat16>());
  } else if (out.scalar_type() == torch::kHalf) {
    f(out.data_ptr<at::Half>());
  } else {
    TORCH_CHECK(out.scalar_type() == torch::kFloat32, "a weight widens to float32, bfloat16 or float16");
    f(out.data_ptr<float>());
  }
}

// One tile's B blocks of 4-bit codes (FIVE: and their fifth bits) rewritten in the 8-bit tile layout
// (int8_tiles.h) as code + offset (128: the codes as they are; 112: code - 16, Q5_0's signed codes) into
// out [B * 512]. The nibbles of the 4-bit tile's register j are values
// 4j + t (low) and 16 + 4j + t (high) of each row, which are the 8-bit tile's registers j and 4 + j, so a
// block is eight stores. With many activation rows the 8-bit tile loop over this copy, which stays in
// L1 or L2, beats unpacking the nibbles again on every pass.
template <bool FIVE>
inline void widen_tile_to_int8(const uint8_t* codes, const uint8_t* fifth, int64_t B, int offset, uint8_t* out) {
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* block = codes + b * TILE_BLOCK_BYTES;
    uint8_t* wide = out + b * INT8_TILE_BLOCK_BYTES;
#if defined(__AVX512BW__)
    const __m512i shift = _mm512_set1_epi8(static_cast<char>(offset));
    for (int j = 0; j < 4; ++j) {
      __m512i low, high;
      unpack_codes<FIVE>(block, fifth, b, j, low, high);
      _mm512_storeu_si512(wide + 64 * j, _mm512_add_epi8(low, shift));
      _mm512_storeu_si512(wide + 64 * (4 + j), _mm512_add_epi8(high, shift));
    }
#elif defined(__AVX2__)
    const __m256i shift = _mm256_set1_epi8(static_cast<char>(offset));
    for (int j = 0; j < 4; ++j)
      for (int half = 0; half < 2; ++half) {
        __m256i low, high;
        unpack_codes_half<FIVE>(block, fifth, b, j, half, low, high);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide + 64 * j + 32 * half), _mm256_add_epi8(low, shift));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide + 64 * (4 + j) + 32 * half), _mm256_add_epi8(high, shift));
      }
#else
    for (int j = 0; j < 4; ++j)
      for (int64_t byte = 0; byte < 64; ++byte) {
        const uint8_t packed = block[64 * j + byte];
        const int low_bit = FIVE ? fifth_bit(fifth, b, 2 * j, byte) : 0, high_bit = FIVE ? fifth_bit(fifth, b, 2 * j + 1, byte) : 0;
        wide[64 * j + byte] = static_cast<uint8_t>(offset + (packed & 0x0F) + 16 * low_bit);
        wide[64 * (4 + j) + byte] = static_cast<uint8_t>(offset + (packed >> 4) + 16 * high_bit);
      }
#endif
  }
}

// Rows of the tiled 8-bit weight widened to `dtype`: all N of them ([N, K]: for many activation rows one
// GEMM then beats the dot products), or those `ids` names ([len(ids), K]: an embedding lookup).
inline torch::Tensor int8_widen_rows(torch::Tensor tiles, torch::Tensor scales, int64_t group, int64_t N, int64_t K,
                                     const std::optional<torch::Tensor>& ids, at::ScalarType dtype) {
  const int64_t B = K / BLOCK, G = K / group, tile_count = (N + TILE_ROWS - 1) / TILE_ROWS;
  TORCH_CHECK(tiles.scalar_type() == torch::kUInt8 && tiles.is_contiguous() &&
              tiles.numel() == tile_count * B * INT8_TILE_BLOCK_BYTES && scales.numel() == tile_count * G * TILE_ROWS &&
              scales.is_contiguous(), "int8 tiles and scales");
  torch::Tensor rows;
  if (ids) rows = ids->to(torch::kLong).contiguous().view(-1);
  const int64_t count = ids ? rows.numel() : N;
  const int64_t* row_of = ids ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; row_of && r < count; ++r)  // a plain loop: a lookup is a few ids, every step
    TORCH_CHECK(row_of[r] >= 0 && row_of[r] < N, "ids: row indices below ", N, ", got ", row_of[r]);
  auto out = torch::empty({count, K}, tiles.options().dtype(widened_dtype(dtype)));
  const uint8_t* c = tiles.data_ptr<uint8_t>();
  auto widen = [&](const auto* s, auto* o) {
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t n = row_of ? row_of[r] : r, tile = n / TILE_ROWS, i = n % TILE_ROWS;
        for (int64_t b = 0; b < B; ++b) {
          const uint8_t* block = c + (tile * B + b) * INT8_TILE_BLOCK_BYTES + i * 4;
          float values[BLOCK];
          for (int64_t half = 0; half < 2; ++half) {  // a group of 16 covers half a block
            const float scale = scale_at(s, (tile * G + (b * BLOCK + half * HALF) / group) * TILE_ROWS + i);
            for (int64_t j = 4 * half; j < 4 * half + 4; ++j)
              for (int64_t t = 0; t < 4; ++t)
                values[4 * j + t] = static_cast<float>(static_cast<int32_t>(block[j * 64 + t]) - 128) * scale;
          }
          store_block(o + r * K + b * BLOCK, values);
        }
      }
    });
  };
  with_output(out, [&](auto* o) {
    if (scales.scalar_type() == torch::kHalf) {
      widen(scales.data_ptr<at::Half>(), o);
    } else {
      TORCH_CHECK(scales.scalar_type() == torch::kFloat32, "scales: float16 or float32");
      widen(scales.data_ptr<float>(), o);
    }
  });
  return out.to(dtype);
}

inline torch::Tensor int8_dequantize(torch::Tensor tiles, torch::Tensor scales, int64_t group, int64_t N, int64_t K,
                                     at::ScalarType dtype) {
  return int8_widen_rows(tiles, scales, group, N, K, std::nullopt, dtype);
}

inline torch::Tensor int8_embedding(torch::Tensor tiles, torch::Tensor scales, int64_t group, int64_t N, int64_t K,
                                    torch::Tensor ids, at::ScalarType dtype) {
  return int8_widen_rows(tiles, scales, group, N, K, ids, dtype);
}

// The tiled 4-bit weight (5-bit with its fifth bits, else high_bits empty) widened to `dtype` [N, K], for
// many rows: one GEMM then beats the dot products.
inline torch::Tensor int4_dequantize(torch::Tensor tiles, torch::Tensor high_bits, torch::Tensor scales,
                                     torch::Tensor mins, int64_t group, int64_t N, int64_t K, at::ScalarType dtype) {
  const int64_t B = K / BLOCK, G = K / group, tile_count = (N + TILE_ROWS - 1) / TILE_ROWS;
  TORCH_CHECK(tiles.scalar_type() == torch::kUInt8 && tiles.is_contiguous() &&
              tiles.numel() == tile_count * B * TILE_BLOCK_BYTES && scales.numel() == tile_count * G * TILE_ROWS &&
              mins.numel() == scales.numel() && scales.scalar_type() == torch::kHalf && mins.scalar_type() == torch::kHalf,
              "int4 tiles, scales and mins");
  const bool five = high_bits.numel() > 0;
  TORCH_CHECK(!five || (high_bits.scalar_type() == torch::kUInt8 && high_bits.is_contiguous() &&
                        high_bits.numel() == tile_count * B * FIFTH_BIT_BLOCK_BYTES),
              "high_bits: empty, or uint8 [N / 16, K / 32 * 64]");
  auto out = torch::empty({N, K}, tiles.options().dtype(widened_dtype(dtype)));
  const uint8_t* c = tiles.data_ptr<uint8_t>();
  const uint8_t* h = five ? high_bits.data_ptr<uint8_t>() : nullptr;
  const at::Half* s = scales.data_ptr<at::Half>();
  const at::Half* m = mins.data_ptr<at::Half>();
  with_output(out, [&](auto* o) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const int64_t tile = n / TILE_ROWS, i = n % TILE_ROWS;
        for (int64_t b = 0; b < B; ++b) {
          const uint8_t* block = c + (tile * B + b) * TILE_BLOCK_BYTES;
          const int64_t g = (tile * G + b * BLOCK / group) * TILE_ROWS + i;
          const float scale = to_float(s[g]), min = to_float(m[g]);
          float values[BLOCK];
          const uint8_t* tile_fifth = five ? h + tile * B * FIFTH_BIT_BLOCK_BYTES : nullptr;
          for (int j = 0; j < 4; ++j) {
            for (int64_t v = 0; v < 4; ++v) {
              const uint8_t byte = block[j * 64 + i * 4 + v];
              const int32_t low = (byte & 0x0F) + (five ? 16 * fifth_bit(tile_fifth, b, 2 * j, i * 4 + v) : 0);
              const int32_t high = (byte >> 4) + (five ? 16 * fifth_bit(tile_fifth, b, 2 * j + 1, i * 4 + v) : 0);
              values[4 * j + v] = static_cast<float>(low) * scale + min;
              values[16 + 4 * j + v] = static_cast<float>(high) * scale + min;
            }
          }
          store_block(o + n * K + b * BLOCK, values);
        }
      }
    });
  });
  return out.to(dtype);
}

}  // namespace folio_int8_dot
