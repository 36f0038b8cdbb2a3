// y = x @ W^T for 4-bit and 8-bit weights by integer dot products, the way llama.cpp computes them,
// with activations coded in 8 + 8 bits instead of 8.
//
// Each row of x is first quantized to int8 in blocks of 32 (one float scale per block, as GGUF's
// Q8_0), so a block's dot product with the weight's codes is exact integer arithmetic: 64 multiply-adds
// per AVX-512 VNNI instruction (vpdpbusd, unsigned x signed bytes). Only block results are scaled:
//   4-bit, W[n, k] = codes[n, k] * s[n, g] + m[n, g]   (codes 0..15; groups 32 or a multiple of 64)
//     y[n] = sum_b s[n, g(b)] * dx[b] * dot_b(codes, xq + xr / 256) + sum_g m[n, g] * sum_{k in g} x[k]
//   8-bit, W[n, k] = codes[n, k] * s[n, g]             (codes -128..127; groups 16, 32 or a multiple of 64)
//     y[n] = sum_b s[n, g(b)] * dx[b] * dot_b(codes, xq + xr / 256)
// (xr: the 8-bit code of each activation's rounding error, int8_activations.h.)
// Decode reads each weight byte once, so these loops set batch-1 speed.
//
// 4-bit weights are tiled for it: rows in tiles of 16, and for each tile and block of 32 values, 256
// bytes where byte (j, i, t) (j < 4, i < 16, t < 4) holds value 4j + t of the block for row i in its
// low nibble and value 16 + 4j + t in its high one. One 64-byte load then gives, after an AND (or a
// shift and an AND), 16 rows x 4 values, and vpdpbusd against 4 activation bytes broadcast to every
// lane adds each row's 4 products into its own lane: a tile's 16 block sums come out in one register,
// with no horizontal additions. Scales and mins are float16 [N / 16, G, 16], a tile's 16 rows side by
// side. 8-bit weights are tiled the same way, a byte per value (int8_tiles.h).
// Without AVX-512 VNNI the same arithmetic runs as plain loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "folio_kernels.h"
#include "int8_activations.h"
#include "int8_tiles.h"
#include "int_widen.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FOLIO_VNNI 1
#endif

namespace {

using namespace folio_int8_dot;

constexpr int64_t X_TILE = 4;  // activation rows sharing each loaded weight

// With several passes of activation rows over each tile (pass `pass` of `passes`), the next tile's bytes
// [next, next + bytes) are prefetched a share per pass into L2: a model's weights do not stay in any
// cache between steps, and the hardware prefetcher, seeing each tile read again and again, does not
// run ahead into the next one. One pass streams, which it does follow.
inline void prefetch_share(const uint8_t* next, int64_t bytes, int64_t pass, int64_t passes) {
  if (passes < 2) return;
  const int64_t lines = (bytes + 63) / 64, from = lines * pass / passes, to = lines * (pass + 1) / passes;
  for (int64_t line = from; line < to; ++line) _mm_prefetch(reinterpret_cast<const char*>(next + 64 * line), _MM_HINT_T1);
}

// y [M, N] = the tiles' outputs. Tiles of 16 weight rows are dealt to the threads, and each tile's
// weights stay in L1 while every activation row passes over them, X_TILE rows at a time (a batch's
// activations fit in L2; a weight matrix often fits in no cache). tile_fn(tile, its codes, m0, rows,
// out) writes rows x 16 outputs to out, rows a std::integral_constant so that the tile kernels unroll.
template <typename F>
void over_tiles(int64_t M, int64_t N, const uint8_t* codes, int64_t tile_bytes, float* y, F tile_fn) {
  const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS, passes = (M + X_TILE - 1) / X_TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float out[X_TILE * TILE_ROWS];
    for (int64_t tile = begin; tile < end; ++tile) {
      const uint8_t* c = codes + tile * tile_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += X_TILE) {
        const int64_t rows = std::min(X_TILE, M - m0);
        if (tile + 1 < end) prefetch_share(c + tile_bytes, tile_bytes, m0 / X_TILE, passes);
        switch (rows) {
          case 4: tile_fn(tile, c, m0, std::integral_constant<int, 4>{}, out); break;
          case 3: tile_fn(tile, c, m0, std::integral_constant<int, 3>{}, out); break;
          case 2: tile_fn(tile, c, m0, std::integral_constant<int, 2>{}, out); break;
          default: tile_fn(tile, c, m0, std::integral_constant<int, 1>{}, out); break;
        }
        const int64_t n0 = tile * TILE_ROWS, valid = std::min(TILE_ROWS, N - n0);
        for (int64_t t = 0; t < rows; ++t) std::memcpy(y + (m0 + t) * N + n0, out + t * TILE_ROWS, valid * sizeof(float));
      }
    }
  });
}

// ---- 4-bit, tiled ----

// out[t][i] = y[m0 + t, row i of the tile], for TILE activation rows; EXACT: with the residuals.
template <int TILE, bool EXACT>
void int4_tile(const uint8_t* codes, const at::Half* scales, const at::Half* mins, const QuantizedRows& q,
               const float* group_sums, const int32_t* group_of_block, int64_t m0, int64_t K, int64_t G, float* out) {
  const int64_t B = K / BLOCK;
#ifdef FOLIO_VNNI
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* block = codes + b * TILE_BLOCK_BYTES;
    // Low and high nibbles, codes and residuals apart: up to four vpdpbusd chains per activation row,
    // so consecutive ones do not wait on each other's latency.
    __m512i sums[TILE][2], residual_sums[TILE][2];
    for (int t = 0; t < TILE; ++t)
      sums[t][0] = sums[t][1] = residual_sums[t][0] = residual_sums[t][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i packed = _mm512_loadu_si512(block + 64 * j);
      const __m512i low = _mm512_and_si512(packed, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
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
  for (int64_t g = 0; g < G; ++g) {
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * TILE_ROWS)));
    for (int t = 0; t < TILE; ++t) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(group_sums[(m0 + t) * G + g]), acc[t]);
  }
  for (int t = 0; t < TILE; ++t) _mm512_storeu_ps(out + t * TILE_ROWS, acc[t]);
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
            const int64_t low = b * BLOCK + 4 * j + v, high = low + 16;
            const int32_t xl = EXACT ? 256 * xq[low] + q.residuals[(m0 + t) * K + low] : xq[low];
            const int32_t xh = EXACT ? 256 * xq[high] + q.residuals[(m0 + t) * K + high] : xq[high];
            dot += (byte & 0x0F) * xl + (byte >> 4) * xh;
          }
        total += to_float(scales[group_of_block[b] * TILE_ROWS + i]) * q.steps[(m0 + t) * B + b] * static_cast<float>(dot);
      }
      for (int64_t g = 0; g < G; ++g) total += to_float(mins[g * TILE_ROWS + i]) * group_sums[(m0 + t) * G + g];
      out[t * TILE_ROWS + i] = total;
    }
  }
#endif
}

template <bool EXACT, typename T>
void int4_linear_impl(const T* x, int64_t M, int64_t K, const uint8_t* codes, const at::Half* scales,
                      const at::Half* mins, int64_t N, int64_t group, float* y) {
  const QuantizedRows q = quantize_rows(x, M, K, /*with_offsets=*/false, EXACT);
  const int64_t B = K / BLOCK, G = K / group;
  const std::vector<int32_t> group_of_block = groups_of_blocks(K, group);
  std::vector<float> group_sums(M * G);  // sum of x over each weight group
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) group_sums[m * G + group_of_block[b]] += q.sums[m * B + b];
  over_tiles(M, N, codes, B * TILE_BLOCK_BYTES, y, [&](int64_t tile, const uint8_t* c, int64_t m0, auto rows, float* out) {
    int4_tile<decltype(rows)::value, EXACT>(c, scales + tile * G * TILE_ROWS, mins + tile * G * TILE_ROWS, q,
                                             group_sums.data(), group_of_block.data(), m0, K, G, out);
  });
}

// ---- 8-bit, tiled (int8_tiles.h) ----

template <bool SPLIT, bool EXACT, typename T, typename S>
void int8_linear_impl(const T* x, int64_t M, int64_t K, const uint8_t* codes, const S* scales, int64_t N,
                      int64_t group, float* y) {
  const QuantizedRows q = quantize_rows(x, M, K, /*with_offsets=*/true, EXACT);
  const int64_t B = K / BLOCK, G = K / group;
  const std::vector<int32_t> group_of_block = groups_of_blocks(K, group);
  over_tiles(M, N, codes, B * INT8_TILE_BLOCK_BYTES, y, [&](int64_t tile, const uint8_t* c, int64_t m0, auto rows, float* out) {
    int8_tile<decltype(rows)::value, SPLIT, EXACT>(c, scales + tile * G * TILE_ROWS, q, group_of_block.data(), m0, K, out);
  });
}

// 4-bit weights take groups of 32 or a multiple of 64; 8-bit ones also groups of 16 (Q6_K's).
void check_x(const torch::Tensor& x, int64_t group, bool eight_bit) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % BLOCK == 0 && K % group == 0, "K must be a multiple of 32 and of the group size");
  TORCH_CHECK(group == BLOCK || group % (2 * BLOCK) == 0 || (eight_bit && group == HALF),
              "the group size must be 32 or a multiple of 64 (or 16 for 8-bit weights)");
}

// Calls f(typed x pointer).
template <typename F>
void with_x(const torch::Tensor& x, F f) {
  if (x.scalar_type() == torch::kBFloat16) {
    f(x.data_ptr<at::BFloat16>());
  } else {
    f(x.data_ptr<float>());
  }
}

torch::Tensor in_x_dtype(const torch::Tensor& y, const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
}

}  // namespace

// 4-bit: tiles uint8 [ceil(N / 16), K / 32 * 256] as above; scales, mins float16 [ceil(N / 16), G, 16].
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales, torch::Tensor mins,
                          int64_t group, int64_t N, bool exact) {
  check_x(x, group, /*eight_bit=*/false);
  const int64_t M = x.size(0), K = x.size(1), tile_count = (N + TILE_ROWS - 1) / TILE_ROWS, G = K / group;
  TORCH_CHECK(tiles.scalar_type() == torch::kUInt8 && tiles.is_contiguous() &&
              tiles.numel() == tile_count * (K / BLOCK) * TILE_BLOCK_BYTES, "tiles: uint8 [N / 16, K / 32 * 256]");
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->is_contiguous() && t->numel() == tile_count * G * TILE_ROWS,
                "scales, mins: float16 [N / 16, K / group, 16]");
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  with_x(x, [&](auto* xs) {
    const uint8_t* c = tiles.data_ptr<uint8_t>();
    const at::Half *s = scales.data_ptr<at::Half>(), *m = mins.data_ptr<at::Half>();
    if (exact) {
      int4_linear_impl<true>(xs, M, K, c, s, m, N, group, y.data_ptr<float>());
    } else {
      int4_linear_impl<false>(xs, M, K, c, s, m, N, group, y.data_ptr<float>());
    }
  });
  return in_x_dtype(y, x);
}

// 8-bit: tiles uint8 [ceil(N / 16), K / 32 * 512] (int8_tiles.h); scales float16 or float32 [ceil(N / 16), G, 16].
// Writes x @ W^T into y (float32 [M, N]).
void int8_linear_to(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& scales, int64_t group,
                    int64_t N, bool exact, torch::Tensor& y) {
  check_x(x, group, /*eight_bit=*/true);
  const int64_t M = x.size(0), K = x.size(1), tile_count = (N + TILE_ROWS - 1) / TILE_ROWS, G = K / group;
  TORCH_CHECK(tiles.scalar_type() == torch::kUInt8 && tiles.is_contiguous() &&
              tiles.numel() == tile_count * (K / BLOCK) * INT8_TILE_BLOCK_BYTES, "tiles: uint8 [N / 16, K / 32 * 512]");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == tile_count * G * TILE_ROWS, "scales: [N / 16, K / group, 16]");
  TORCH_CHECK(y.scalar_type() == torch::kFloat32 && y.is_contiguous() && y.dim() == 2 && y.size(0) == M && y.size(1) == N,
              "out: contiguous float32 [M, N]");
  const uint8_t* c = tiles.data_ptr<uint8_t>();
  with_x(x, [&](auto* xs) {
    auto run = [&](const auto* s) {
      float* out = y.data_ptr<float>();
      if (group == HALF) {
        exact ? int8_linear_impl<true, true>(xs, M, K, c, s, N, group, out)
              : int8_linear_impl<true, false>(xs, M, K, c, s, N, group, out);
      } else {
        exact ? int8_linear_impl<false, true>(xs, M, K, c, s, N, group, out)
              : int8_linear_impl<false, false>(xs, M, K, c, s, N, group, out);
      }
    };
    if (scales.scalar_type() == torch::kHalf) {
      run(scales.data_ptr<at::Half>());
    } else {
      TORCH_CHECK(scales.scalar_type() == torch::kFloat32, "scales: float16 or float32");
      run(scales.data_ptr<float>());
    }
  });
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales, int64_t group, int64_t N,
                          bool exact) {
  auto y = torch::empty({x.size(0), N}, x.options().dtype(torch::kFloat32));
  int8_linear_to(x, tiles, scales, group, N, exact, y);
  return in_x_dtype(y, x);
}

// The same into `out` (float32 [M, N]) for float32 x: for a caller that reuses one large buffer, which
// allocated afresh would be mapped anew and fault in page by page on every call.
torch::Tensor int8_linear_into(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales, int64_t group, int64_t N,
                               bool exact, torch::Tensor out) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x: float32 (out is float32)");
  int8_linear_to(x, tiles, scales, group, N, exact, out);
  return out;
}

// x's rows as the kernels see them: int8 codes, one float scale per block of 32, and the residual codes
// (for tests).
std::vector<torch::Tensor> quantize_activations(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32 && x.size(1) % BLOCK == 0,
              "x: contiguous float32 [M, K], K a multiple of 32");
  const QuantizedRows q = quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), false);
  auto codes = torch::from_blob(const_cast<int8_t*>(q.codes.data()), {x.size(0), x.size(1)}, torch::kInt8).clone();
  auto residuals = torch::from_blob(const_cast<int8_t*>(q.residuals.data()), {x.size(0), x.size(1)}, torch::kInt8).clone();
  auto scales = torch::from_blob(const_cast<float*>(q.scales.data()), {x.size(0), x.size(1) / BLOCK}, torch::kFloat32).clone();
  return {codes, scales, residuals};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // exact: activations in 8 + 8 bits (the default); False: 8 bits, as llama.cpp's Q8 activations.
  m.def("int4_linear", &int4_linear, py::call_guard<py::gil_scoped_release>(), "x @ W^T, W 4-bit in tiles of 16 rows, by int8 dot products",
        py::arg("x"), py::arg("tiles"), py::arg("scales"), py::arg("mins"), py::arg("group"), py::arg("rows"), py::arg("exact") = true);
  m.def("int8_linear", &int8_linear, py::call_guard<py::gil_scoped_release>(), "x @ W^T, W 8-bit in groups and tiles of 16 rows, by int8 dot products",
        py::arg("x"), py::arg("tiles"), py::arg("scales"), py::arg("group"), py::arg("rows"), py::arg("exact") = true);
  m.def("int8_linear_into", &int8_linear_into, py::call_guard<py::gil_scoped_release>(), "int8_linear written into out",
        py::arg("x"), py::arg("tiles"), py::arg("scales"), py::arg("group"), py::arg("rows"), py::arg("exact"), py::arg("out"));
  m.def("int8_dequantize", &int8_dequantize, py::call_guard<py::gil_scoped_release>(), "the tiled 8-bit weight widened, [N, K]");
  m.def("int4_dequantize", &int4_dequantize, py::call_guard<py::gil_scoped_release>(), "the tiled 4-bit weight widened, [N, K]");
  m.def("quantize_activations", &quantize_activations, py::call_guard<py::gil_scoped_release>(), "x as int8 blocks of 32 and their scales");
  // For C++ callers in other extensions (decode_stack.cpp), typed by folio_kernels.h.
  py::dict entries;
  folio::add_entry<folio::Int4Linear>(entries, &int4_linear);
  folio::add_entry<folio::Int8Linear>(entries, &int8_linear);
  m.attr("entries") = entries;
}
