// The threads of a small decode step (decode_stack.cpp) kept in one parallel region per layer.
//
// Driven kernel by kernel, a batch-1 step opens a parallel region for every projection (~5 a layer) and
// runs the work between them (norms, rotary, the KV cache's slots, the activation) on one thread while
// the others wait: on a 2-core Zen 3 the second thread idled ~40% of a step, and the projections read
// their weights from memory at ~0.6-0.7 of the rate they multiply them from cache. In a team, the
// serial work runs on thread 0 while the other threads prefetch the tiles they will multiply next, and
// the projections hand out their tiles themselves: with two threads each takes its own half first
// (thread 1's prefetched), then what is left of the other's, so neither waits on the other.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

#include "folio_kernels.h"

namespace folio_decode {

// What a prefetching thread reads ahead in one serial stretch, at most: half of a Zen 3 core's L2.
constexpr int64_t kPrefetchCapBytes = 256 << 10;
// Tiles a thread takes at a time: about this many bytes of codes, so that taking them (one
// compare-and-swap) costs nothing beside multiplying them.
constexpr int64_t kClaimBytes = 16 << 10;

// Tiles [front, back) of a weight not yet taken, both ends in one word so that taking from either
// end is one compare-and-swap.
class alignas(64) TwoEndedTiles {  // a line of its own: each thread takes from its own half
 public:
  void reset(int64_t front, int64_t back, int64_t chunk) {
    chunk_ = chunk;
    ends_.store(pack(front, back), std::memory_order_relaxed);
  }
  bool take(bool from_back, int64_t* begin, int64_t* end) {
    uint64_t now = ends_.load(std::memory_order_relaxed), next;
    int64_t front, back;
    do {
      front = static_cast<int64_t>(now & 0xFFFFFFFFu), back = static_cast<int64_t>(now >> 32);
      if (front >= back) return false;
      if (from_back) {
        *begin = std::max(front, back - chunk_), *end = back;
        next = pack(front, *begin);
      } else {
        *begin = front, *end = std::min(back, front + chunk_);
        next = pack(*end, back);
      }
    } while (!ends_.compare_exchange_weak(now, next, std::memory_order_relaxed));
    return true;
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }
  std::atomic<uint64_t> ends_{0};
  int64_t chunk_ = 1;
};

// A thread's way to its tiles (folio::TileSource's state). With two threads each owns half of the
// tiles and takes them from the front, in the order its prefetch and the tile loops' own prefetch
// read them; once its half is done it takes the other's from the back, so neither waits on the other.
// With another number of threads, each its equal share, once.
struct TileTaker {
  TwoEndedTiles* own;    // null: the equal share below
  TwoEndedTiles* other;
  int64_t begin, end;  // the equal share, until taken
  static bool next(void* state, int64_t* begin, int64_t* end) {
    auto* self = static_cast<TileTaker*>(state);
    if (self->own != nullptr) return self->own->take(false, begin, end) || self->other->take(true, begin, end);
    if (self->begin >= self->end) return false;
    *begin = self->begin, *end = self->end;
    self->begin = self->end;
    return true;
  }
};

// The tiles [begin, end) thread `id` of `size` owns (with two threads, its half).
inline void own_tiles(int64_t tiles, int64_t id, int64_t size, int64_t* begin, int64_t* end) {
  *begin = tiles * id / size, *end = tiles * (id + 1) / size;
}

// Asks for [from, from + bytes) in cache, a line at a time, until `stop` says the serial work is done
// or `budget` bytes were asked for; returns what is left of the budget.
inline int64_t prefetch_until(const void* from, int64_t bytes, const std::atomic<int64_t>& stop, int64_t epoch,
                              int64_t budget) {
  const char* p = static_cast<const char*>(from);
  for (int64_t at = 0; at < bytes && budget > 0; at += 64, budget -= 64) {
    if (at % 4096 == 0 && stop.load(std::memory_order_relaxed) >= epoch) return 0;
    _mm_prefetch(p + at, _MM_HINT_T1);
  }
  return budget;
}

// What the team shares: the serial stretches counted as they end, the first failure, the tiles of
// the projection being multiplied (one TwoEndedTiles per row block).
struct TeamState {
  static constexpr int kMaxParts = 4;
  std::atomic<int64_t> serial_done{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  TwoEndedTiles halves[kMaxParts][2];  // per row block, the two threads' halves of its tiles
};

// One thread's view of its team, inside the parallel region.
struct Team {
  TeamState& state;
  int64_t id, size;
  int64_t epoch = 0;  // serial stretches this thread has passed

  void barrier() const {
#pragma omp barrier
  }
  bool failed() const { return state.failed.load(std::memory_order_relaxed); }

  // Thread 0 runs `work` (the step's serial part, and readying what the team reads next), while the
  // others run `meanwhile` until the work is done; then all wait for each other.
  template <typename Work, typename Meanwhile>
  void serial(Work work, Meanwhile meanwhile) {
    ++epoch;
    if (id == 0) {
      if (!failed()) {
        try {
          work();
        } catch (...) {
          state.error = std::current_exception();
          state.failed.store(true, std::memory_order_relaxed);
        }
      }
      state.serial_done.store(epoch, std::memory_order_release);
    } else if (!failed()) {
      meanwhile();
    }
    barrier();
  }
};

// Runs body(team) on every thread of one parallel region of at most `threads`, then rethrows what
// thread 0's serial work threw.
template <typename Body>
void run_team(int64_t threads, Body body) {
  TeamState state;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    Team team{state, omp_get_thread_num(), omp_get_num_threads()};
    body(team);
  }
  if (state.error) std::rethrow_exception(state.error);
}

}  // namespace folio_decode
