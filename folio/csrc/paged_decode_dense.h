// Paged decode attention for caches in the query's dtype (float32, bfloat16), for paged_decode.cpp.
//
// Work is shaped so that each loaded K/V row serves as many queries as possible and no step reduces
// across a vector:
//  - Runs: consecutive rows with the same block table whose seq_lens grow by one are one sequence's
//    speculative verification (k + 1 rows over one context) or a prefill chunk (attention.layer passes
//    its rows so). One task per (run, KV head) attends all of the run's rows x the group's query heads
//    against each loaded block of keys, each row masking the keys past its own length (and outside its
//    window), so a verification reads its context once and a chunk its keys once per 16 rows.
//  - Tiles of 16 keys: a tile's K rows are transposed to [head_dim, 16] once, then each query's 16
//    scores accumulate with head_dim broadcast FMAs; exp runs 16 lanes at a time (a polynomial, as
//    std::exp is a scalar call here); V accumulates with broadcast weights into register blocks.
//  - Split-K: when runs x KV heads give the threads too few tasks (batch 1 has as many as KV heads),
//    each task's keys are split into chunks whose partial softmax states (max, sum, weighted V) are
//    merged at the end, so both cores work on one long context.
// Within a chunk the softmax is two-pass (all scores, then exp and sum, then V), as in the 8-bit path.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_tiles.h"
#include "score_softmax.h"
#include "paged_slots.h"

namespace dense {

constexpr int64_t kMaxRunRows = 16;  // a longer run is split: its score buffer grows with rows x keys
constexpr int64_t kMinChunk = 128;   // keys: below this a split costs more in merging than it balances

// Consecutive rows [row, row + rows) that attend one context.
struct Run {
  int64_t row, rows;
};

// Groups rows into runs. Row r joins the run before it when its length is the previous row's plus one
// and their tables agree on every block row r reads; the run then reads through its last (longest)
// row's table, which by that chain agrees with each row's on the blocks that row reads.
static std::vector<Run> find_runs(const int64_t* tables, const int64_t* lens, int64_t num_seqs, int64_t max_blocks,
                                  int64_t block_size) {
  std::vector<Run> runs;
  for (int64_t r = 0; r < num_seqs; ++r) {
    if (!runs.empty() && runs.back().rows < kMaxRunRows) {
      const int64_t prev = r - 1;
      const int64_t blocks = std::min(max_blocks, (lens[r] + block_size - 1) / block_size);
      const int64_t* mine = tables + r * max_blocks;
      if (lens[r] == lens[prev] + 1 && std::equal(mine, mine + blocks, tables + prev * max_blocks)) {
        ++runs.back().rows;
        continue;
      }
    }
    runs.push_back({r, 1});
  }
  return runs;
}

// Run i of n in an order that gives each thread's contiguous share of the tasks a like amount of work
// (0, n - 1, 1, n - 2, ...): a prefill chunk's runs are its rows 16 at a time, each attending every key
// up to its own position, so in their own order the last thread would get most of the work.
static inline int64_t balanced(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// How many key chunks each (run, KV head) is split into: 1 unless the tasks are too few for the
// threads, then enough that the task count is a multiple of the threads (parallel_for hands each
// thread a contiguous equal share) with chunks of at least kMinChunk keys.
static int64_t chunks_per_task(int64_t tasks, int64_t longest, int64_t threads) {
  if (threads <= 1 || tasks >= 4 * threads) return 1;
  const int64_t most = std::max<int64_t>(1, longest / kMinChunk);
  int64_t chunks = std::min(most, (2 * threads + tasks - 1) / tasks);
  while (chunks < most && (tasks * chunks) % threads != 0) ++chunks;
  return chunks;
}

template <typename T, int64_t HEAD_DIM>
static void attention(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                      int64_t block_size, double scale, int64_t window, const float* alibi_slopes) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : query.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const T* k = k_cache.data_ptr<T>();
  const T* v = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t row_stride = num_kv_heads * D;  // between one slot's rows of one KV head

  auto first_key = [&](int64_t row) { return window > 0 ? std::max<int64_t>(0, lens[row] - window) : 0; };
  const std::vector<Run> runs = find_runs(tables, lens, num_seqs, max_blocks, block_size);
  int64_t longest = 0, most_rows = 0;
  for (const Run& run : runs) {
    longest = std::max(longest, lens[run.row + run.rows - 1] - first_key(run.row));
    most_rows = std::max(most_rows, run.rows);
  }
  const int64_t base_tasks = static_cast<int64_t>(runs.size()) * num_kv_heads;
  const int64_t chunks = chunks_per_task(base_tasks, longest, at::get_num_threads());
  const int64_t max_queries = most_rows * group;
  // Split tasks leave their partial states here: per task, max_queries x [D] sums of weighted V, then
  // max_queries maxima, then max_queries sums of weights.
  const int64_t partial_stride = max_queries * (D + 2);
  std::vector<float> partials(chunks > 1 ? base_tasks * chunks * partial_stride : 0);

  // Writes the normalized output of query i (row, head) from its weighted V sum and weight total.
  auto write_out = [&](int64_t row, int64_t head, const float* acc, float total) {
    T* orow = o + (row * num_heads + head) * D;
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[d] * inv);
  };

  at::parallel_for(0, base_tasks * chunks, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    w.kt.resize(D * kTile);
    w.vt.resize(kTile * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task % chunks, kv_head = task / chunks % num_kv_heads;
      const Run& run = runs[balanced(task / chunks / num_kv_heads, static_cast<int64_t>(runs.size()))];
      const int64_t nq = run.rows * group;
      const int64_t last = run.row + run.rows - 1;
      const int64_t lo = first_key(run.row), hi = lens[last];
      const int64_t step = ((hi - lo + chunks - 1) / chunks + kTile - 1) / kTile * kTile;
      const int64_t c0 = std::min(hi, lo + chunk * step), c1 = std::min(hi, c0 + step);
      const int64_t n = c1 - c0, npad = (n + kTile - 1) / kTile * kTile;
      float* part = chunks > 1 ? partials.data() + task * partial_stride : nullptr;
      float* peaks = part ? part + max_queries * D : nullptr;
      float* totals = part ? part + max_queries * (D + 1) : nullptr;
      if (n <= 0) {  // a chunk past a short run's keys: an empty state
        if (part) std::fill(part, part + partial_stride, 0.0f);
        continue;
      }
      // The run's keys [c0, c1) read through its last row's table, padded to whole tiles with the last.
      const int64_t* table = tables + last * max_blocks;
      w.slots.resize(npad);
      for_each_slot(c0, c1, table, block_size, [&](int64_t pos, int64_t slot) { w.slots[pos - c0] = slot; });
      std::fill(w.slots.begin() + n, w.slots.end(), w.slots[n - 1]);

      w.q.resize(nq * D);
      for (int64_t i = 0; i < nq; ++i) {  // query i: row i / group, head kv_head * group + i % group
        const T* qrow = q + ((run.row + i / group) * num_heads + kv_head * group + i % group) * D;
        for (int64_t d = 0; d < D; ++d) w.q[i * D + d] = to_float(qrow[d]) * fscale;
      }
      w.scores.resize(nq * npad);
      w.totals.resize(nq);
      const T* kh = k + kv_head * D;
      const T* vh = v + kv_head * D;
      for (int64_t t = 0; t < n; t += kTile) {
        score_tile<T, HEAD_DIM>(kh, w.slots.data() + t, std::min(kTile, n - t), row_stride, w.q.data(), nq, D,
                                w.scores.data() + t, npad, w);
      }
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t row = run.row + i / group, head = kv_head * group + i % group;
        // This row's keys within the chunk: [first, len) of its own, not the run's.
        const int64_t from = std::max(first_key(row), c0) - c0, to = std::min(lens[row], c1) - c0;
        float* s = w.scores.data() + i * npad;
        float peak = 0.0f, total = 0.0f;
        if (from < to) {
          if (alibi_slopes) {  // slope * (key position - query position); the query sits at len - 1
            const float slope = alibi_slopes[head];
            const int64_t offset = c0 - (lens[row] - 1);
            for (int64_t j = from; j < to; ++j) s[j] += slope * static_cast<float>(j + offset);
          }
          peak = max_of(s + from, to - from);
          total = exp_sum(s + from, to - from, peak);
        }
        std::fill(s, s + std::max<int64_t>(0, from), 0.0f);  // weights of keys the row does not see
        std::fill(s + std::max(from, to), s + npad, 0.0f);
        w.totals[i] = total;
        if (part) {
          peaks[i] = peak;
          totals[i] = total;
        }
      }
      w.acc.assign(nq * D, 0.0f);
      for (int64_t t = 0; t < n; t += kTile) {
        accumulate_tile<T, HEAD_DIM>(vh, w.slots.data() + t, std::min(kTile, n - t), row_stride, w.scores.data() + t,
                                     npad, nq, D, w.acc.data(), w);
      }
      if (part) {
        std::copy(w.acc.begin(), w.acc.end(), part);
      } else {
        for (int64_t i = 0; i < nq; ++i)
          write_out(run.row + i / group, kv_head * group + i % group, w.acc.data() + i * D, w.totals[i]);
      }
    }
  });
  if (chunks == 1) return;
  // Merge the chunks' states: rescale each to the largest max, then sum (few tasks, so serially).
  std::vector<float> merged(D);
  for (int64_t base = 0; base < base_tasks; ++base) {
    const Run& run = runs[base / num_kv_heads];
    const int64_t kv_head = base % num_kv_heads;
    for (int64_t i = 0; i < run.rows * group; ++i) {
      const float* first = partials.data() + base * chunks * partial_stride;
      float peak = 0.0f;
      bool any = false;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = first + c * partial_stride;
        if (part[max_queries * (D + 1) + i] > 0.0f) {
          const float m = part[max_queries * D + i];
          peak = any ? std::max(peak, m) : m;
          any = true;
        }
      }
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = first + c * partial_stride;
        const float chunk_total = part[max_queries * (D + 1) + i];
        if (chunk_total <= 0.0f) continue;
        const float factor = std::exp(part[max_queries * D + i] - peak);
        total += chunk_total * factor;
        for (int64_t d = 0; d < D; ++d) merged[d] += factor * part[i * D + d];
      }
      write_out(run.row + i / group, kv_head * group + i % group, merged.data(), total);
    }
  }
}

template <typename T>
static void dispatch_head_dim(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& tables, const torch::Tensor& lens,
                              int64_t block_size, double scale, int64_t window, const float* slopes) {
  switch (query.size(2)) {
    case 32:
      attention<T, 32>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window, slopes);
      break;
    case 64:
      attention<T, 64>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window, slopes);
      break;
    case 80:
      attention<T, 80>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window, slopes);
      break;
    case 96:
      attention<T, 96>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window, slopes);
      break;
    case 128:
      attention<T, 128>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window, slopes);
      break;
    case 256:
      attention<T, 256>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window, slopes);
      break;
    default:
      attention<T, 0>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window, slopes);
  }
}

}  // namespace dense
