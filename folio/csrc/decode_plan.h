// A decode step's projection as a team (decode_team.h) multiplies it: its tiled weights as raw memory
// (folio::TiledWeight), the bytes each tile spans for prefetching, and the tiles' hand-out.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "decode_team.h"
#include "folio_kernels.h"

namespace folio_decode {

constexpr int64_t kBlock = 32, kTileRows = 16;  // int8_dot.cpp's activation block and rows per tile

inline int64_t tile_count(const folio::TiledWeight& w) { return (w.rows + kTileRows - 1) / kTileRows; }
inline int64_t code_bytes_per_tile(const folio::TiledWeight& w) { return w.cols / kBlock * (w.bits == 8 ? 512 : 256); }

// The weight of `tiles` (uint8 [ceil(rows / 16), K / 32 * bytes_per_block]) and its scales, as the
// kernel entries check it, else nullopt (the projection then keeps the kernel-by-kernel path).
inline std::optional<folio::TiledWeight> tiled_weight(int bits, const torch::Tensor& tiles, const torch::Tensor& high_bits,
                                                      const torch::Tensor& scales, const torch::Tensor* mins,
                                                      int64_t group, int64_t rows, bool exact) {
  const int64_t count = (rows + kTileRows - 1) / kTileRows, block_bytes = bits == 8 ? 512 : 256;
  if (count == 0 || group <= 0 || tiles.scalar_type() != torch::kUInt8 || !tiles.is_contiguous() ||
      tiles.numel() % (count * block_bytes) != 0)
    return std::nullopt;
  const int64_t K = tiles.numel() / (count * block_bytes) * kBlock, G = K / group;
  const bool half = scales.scalar_type() == torch::kHalf;
  if (K % group != 0 || !scales.is_contiguous() || scales.numel() != count * G * kTileRows ||
      (!half && (bits != 8 || scales.scalar_type() != torch::kFloat32)))
    return std::nullopt;
  if (mins && (mins->scalar_type() != torch::kHalf || !mins->is_contiguous() || mins->numel() != scales.numel()))
    return std::nullopt;
  if (bits == 5 && (!high_bits.is_contiguous() || high_bits.numel() != count * (K / kBlock) * 64)) return std::nullopt;
  return folio::TiledWeight{bits, tiles.data_ptr<uint8_t>(), bits == 5 ? high_bits.data_ptr<uint8_t>() : nullptr,
                            scales.data_ptr(), half, mins ? mins->data_ptr<at::Half>() : nullptr, group, rows, K, exact};
}

// A projection for the team: its tiled weights, output columns in order (one, or a fused projection's
// row blocks), and the bias added to the joined output.
struct Plan {
  std::vector<folio::TiledWeight> parts;
  std::optional<torch::Tensor> bias;
  int64_t cols = 0, rows = 0;  // input width (K) and output columns
  bool tiled = false;          // every part 4/5/8-bit tiles of one width: the team can multiply it
};

// Thread 0, before the team multiplies `plan`: its tiles ready to be handed out.
inline void ready_tiles(TeamState& state, const Plan& plan) {
  for (size_t p = 0; p < plan.parts.size(); ++p) {
    const folio::TiledWeight& w = plan.parts[p];
    const int64_t tiles = tile_count(w), chunk = std::max<int64_t>(1, kClaimBytes / code_bytes_per_tile(w));
    state.halves[p][0].reset(0, tiles / 2, chunk);
    state.halves[p][1].reset(tiles / 2, tiles, chunk);
  }
}

// Tiles [t0, t1) of w in cache: codes, fifth bits, scales and mins; returns what is left of the budget.
inline int64_t prefetch_tiles(const folio::TiledWeight& w, int64_t t0, int64_t t1, const Team& team, int64_t budget) {
  const int64_t blocks = w.cols / kBlock, groups = w.cols / w.group, code_bytes = code_bytes_per_tile(w);
  const int64_t scale_bytes = groups * kTileRows * (w.half_scales ? 2 : 4), min_bytes = w.mins ? groups * kTileRows * 2 : 0;
  const int64_t epoch = team.epoch;
  const std::atomic<int64_t>& stop = team.state.serial_done;
  budget = prefetch_until(w.tiles + t0 * code_bytes, (t1 - t0) * code_bytes, stop, epoch, budget);
  if (w.high_bits) budget = prefetch_until(w.high_bits + t0 * blocks * 64, (t1 - t0) * blocks * 64, stop, epoch, budget);
  budget = prefetch_until(static_cast<const char*>(w.scales) + t0 * scale_bytes, (t1 - t0) * scale_bytes, stop, epoch, budget);
  if (w.mins) budget = prefetch_until(w.mins + t0 * min_bytes / 2, (t1 - t0) * min_bytes, stop, epoch, budget);
  return budget;
}

// A thread other than 0, while thread 0 works alone: the first of the tiles of `plan` it owns, up to
// kPrefetchCapBytes or until the work is done.
inline void prefetch_first_tiles(const Plan* plan, const Team& team) {
  if (plan == nullptr) return;
  int64_t budget = kPrefetchCapBytes;
  for (const folio::TiledWeight& w : plan->parts) {
    int64_t begin, end;
    own_tiles(tile_count(w), team.id, team.size, &begin, &end);
    budget = prefetch_tiles(w, begin, end, team, budget);
    if (budget <= 0) return;
  }
}

}  // namespace folio_decode
