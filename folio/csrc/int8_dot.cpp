// y = x @ W^T for 4-, 5- and 8-bit weights by integer dot products, the way llama.cpp computes them,
// with activations coded in 8 + 8 bits instead of 8.
//
// Each row of x is first quantized to int8 in blocks of 32 (one float scale per block, as GGUF's
// Q8_0), so a block's dot product with the weight's codes is exact integer arithmetic: 64 multiply-adds
// per AVX-512 VNNI instruction (vpdpbusd, unsigned x signed bytes). Only block results are scaled:
//   4-bit, W[n, k] = codes[n, k] * s[n, g] + m[n, g]   (codes 0..15, or 0..31 with 5 bits; groups 32 or a
//                                                        multiple of 64)
//     y[n] = sum_b s[n, g(b)] * dx[b] * dot_b(codes, xq + xr / 256) + sum_g m[n, g] * sum_{k in g} x[k]
//   8-bit, W[n, k] = codes[n, k] * s[n, g]             (codes -128..127; groups 16, 32 or a multiple of 64)
//     y[n] = sum_b s[n, g(b)] * dx[b] * dot_b(codes, xq + xr / 256)
// (xr: the 8-bit code of each activation's rounding error, int8_activations.h.)
// Decode reads each weight byte once, so these loops set batch-1 speed.
//
// Weights are tiled by 16 rows, one per AVX-512 lane, so a tile's 16 block sums come out in one register
// with no horizontal additions: 4-bit codes (and 5-bit ones' fifth bits) as int4_tiles.h lays them out,
// 8-bit codes a byte per value (int8_tiles.h).
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
#include "int8_greedy.h"
#include "int4_tiles.h"
#include "int8_tiles.h"
#include "int_widen.h"
#include "tile_passes.h"

namespace {

using namespace folio_int8_dot;

// The tiles of y = x @ W^T: all of them, dealt to the threads (no source; y's rows N apart), or those
// `source` hands this thread (LinearTiles; y's rows ldy apart).
template <typename F>
void run_tiles(int64_t M, int64_t N, const uint8_t* codes, int64_t tile_bytes, float* y, int64_t ldy,
               const folio::TileSource* source, F tile_fn) {
  if (source == nullptr) return over_tiles(M, N, codes, tile_bytes, y, tile_fn);
  auto take = into_rows(y, N, ldy);
  int64_t begin = 0, end = 0;
  while (source->next(source->state, &begin, &end)) over_tile_range(begin, end, M, codes, tile_bytes, tile_fn, take);
}

// ---- 4- and 5-bit, tiled (int4_tiles.h) ----

// Activation rows from which a 5-bit tile is widened to the 8-bit layout once, for every pass over it
// (two or more passes of X_TILE rows), instead of unpacking its nibbles and fifth bits on each pass
// (which at 64 or more rows ran ~15% behind the 8-bit tiles; 4-bit tiles keep pace unwidened).
constexpr int64_t WIDEN_TILE_MIN_ROWS = 2 * X_TILE;

template <bool EXACT, bool FIVE, typename T>
void int4_linear_impl(const T* x, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* high,
                      const at::Half* scales, const at::Half* mins, int64_t N, int64_t group, float* y,
                      int64_t ldy = 0, const folio::TileSource* source = nullptr) {
  const bool widen = FIVE && M >= WIDEN_TILE_MIN_ROWS;
  const QuantizedRows q = quantize_rows(x, M, K, /*with_offsets=*/widen, EXACT);
  const int64_t B = K / BLOCK, G = K / group;
  const std::vector<int32_t> group_of_block = groups_of_blocks(K, group);
  std::vector<float> group_sums(M * G);  // sum of x over each weight group
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) group_sums[m * G + group_of_block[b]] += q.sums[m * B + b];
  run_tiles(M, N, codes, B * TILE_BLOCK_BYTES, y, ldy, source, [&](int64_t tile, const uint8_t* c, int64_t m0, auto rows, float* out) {
    constexpr int TILE = decltype(rows)::value;
    const uint8_t* tile_high = FIVE ? high + tile * B * FIFTH_BIT_BLOCK_BYTES : nullptr;
    const at::Half *tile_scales = scales + tile * G * TILE_ROWS, *tile_mins = mins + tile * G * TILE_ROWS;
    if (!widen) {
      int4_tile<TILE, EXACT, FIVE>(c, tile_high, tile_scales, tile_mins, q, group_sums.data(), group_of_block.data(),
                                   m0, K, G, out);
      return;
    }
    WidenedTile& wide = widened_tile();
    if (m0 == 0) {
      wide.codes.resize(B * INT8_TILE_BLOCK_BYTES);
      wide.symmetric = mins_are_minus_16_scales(tile_scales, tile_mins, G);
      widen_tile_to_int8<FIVE>(c, tile_high, B, wide.symmetric ? 128 - 16 : 128, wide.codes.data());
    }
    int8_tile<TILE, /*SPLIT=*/false, EXACT>(wide.codes.data(), tile_scales, q, group_of_block.data(), m0, K, out);
    if (!wide.symmetric) add_mins<TILE>(tile_mins, group_sums.data(), m0, G, out);
  });
}

// ---- 8-bit, tiled (int8_tiles.h) ----

template <bool SPLIT, bool EXACT, typename T, typename S>
void int8_linear_impl(const T* x, int64_t M, int64_t K, const uint8_t* codes, const S* scales, int64_t N,
                      int64_t group, float* y, int64_t ldy = 0, const folio::TileSource* source = nullptr) {
  const QuantizedRows q = quantize_rows(x, M, K, /*with_offsets=*/true, EXACT);
  const int64_t B = K / BLOCK, G = K / group;
  const std::vector<int32_t> group_of_block = groups_of_blocks(K, group);
  run_tiles(M, N, codes, B * INT8_TILE_BLOCK_BYTES, y, ldy, source, [&](int64_t tile, const uint8_t* c, int64_t m0, auto rows, float* out) {
    int8_tile<decltype(rows)::value, SPLIT, EXACT>(c, scales + tile * G * TILE_ROWS, q, group_of_block.data(), m0, K, out);
  });
}

// Whether a 4-bit weight has fifth bits: high_bits empty (4-bit) or uint8 [tiles, K / 32 * 64] (5-bit).
bool check_high_bits(const torch::Tensor& high_bits, int64_t tile_count, int64_t K) {
  if (high_bits.numel() == 0) return false;
  TORCH_CHECK(high_bits.scalar_type() == torch::kUInt8 && high_bits.is_contiguous() &&
              high_bits.numel() == tile_count * (K / BLOCK) * FIFTH_BIT_BLOCK_BYTES,
              "high_bits: empty, or uint8 [N / 16, K / 32 * 64]");
  return true;
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

// An 8-bit weight: tiles uint8 [ceil(N / 16), K / 32 * 512], scales float16 or float32 [ceil(N / 16), G, 16].
void check_int8_weight(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& scales, int64_t group,
                       int64_t N) {
  check_x(x, group, /*eight_bit=*/true);
  const int64_t K = x.size(1), tile_count = (N + TILE_ROWS - 1) / TILE_ROWS, G = K / group;
  TORCH_CHECK(tiles.scalar_type() == torch::kUInt8 && tiles.is_contiguous() &&
              tiles.numel() == tile_count * (K / BLOCK) * INT8_TILE_BLOCK_BYTES, "tiles: uint8 [N / 16, K / 32 * 512]");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == tile_count * G * TILE_ROWS, "scales: [N / 16, K / group, 16]");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf || scales.scalar_type() == torch::kFloat32, "scales: float16 or float32");
}

// A 4- or 5-bit weight: tiles uint8 [ceil(N / 16), K / 32 * 256], scales and mins float16
// [ceil(N / 16), G, 16]; returns whether it has fifth bits.
bool check_int4_weight(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& high_bits,
                       const torch::Tensor& scales, const torch::Tensor& mins, int64_t group, int64_t N) {
  check_x(x, group, /*eight_bit=*/false);
  const int64_t K = x.size(1), tile_count = (N + TILE_ROWS - 1) / TILE_ROWS, G = K / group;
  TORCH_CHECK(tiles.scalar_type() == torch::kUInt8 && tiles.is_contiguous() &&
              tiles.numel() == tile_count * (K / BLOCK) * TILE_BLOCK_BYTES, "tiles: uint8 [N / 16, K / 32 * 256]");
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->is_contiguous() && t->numel() == tile_count * G * TILE_ROWS,
                "scales, mins: float16 [N / 16, K / group, 16]");
  return check_high_bits(high_bits, tile_count, K);
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
// 5-bit: the same, and high_bits uint8 [ceil(N / 16), K / 32 * 64] (int8_tiles.h); 4-bit: high_bits empty.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor high_bits, torch::Tensor scales,
                          torch::Tensor mins, int64_t group, int64_t N, bool exact) {
  const bool five = check_int4_weight(x, tiles, high_bits, scales, mins, group, N);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  with_x(x, [&](auto* xs) {
    const uint8_t* c = tiles.data_ptr<uint8_t>();
    const uint8_t* h = five ? high_bits.data_ptr<uint8_t>() : nullptr;
    const at::Half *s = scales.data_ptr<at::Half>(), *m = mins.data_ptr<at::Half>();
    float* out = y.data_ptr<float>();
    if (five) {
      exact ? int4_linear_impl<true, true>(xs, M, K, c, h, s, m, N, group, out)
            : int4_linear_impl<false, true>(xs, M, K, c, h, s, m, N, group, out);
    } else {
      exact ? int4_linear_impl<true, false>(xs, M, K, c, h, s, m, N, group, out)
            : int4_linear_impl<false, false>(xs, M, K, c, h, s, m, N, group, out);
    }
  });
  return in_x_dtype(y, x);
}

// 8-bit: tiles uint8 [ceil(N / 16), K / 32 * 512] (int8_tiles.h); scales float16 or float32 [ceil(N / 16), G, 16].
// Writes x @ W^T into y (float32 [M, N]).
void int8_linear_to(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& scales, int64_t group,
                    int64_t N, bool exact, torch::Tensor& y) {
  check_int8_weight(x, tiles, scales, group, N);
  const int64_t M = x.size(0), K = x.size(1);
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

// LinearTiles (folio_kernels.h): the tiles `source` hands this thread, of x [M, K] float32 @ W^T into y.
// The caller checked the weight (decode_stack.cpp builds it from tensors these entries accept).
void linear_tiles(const folio::TiledWeight& w, const float* x, int64_t M, float* y, int64_t ldy,
                  const folio::TileSource& source) {
  const int64_t K = w.cols, N = w.rows;
  if (w.bits != 8) {
    const auto* s = static_cast<const at::Half*>(w.scales);
    if (w.bits == 5) {
      w.exact ? int4_linear_impl<true, true>(x, M, K, w.tiles, w.high_bits, s, w.mins, N, w.group, y, ldy, &source)
              : int4_linear_impl<false, true>(x, M, K, w.tiles, w.high_bits, s, w.mins, N, w.group, y, ldy, &source);
    } else {
      w.exact ? int4_linear_impl<true, false>(x, M, K, w.tiles, nullptr, s, w.mins, N, w.group, y, ldy, &source)
              : int4_linear_impl<false, false>(x, M, K, w.tiles, nullptr, s, w.mins, N, w.group, y, ldy, &source);
    }
    return;
  }
  auto run = [&](const auto* s) {
    if (w.group == HALF) {
      w.exact ? int8_linear_impl<true, true>(x, M, K, w.tiles, s, N, w.group, y, ldy, &source)
              : int8_linear_impl<true, false>(x, M, K, w.tiles, s, N, w.group, y, ldy, &source);
    } else {
      w.exact ? int8_linear_impl<false, true>(x, M, K, w.tiles, s, N, w.group, y, ldy, &source)
              : int8_linear_impl<false, false>(x, M, K, w.tiles, s, N, w.group, y, ldy, &source);
    }
  };
  w.half_scales ? run(static_cast<const at::Half*>(w.scales)) : run(static_cast<const float*>(w.scales));
}

// TiledWeightOf (folio_kernels.h): K from the tiles' size, then the entries' own checks on a
// zero-row x of that width.
folio::TiledWeight tiled_weight_of(const torch::Tensor& tiles, const torch::Tensor& high_bits, const torch::Tensor& scales,
                                   const torch::Tensor* mins, int64_t group, int64_t N, bool exact) {
  const bool eight = mins == nullptr;
  const int64_t count = (N + TILE_ROWS - 1) / TILE_ROWS, block_bytes = eight ? INT8_TILE_BLOCK_BYTES : TILE_BLOCK_BYTES;
  TORCH_CHECK(count > 0 && tiles.numel() % (count * block_bytes) == 0, "tiles: uint8 [N / 16, K / 32 * ", block_bytes, "]");
  const int64_t K = tiles.numel() / (count * block_bytes) * BLOCK;
  const torch::Tensor x = torch::empty({0, K}, torch::kFloat32);
  const bool five = eight ? false : check_int4_weight(x, tiles, high_bits, scales, *mins, group, N);
  if (eight) check_int8_weight(x, tiles, scales, group, N);
  const int64_t G = K / group, B = K / BLOCK;
  return {eight ? 8 : five ? 5 : 4, tiles.data_ptr<uint8_t>(), five ? high_bits.data_ptr<uint8_t>() : nullptr,
          scales.data_ptr(), scales.scalar_type() == torch::kHalf, eight ? nullptr : mins->data_ptr<at::Half>(),
          group, N, K, exact, count, B * block_bytes, five ? B * FIFTH_BIT_BLOCK_BYTES : 0,
          G * TILE_ROWS * static_cast<int64_t>(scales.element_size()), eight ? 0 : G * TILE_ROWS * 2};
}

// The greedy pick of x's rows (float32 or bfloat16 [M, K]) over an 8-bit weight in two stages
// (int8_greedy.h): best (float64 [M, 3]: each row's maximum of x @ W^T in x's dtype, its first index, 0)
// and decided ([M] bool: false where the caller's full product decides). norms: float32 [N], each
// weight row's Euclidean norm. six: int8_six_bit_tiles' tiles for the first pass to read (norms then
// bounding ||W~_i|| too), or empty for the 8-bit first pass.
std::vector<torch::Tensor> int8_greedy(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales, int64_t group,
                                       int64_t N, torch::Tensor norms, torch::Tensor six) {
  check_int8_weight(x, tiles, scales, group, N);
  TORCH_CHECK(norms.scalar_type() == torch::kFloat32 && norms.is_contiguous() && norms.numel() == N,
              "norms: contiguous float32 [N]");
  const int64_t M = x.size(0), K = x.size(1);
  if (six.numel() > 0)
    TORCH_CHECK(group % BLOCK == 0 && six.scalar_type() == torch::kUInt8 && six.is_contiguous() &&
                six.numel() == tiles.numel() / INT8_TILE_BLOCK_BYTES * SIX_BIT_BLOCK_BYTES,
                "six: the weight's six-bit tiles (int8_six_bit_tiles), groups a multiple of 32");
  const uint8_t* six_bit = six.numel() > 0 ? six.data_ptr<uint8_t>() : nullptr;
  auto best = torch::zeros({M, 3}, x.options().dtype(torch::kFloat64));
  auto decided = torch::zeros({M}, x.options().dtype(torch::kBool));
  const uint8_t* c = tiles.data_ptr<uint8_t>();
  with_x(x, [&](const auto* xs) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(xs)>>;
    auto run = [&](const auto* s) {
      using S = std::remove_cv_t<std::remove_pointer_t<decltype(s)>>;
      auto pick = group == HALF ? greedy_rows<true, S, T> : greedy_rows<false, S, T>;
      pick(xs, M, K, c, s, N, group, norms.data_ptr<float>(), six_bit, best.data_ptr<double>(), decided.data_ptr<bool>());
    };
    if (scales.scalar_type() == torch::kHalf) {
      run(scales.data_ptr<at::Half>());
    } else {
      run(scales.data_ptr<float>());
    }
  });
  return {best, decided};
}

// The six high bits of a tiled 8-bit weight's codes (six_bit_pass.h), groups a multiple of 32: [six-bit
// tiles, ||W~_i|| [N], ||W_i - W~_i|| [N]], the norms rounded up.
std::vector<torch::Tensor> int8_six_bit_tiles(torch::Tensor tiles, torch::Tensor scales, int64_t group, int64_t N) {
  const int64_t count = (N + TILE_ROWS - 1) / TILE_ROWS;
  TORCH_CHECK(count > 0 && tiles.numel() % (count * INT8_TILE_BLOCK_BYTES) == 0, "tiles: uint8 [N / 16, K / 32 * 512]");
  const int64_t K = tiles.numel() / (count * INT8_TILE_BLOCK_BYTES) * BLOCK;
  TORCH_CHECK(group % BLOCK == 0, "six-bit tiles take groups of a multiple of 32, not ", group);
  check_int8_weight(torch::empty({0, K}, torch::kFloat32), tiles, scales, group, N);
  const int64_t B = K / BLOCK, G = K / group;
  auto six = torch::empty({count, B * SIX_BIT_BLOCK_BYTES}, tiles.options());
  auto approx_norms = torch::empty({N}, tiles.options().dtype(torch::kFloat32));
  auto residual_norms = torch::empty({N}, tiles.options().dtype(torch::kFloat32));
  auto run = [&](const auto* s) {
    six_bit_tiles(tiles.data_ptr<uint8_t>(), s, count, B, G, N, six.data_ptr<uint8_t>(), approx_norms.data_ptr<float>(),
                  residual_norms.data_ptr<float>());
  };
  scales.scalar_type() == torch::kHalf ? run(scales.data_ptr<at::Half>()) : run(scales.data_ptr<float>());
  return {six, approx_norms, residual_norms};
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
  m.def("int4_linear", &int4_linear, py::call_guard<py::gil_scoped_release>(), "x @ W^T, W 4- or 5-bit in tiles of 16 rows, by int8 dot products",
        py::arg("x"), py::arg("tiles"), py::arg("high_bits"), py::arg("scales"), py::arg("mins"), py::arg("group"), py::arg("rows"), py::arg("exact") = true);
  m.def("int8_linear", &int8_linear, py::call_guard<py::gil_scoped_release>(), "x @ W^T, W 8-bit in groups and tiles of 16 rows, by int8 dot products",
        py::arg("x"), py::arg("tiles"), py::arg("scales"), py::arg("group"), py::arg("rows"), py::arg("exact") = true);
  m.def("int8_linear_into", &int8_linear_into, py::call_guard<py::gil_scoped_release>(), "int8_linear written into out",
        py::arg("x"), py::arg("tiles"), py::arg("scales"), py::arg("group"), py::arg("rows"), py::arg("exact"), py::arg("out"));
  m.def("int8_greedy", &int8_greedy, py::call_guard<py::gil_scoped_release>(), "each row's argmax of x @ W^T, W 8-bit, from its 8-bit product and the tiles near the top",
        py::arg("x"), py::arg("tiles"), py::arg("scales"), py::arg("group"), py::arg("rows"), py::arg("norms"), py::arg("six"));
  m.def("int8_six_bit_tiles", &int8_six_bit_tiles, py::call_guard<py::gil_scoped_release>(),
        "the six high bits of a tiled 8-bit weight's codes, for the greedy pick's first pass, and the row norms it needs");
  m.def("int8_dequantize", &int8_dequantize, py::call_guard<py::gil_scoped_release>(), "the tiled 8-bit weight widened, [N, K]");
  m.def("int8_embedding", &int8_embedding, py::call_guard<py::gil_scoped_release>(),
        "rows `ids` of the tiled 8-bit weight widened, [len(ids), K]: an embedding lookup");
  m.def("int4_dequantize", &int4_dequantize, py::call_guard<py::gil_scoped_release>(), "the tiled 4- or 5-bit weight widened, [N, K]");
  m.def("quantize_activations", &quantize_activations, py::call_guard<py::gil_scoped_release>(), "x as int8 blocks of 32 and their scales");
  // For C++ callers in other extensions (decode_stack.cpp), typed by folio_kernels.h.
  py::dict entries;
  folio::add_entry<folio::Int4Linear>(entries, &int4_linear);
  folio::add_entry<folio::Int8Linear>(entries, &int8_linear);
  folio::add_entry<folio::LinearTiles>(entries, &linear_tiles);
  folio::add_entry<folio::TiledWeightOf>(entries, &tiled_weight_of);
  m.attr("entries") = entries;
}
