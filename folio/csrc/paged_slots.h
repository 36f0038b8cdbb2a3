// What the paged decode kernels share: reading a cache element as float, and walking a sequence's
// slots through its block table.
#pragma once

#include <algorithm>
#include <cstdint>

template <typename T>
static inline float to_float(T x) { return static_cast<float>(x); }

// Calls visit(pos, slot) for every position in [first, len), walking the block table block by block:
// one table lookup per block and no division per position.
template <typename Visit>
static inline void for_each_slot(int64_t first, int64_t len, const int64_t* table, int64_t block_size, Visit visit) {
  for (int64_t pos = first; pos < len;) {
    const int64_t block_first_pos = pos / block_size * block_size;
    const int64_t slot_offset = table[pos / block_size] * block_size - block_first_pos;  // slot = pos + this
    const int64_t block_end = std::min(len, block_first_pos + block_size);
    for (; pos < block_end; ++pos) visit(pos, pos + slot_offset);
  }
}
