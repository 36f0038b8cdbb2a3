// Each row's maximum and the first position holding it, as torch.max(x, dim=-1) gives them, for the
// greedy pick over a vocabulary. ATen's CPU max-with-index walks a row one value at a time (~0.4 ms for
// Gemma 3's 262,144 logits, ~7 ms for 64 rows, on one thread); this takes a vector pass for the maximum
// and a second that stops at its first occurrence, with rows, or chunks of a long row, split over the
// threads. A row holding a NaN gives NaN at its first NaN, as torch.max does. `row_best` adds whether
// each row holds a value that is not finite, from the same pass (split_argmax.local_best's triple).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace folio_row_argmax {

constexpr int64_t CHUNK = 1 << 15;  // values a thread takes at a time: a long row is split in chunks

struct Best {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;  // -1: an empty chunk
  bool nan = false;
  bool nonfinite = false;  // a NaN or an infinity
};

// NaN by its bits: the kernels build with -ffast-math, under which std::isnan may be taken as false.
inline uint32_t magnitude_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7FFFFFFFu;
}
inline bool is_nan(float v) { return magnitude_bits(v) > 0x7F800000u; }
inline bool is_nonfinite(float v) { return magnitude_bits(v) >= 0x7F800000u; }

// The best of x[0 .. n) (n > 0): its first maximum, or its first NaN.
inline Best chunk_best(const float* x, int64_t n) {
  Best best;
  int64_t i = 0;
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false, nonfinite = false;
#if defined(__AVX512F__)
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), infinity = _mm512_set1_epi32(0x7F800000);
  const __m512i largest = _mm512_set1_epi32(0x7F7FFFFF);  // the largest finite magnitude
  __m512 tops = _mm512_set1_ps(top);
  __mmask16 nans = 0, nonfinites = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512i bits = _mm512_and_si512(_mm512_castps_si512(v), magnitude);
    nans |= _mm512_cmpgt_epi32_mask(bits, infinity);
    nonfinites |= _mm512_cmpgt_epi32_mask(bits, largest);
    tops = _mm512_max_ps(tops, v);
  }
  nan = nans != 0;
  nonfinite = nonfinites != 0;
  top = _mm512_reduce_max_ps(tops);
#elif defined(__AVX2__)
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF), infinity = _mm256_set1_epi32(0x7F800000);
  const __m256i largest = _mm256_set1_epi32(0x7F7FFFFF);
  __m256 tops = _mm256_set1_ps(top);
  __m256i nans = _mm256_setzero_si256(), nonfinites = _mm256_setzero_si256();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(v), magnitude);
    nans = _mm256_or_si256(nans, _mm256_cmpgt_epi32(bits, infinity));
    nonfinites = _mm256_or_si256(nonfinites, _mm256_cmpgt_epi32(bits, largest));
    tops = _mm256_max_ps(tops, v);  // a NaN may land in a lane: `nan` then decides, not `top`
  }
  nan = !_mm256_testz_si256(nans, nans);
  nonfinite = !_mm256_testz_si256(nonfinites, nonfinites);
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(tops), _mm256_extractf128_ps(tops, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  top = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
#endif
  for (; i < n; ++i) {
    nan = nan || is_nan(x[i]);
    nonfinite = nonfinite || is_nonfinite(x[i]);
    top = std::max(top, x[i]);
  }
  best.nan = nan;
  best.nonfinite = nonfinite;
  for (int64_t j = 0; j < n; ++j) {  // the first place holding it: usually early, never past it
    if (nan ? is_nan(x[j]) : x[j] == top) {
      best.index = j;
      break;
    }
  }
  best.index = std::max<int64_t>(best.index, 0);  // found above: the maximum is one of the values
  best.value = nan ? std::numeric_limits<float>::quiet_NaN() : top;
  return best;
}

// Each row's best (its first maximum, or its first NaN), its chunks' results merged; on the threads.
inline std::vector<Best> row_bests(const torch::Tensor& values) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == torch::kFloat32 && values.stride(1) == 1,
              "values: float32 [N, V] with contiguous rows");
  const int64_t rows = values.size(0), width = values.size(1), stride = values.stride(0);
  TORCH_CHECK(width > 0, "values: a row needs at least one value");
  const int64_t chunks = (width + CHUNK - 1) / CHUNK;
  std::vector<Best> parts(rows * chunks);
  const float* x = values.data_ptr<float>();
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, c = task % chunks, start = c * CHUNK;
      Best best = chunk_best(x + r * stride + start, std::min(CHUNK, width - start));
      best.index += start;
      parts[task] = best;
    }
  });
  std::vector<Best> bests(rows);
  for (int64_t r = 0; r < rows; ++r) {
    Best best = parts[r * chunks];
    bool nonfinite = best.nonfinite;
    for (int64_t c = 1; c < chunks; ++c) {
      const Best& next = parts[r * chunks + c];
      nonfinite = nonfinite || next.nonfinite;
      if (!best.nan && (next.nan || next.value > best.value)) best = next;  // the earlier chunk wins a tie
    }
    best.nonfinite = nonfinite;
    bests[r] = best;
  }
  return bests;
}

// values [N, V] float32 (rows contiguous) -> (maximum [N] float32, first index of it [N] int64).
inline std::vector<torch::Tensor> row_argmax(const torch::Tensor& values) {
  const std::vector<Best> bests = row_bests(values);
  const int64_t rows = values.size(0);
  auto maxima = torch::empty({rows}, values.options());
  auto indices = torch::empty({rows}, values.options().dtype(torch::kInt64));
  float* m = maxima.data_ptr<float>();
  int64_t* idx = indices.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = bests[r].value;
    idx[r] = bests[r].index;
  }
  return {maxima, indices};
}

// values [N, V] float32 -> [N, 3] float64: each row's maximum, first_row + its first index, and 1 where the
// row holds a NaN or an infinity, else 0 (split_argmax.local_best), in one pass and one tensor.
inline torch::Tensor row_best(const torch::Tensor& values, int64_t first_row) {
  const std::vector<Best> bests = row_bests(values);
  auto out = torch::empty({values.size(0), 3}, values.options().dtype(torch::kFloat64));
  double* o = out.data_ptr<double>();
  for (size_t r = 0; r < bests.size(); ++r) {
    o[3 * r] = bests[r].value;
    o[3 * r + 1] = static_cast<double>(bests[r].index + first_row);
    o[3 * r + 2] = bests[r].nonfinite ? 1.0 : 0.0;
  }
  return out;
}

}  // namespace folio_row_argmax
