// Paged attention for single-token queries (decodes) on CPU.
//
// Reads each sequence's keys and values in place through its block table, so nothing is gathered
// or padded. The query heads that share a KV head (GQA/MQA) are processed together, so each K/V row
// is read once for all of them. Scores are computed first, then softmax, then the weighted sum of V,
// all accumulated in float32.
//
// The cache holds K/V in the query's dtype (namespace dense below: tiles of 16 keys, runs of rows of
// one sequence attended together, long contexts split across threads), or 8-bit (int8 or float8 e4m3
// codes, the latter passed as their bytes) with one float16 scale per token and KV head: one task per
// (sequence, KV head), a dot product runs on the codes and is scaled once, and each V row's weight
// absorbs its scale.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "folio_kernels.h"

template <typename T>
static inline float to_float(T x) { return static_cast<float>(x); }

// float8 e4m3 codes (as bytes) -> float, by table: the conversion has no vector instruction here.
static const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

template <typename C>
static inline float code_value(C c, const float* lut) {
  if constexpr (std::is_same_v<C, uint8_t>) {
    return lut[c];
  } else {
    return to_float(c);
  }
}

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

// HEAD_DIM > 0 fixes the head size at compile time, so the per-key loops over it unroll into a few
// vector instructions instead of a runtime-length loop with prologue and epilogue (a 4x difference at
// head_dim 64). HEAD_DIM == 0 is the generic fallback.
// T: the query's dtype; C: the cache's element (T itself, int8_t codes, or uint8_t float8 codes).
template <typename T, typename C, int64_t HEAD_DIM>
static void decode_attention_impl(
    torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
    const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t block_size, double scale,
    int64_t window, const c10::Half* k_scales, const c10::Half* v_scales, const float* alibi_slopes) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : query.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const C* k = k_cache.data_ptr<C>();
  const C* v = v_cache.data_ptr<C>();
  const float* lut = std::is_same_v<C, uint8_t> ? fp8_table().data() : nullptr;
  T* o = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t count = len - first;
      const int64_t* table = tables + seq * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const T* qrow = q + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(qrow[d]) * fscale;
      }
      scores.assign(group * count, 0.0f);
      for_each_slot(first, len, table, block_size, [&](int64_t pos, int64_t slot) {
        const C* krow = k + (slot * num_kv_heads + kv_head) * head_dim;
        const float kscale = k_scales ? static_cast<float>(k_scales[slot * num_kv_heads + kv_head]) : 1.0f;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * code_value(krow[d], lut);
          // ALiBi: slope * (key position - query position); the query sits at len - 1.
          const float bias =
              alibi_slopes ? alibi_slopes[kv_head * group + g] * static_cast<float>(pos - (len - 1)) : 0.0f;
          scores[g * count + pos - first] = dot * kscale + bias;
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * count;
        float peak = s[0];  // not -inf: -ffast-math assumes finite values
        for (int64_t j = 0; j < count; ++j) peak = std::max(peak, s[j]);
        float total = 0.0f;
        for (int64_t j = 0; j < count; ++j) {
          s[j] = std::exp(s[j] - peak);
          total += s[j];
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < count; ++j) s[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for_each_slot(first, len, table, block_size, [&](int64_t pos, int64_t slot) {
        const C* vrow = v + (slot * num_kv_heads + kv_head) * head_dim;
        const float vscale = v_scales ? static_cast<float>(v_scales[slot * num_kv_heads + kv_head]) : 1.0f;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * count + pos - first] * vscale;
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * code_value(vrow[d], lut);
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        T* orow = o + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) orow[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

// ---- Unquantized caches (K/V in the query's dtype) ----
//
// Work is shaped so that each loaded K/V row serves as many queries as possible and no step reduces
// across a vector:
//  - Runs: consecutive rows with the same block table whose seq_lens grow by one are one sequence's
//    speculative verification (k + 1 rows over one context). One task per (run, KV head) attends all
//    of the run's rows x the group's query heads against each loaded block of keys, each row masking
//    the keys past its own length (and outside its window), so a verification reads its context once.
//  - Tiles of 16 keys: a tile's K rows are transposed to [head_dim, 16] once, then each query's 16
//    scores accumulate with head_dim broadcast FMAs; exp runs 16 lanes at a time (a polynomial, as
//    std::exp is a scalar call here); V accumulates with broadcast weights into register blocks.
//  - Split-K: when runs x KV heads give the threads too few tasks (batch 1 has as many as KV heads),
//    each task's keys are split into chunks whose partial softmax states (max, sum, weighted V) are
//    merged at the end, so both cores work on one long context.
// Within a chunk the softmax is two-pass (all scores, then exp and sum, then V), as in the 8-bit path.
namespace dense {

constexpr int64_t kTile = 16;        // keys per tile: one AVX-512 vector of float32 scores
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

#if defined(__AVX512F__)
template <typename T>
static inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {  // bfloat16: the high half of a float32
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// In-register transpose: r[j][d] -> r[d][j], 16 x 16 float32 (64 shuffles).
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // t[i] lane l: r[i][4l], r[i+1][4l], r[i][4l+1], r[i+1][4l+1]
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // r[4k + c] lane l: column 4l + c of rows 4k .. 4k + 3
    const __m512d a = _mm512_castps_pd(t[4 * k]), b = _mm512_castps_pd(t[4 * k + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * k + 2]), d = _mm512_castps_pd(t[4 * k + 3]);
    r[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {  // gather each column's four 128-bit lanes (rows 0-3, 4-7, 8-11, 12-15)
    const __m512 even_lo = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    const __m512 odd_lo = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    const __m512 even_hi = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const __m512 odd_hi = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_f32x4(even_lo, even_hi, 0x88);       // column c
    t[4 + c] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88);     // column 4 + c
    t[8 + c] = _mm512_shuffle_f32x4(even_lo, even_hi, 0xdd);   // column 8 + c
    t[12 + c] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xdd);    // column 12 + c
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// exp(x) for x <= 0 (scores minus their max), 16 lanes: Cephes' expf polynomial after reducing by
// ln 2 in two parts, scaled by 2^n with scalef. Within 2 ulp; below -87 it returns exp(-87) ~ 1e-38.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Scores of NQ queries (rows of q, stride qs) against one transposed tile kt [D][16] -> s (stride ss).
// Two accumulators per query (even and odd dims) so even 1-3 queries keep the FMA pipes busy.
template <int64_t D, int NQ>
static inline void score_block(const float* kt, const float* q, int64_t qs, float* s, int64_t ss) {
  __m512 even[NQ], odd[NQ];
  for (int i = 0; i < NQ; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kTile), k1 = _mm512_loadu_ps(kt + (d + 1) * kTile);
    for (int i = 0; i < NQ; ++i) {
      even[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * qs + d]), k0, even[i]);
      odd[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * qs + d + 1]), k1, odd[i]);
    }
  }
  for (int i = 0; i < NQ; ++i) _mm512_storeu_ps(s + i * ss, _mm512_add_ps(even[i], odd[i]));
}

// acc[i] += sum_j p[i][j] * V_j for NQ queries over n <= 16 rows of V (float32), acc in registers.
template <int64_t D, int NQ>
static inline void accumulate_block(const float* const* vrows, int64_t n, const float* p, int64_t ps, float* acc,
                                    int64_t as) {
  constexpr int64_t VD = D / 16;
  __m512 a[NQ][VD];
  for (int i = 0; i < NQ; ++i)
    for (int64_t v = 0; v < VD; ++v) a[i][v] = _mm512_loadu_ps(acc + i * as + v * 16);
  for (int64_t j = 0; j < n; ++j) {
    __m512 row[VD];
    for (int64_t v = 0; v < VD; ++v) row[v] = _mm512_loadu_ps(vrows[j] + v * 16);
    for (int i = 0; i < NQ; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * ps + j]);
      for (int64_t v = 0; v < VD; ++v) a[i][v] = _mm512_fmadd_ps(w, row[v], a[i][v]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int64_t v = 0; v < VD; ++v) _mm512_storeu_ps(acc + i * as + v * 16, a[i][v]);
}

// Calls f(std::integral_constant<int, nq>) for nq in 1..MAX (a runtime count to a template argument).
template <int MAX, typename F>
static inline void with_count(int64_t nq, F&& f) {
  if constexpr (MAX > 1) {
    if (nq < MAX) return with_count<MAX - 1>(nq, std::forward<F>(f));
  }
  f(std::integral_constant<int, MAX>{});
}
#endif

// The vector tiles need AVX-512 and a head size that is a whole number of 16-float vectors.
template <int64_t HEAD_DIM>
constexpr bool kVectorTiles =
#if defined(__AVX512F__)
    HEAD_DIM > 0 && HEAD_DIM % 16 == 0;
#else
    false;
#endif

// Per-thread scratch of one task.
struct Scratch {
  std::vector<float> q, scores, acc, kt, vt, totals;
  std::vector<int64_t> slots;
};

// Scores s[i][j] (stride ss) of queries q (nq x D, stride D) against the tile's keys at `slots` (n of
// them, padded to 16 with the last one), one KV head's rows of the cache k.
template <typename T, int64_t HEAD_DIM>
static inline void score_tile(const T* k, const int64_t* slots, int64_t n, int64_t row_stride, const float* q,
                              int64_t nq, int64_t D, float* s, int64_t ss, Scratch& w) {
#if defined(__AVX512F__)
  if constexpr (kVectorTiles<HEAD_DIM>) {
    for (int64_t c = 0; c < HEAD_DIM / 16; ++c) {
      __m512 r[16];
      for (int j = 0; j < 16; ++j) r[j] = load16(k + slots[j] * row_stride + c * 16);
      transpose16(r);
      for (int d = 0; d < 16; ++d) _mm512_storeu_ps(w.kt.data() + (c * 16 + d) * kTile, r[d]);
    }
    constexpr int BLOCK = 6;  // 12 accumulators
    int64_t i = 0;
    for (; i + BLOCK <= nq; i += BLOCK) score_block<HEAD_DIM, BLOCK>(w.kt.data(), q + i * D, D, s + i * ss, ss);
    if (i < nq) {
      with_count<BLOCK - 1>(nq - i, [&](auto count) {
        score_block<HEAD_DIM, decltype(count)::value>(w.kt.data(), q + i * D, D, s + i * ss, ss);
      });
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* krow = k + slots[j] * row_stride;
    for (int64_t i = 0; i < nq; ++i) {
      const float* qi = q + i * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qi[d] * to_float(krow[d]);
      s[i * ss + j] = dot;
    }
  }
}

// acc[i] (stride D) += sum_j p[i][j] * V_j over the tile's n values at `slots`.
template <typename T, int64_t HEAD_DIM>
static inline void accumulate_tile(const T* v, const int64_t* slots, int64_t n, int64_t row_stride, const float* p,
                                   int64_t ps, int64_t nq, int64_t D, float* acc, Scratch& w) {
#if defined(__AVX512F__)
  if constexpr (kVectorTiles<HEAD_DIM>) {
    const float* rows[kTile];
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        rows[j] = v + slots[j] * row_stride;
      } else {  // widened once per tile, not once per block of queries
        float* wide = w.vt.data() + j * HEAD_DIM;
        const T* vrow = v + slots[j] * row_stride;
        for (int64_t c = 0; c < HEAD_DIM / 16; ++c) _mm512_storeu_ps(wide + c * 16, load16(vrow + c * 16));
        rows[j] = wide;
      }
    }
    constexpr int BLOCK = std::max<int>(1, 24 / (HEAD_DIM / 16));  // <= 24 accumulator registers
    int64_t i = 0;
    for (; i + BLOCK <= nq; i += BLOCK) accumulate_block<HEAD_DIM, BLOCK>(rows, n, p + i * ps, ps, acc + i * D, D);
    if (i < nq) {
      with_count<BLOCK>(nq - i, [&](auto count) {
        accumulate_block<HEAD_DIM, decltype(count)::value>(rows, n, p + i * ps, ps, acc + i * D, D);
      });
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* vrow = v + slots[j] * row_stride;
    for (int64_t i = 0; i < nq; ++i) {
      const float weight = p[i * ps + j];
      float* a = acc + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += weight * to_float(vrow[d]);
    }
  }
}

// s[0, n) = exp(s - peak) in place; returns their sum.
static inline float exp_sum(float* s, int64_t n, float peak) {
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(peak);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), m));
    _mm512_mask_storeu_ps(s + j, live, e);
    total = _mm512_mask_add_ps(total, live, total, e);
  }
  return _mm512_reduce_add_ps(total);
#else
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - peak);
    total += s[j];
  }
  return total;
#endif
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
      const Run& run = runs[task / chunks / num_kv_heads];
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
          peak = s[from];  // not -inf: -ffast-math assumes finite values
          for (int64_t j = from; j < to; ++j) peak = std::max(peak, s[j]);
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

template <typename T, typename C>
static void dispatch_head_dim(
    torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
    const torch::Tensor& tables, const torch::Tensor& lens, int64_t block_size, double scale, int64_t window,
    const c10::Half* ks, const c10::Half* vs, const float* slopes) {
  switch (query.size(2)) {
    case 64:
      decode_attention_impl<T, C, 64>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window,
                                              ks, vs, slopes);
      break;
    case 128:
      decode_attention_impl<T, C, 128>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window,
                                              ks, vs, slopes);
      break;
    case 256:
      decode_attention_impl<T, C, 256>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window,
                                              ks, vs, slopes);
      break;
    default:
      decode_attention_impl<T, C, 0>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window,
                                              ks, vs, slopes);
  }
}

template <typename T>
static void dispatch_cache(
    torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
    const torch::Tensor& tables, const torch::Tensor& lens, int64_t block_size, double scale, int64_t window,
    const c10::Half* ks, const c10::Half* vs, const float* slopes) {
  switch (k_cache.scalar_type()) {
    case torch::kChar:  // int8 codes
      dispatch_head_dim<T, int8_t>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window,
                                              ks, vs, slopes);
      break;
    case torch::kByte:  // float8 e4m3 codes, as bytes
      dispatch_head_dim<T, uint8_t>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window,
                                              ks, vs, slopes);
      break;
    default:
      TORCH_CHECK(k_cache.scalar_type() == query.scalar_type(), "an unquantized cache must have the query's dtype");
      dense::dispatch_head_dim<T>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window, slopes);
  }
}

// query [N, H, D]; caches [slots, Hkv, D]; block_tables [N, max_blocks] int64; seq_lens [N] int64
// (keys to attend: the query sits at position seq_len - 1); window 0 means no sliding window.
// An 8-bit cache (int8, or float8 e4m3 viewed as uint8) comes with float16 scales [slots, Hkv].
// alibi_slopes: [H] float32 ALiBi slopes (each score gains slope * (key position - query position)),
// or nullptr for none.
static torch::Tensor paged_decode_attention_with(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, int64_t block_size, double scale, int64_t window,
    std::optional<torch::Tensor> k_scales, std::optional<torch::Tensor> v_scales, const float* slopes) {
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(query.size(1) % k_cache.size(1) == 0, "heads must be a multiple of KV heads");
  const bool quantized = k_cache.scalar_type() == torch::kChar || k_cache.scalar_type() == torch::kByte;
  TORCH_CHECK(quantized == (k_scales.has_value() && v_scales.has_value()), "an 8-bit cache needs its scales");
  const c10::Half* ks = nullptr;
  const c10::Half* vs = nullptr;
  if (quantized) {
    TORCH_CHECK(k_scales->scalar_type() == torch::kHalf && k_scales->is_contiguous() &&
                v_scales->scalar_type() == torch::kHalf && v_scales->is_contiguous(), "scales: contiguous float16");
    ks = k_scales->data_ptr<c10::Half>();
    vs = v_scales->data_ptr<c10::Half>();
  }
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(query);
  switch (query.scalar_type()) {
    case torch::kFloat:
      dispatch_cache<float>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window,
                                              ks, vs, slopes);
      break;
    case torch::kBFloat16:
      dispatch_cache<c10::BFloat16>(out, query, k_cache, v_cache, tables, lens, block_size, scale, window,
                                              ks, vs, slopes);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16 queries");
  }
  return out;
}

// The entry point other extensions call through the capsule below: its signature stays fixed.
torch::Tensor paged_decode_attention(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, int64_t block_size, double scale, int64_t window,
    std::optional<torch::Tensor> k_scales, std::optional<torch::Tensor> v_scales) {
  return paged_decode_attention_with(query, k_cache, v_cache, block_tables, seq_lens, block_size, scale, window,
                                     k_scales, v_scales, nullptr);
}

// The same with ALiBi biases: alibi_slopes [H] float32.
torch::Tensor paged_decode_attention_alibi(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, int64_t block_size, double scale, int64_t window,
    std::optional<torch::Tensor> k_scales, std::optional<torch::Tensor> v_scales, torch::Tensor alibi_slopes) {
  TORCH_CHECK(alibi_slopes.scalar_type() == torch::kFloat && alibi_slopes.is_contiguous() &&
              alibi_slopes.numel() == query.size(1), "alibi_slopes: contiguous float32, one per query head");
  return paged_decode_attention_with(query, k_cache, v_cache, block_tables, seq_lens, block_size, scale, window,
                                     k_scales, v_scales, alibi_slopes.data_ptr<float>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("paged_decode_attention_alibi", &paged_decode_attention_alibi, "paged decode attention with ALiBi (CPU)");
  // For C++ callers in other extensions (decode_stack.cpp), typed by folio_kernels.h.
  py::dict entries;
  folio::add_entry<folio::PagedDecodeAttention>(entries, &paged_decode_attention);
  m.attr("entries") = entries;
}
