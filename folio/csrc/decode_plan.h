// A decode step's projection as a team (decode_team.h) multiplies it: its tiled weights as raw memory
// (folio::TiledWeight, made and laid out by int8_dot.cpp), its tiles' hand-out and their prefetching.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "decode_team.h"
#include "folio_kernels.h"

namespace folio_decode {

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
    const int64_t chunk = std::max<int64_t>(1, kClaimBytes / w.code_bytes);
    state.halves[p][0].reset(0, w.tile_count / 2, chunk);
    state.halves[p][1].reset(w.tile_count / 2, w.tile_count, chunk);
  }
}

// Tiles [t0, t1) of w in cache: codes, fifth bits, scales and mins; returns what is left of the budget.
inline int64_t prefetch_tiles(const folio::TiledWeight& w, int64_t t0, int64_t t1, const Team& team, int64_t budget) {
  const int64_t epoch = team.epoch, n = t1 - t0;
  const std::atomic<int64_t>& stop = team.state.serial_done;
  budget = prefetch_until(w.tiles + t0 * w.code_bytes, n * w.code_bytes, stop, epoch, budget);
  if (w.high_bits) budget = prefetch_until(w.high_bits + t0 * w.fifth_bytes, n * w.fifth_bytes, stop, epoch, budget);
  budget = prefetch_until(static_cast<const char*>(w.scales) + t0 * w.scale_bytes, n * w.scale_bytes, stop, epoch, budget);
  if (w.mins) budget = prefetch_until(reinterpret_cast<const char*>(w.mins) + t0 * w.min_bytes, n * w.min_bytes, stop, epoch, budget);
  return budget;
}

// A thread other than 0, while thread 0 works alone: the first of the tiles of `plan` it owns, up to
// kPrefetchCapBytes or until the work is done.
inline void prefetch_first_tiles(const Plan* plan, const Team& team) {
  if (plan == nullptr) return;
  int64_t budget = kPrefetchCapBytes;
  for (const folio::TiledWeight& w : plan->parts) {
    int64_t begin, end;
    own_tiles(w.tile_count, team.id, team.size, &begin, &end);
    budget = prefetch_tiles(w, begin, end, team, budget);
    if (budget <= 0) return;
  }
}

}  // namespace folio_decode
