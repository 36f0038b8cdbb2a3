// How the int8 dot-product kernels (int8_dot.cpp, int8_greedy.h) walk a tiled weight: tiles of 16 weight
// rows dealt to the threads, each tile's weights kept in L1 while every activation row passes over them,
// X_TILE rows at a time (a batch's activations fit in L2; a weight matrix often fits in no cache).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "int8_tiles.h"

namespace folio_int8_dot {

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

// tile_fn(tile, its codes, m0, rows, out) writes rows x 16 outputs to out, rows a std::integral_constant
// so that the tile kernels unroll; take(tile, m0, rows, out) then uses them, on the same thread. Tiles
// [begin, end), on this thread.
template <typename F, typename Take>
void over_tile_range(int64_t begin, int64_t end, int64_t M, const uint8_t* codes, int64_t tile_bytes, F& tile_fn,
                     Take& take) {
  const int64_t passes = (M + X_TILE - 1) / X_TILE;
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
      take(tile, m0, rows, static_cast<const float*>(out));
    }
  }
}

// over_tile_range over all the weight's tiles, dealt to the threads.
template <typename F, typename Take>
void over_tile_passes(int64_t M, int64_t N, const uint8_t* codes, int64_t tile_bytes, F tile_fn, Take take) {
  const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    over_tile_range(begin, end, M, codes, tile_bytes, tile_fn, take);
  });
}

// Each tile's outputs into y's rows (ldy floats apart), columns 16 * tile on.
inline auto into_rows(float* y, int64_t N, int64_t ldy) {
  return [=](int64_t tile, int64_t m0, int64_t rows, const float* out) {
    const int64_t n0 = tile * TILE_ROWS, valid = std::min(TILE_ROWS, N - n0);
    for (int64_t t = 0; t < rows; ++t) std::memcpy(y + (m0 + t) * ldy + n0, out + t * TILE_ROWS, valid * sizeof(float));
  };
}

// y [M, N] = the tiles' outputs.
template <typename F>
void over_tiles(int64_t M, int64_t N, const uint8_t* codes, int64_t tile_bytes, float* y, F tile_fn) {
  over_tile_passes(M, N, codes, tile_bytes, tile_fn, into_rows(y, N, N));
}

}  // namespace folio_int8_dot
