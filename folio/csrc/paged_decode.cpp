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

#include "paged_decode_dense.h"
#include "paged_slots.h"

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
        const float peak = dense::max_of(s, count);
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
  m.def("paged_decode_attention", &paged_decode_attention, py::call_guard<py::gil_scoped_release>(), "paged decode attention (CPU)");
  m.def("paged_decode_attention_alibi", &paged_decode_attention_alibi, py::call_guard<py::gil_scoped_release>(), "paged decode attention with ALiBi (CPU)");
  // For C++ callers in other extensions (decode_stack.cpp), typed by folio_kernels.h.
  py::dict entries;
  folio::add_entry<folio::PagedDecodeAttention>(entries, &paged_decode_attention);
  m.attr("entries") = entries;
}
