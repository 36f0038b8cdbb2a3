// Activations as the int8 dot-product kernels (int8_dot.cpp) take them: each row quantized to int8 in
// blocks of 32, with one float scale per block, the exact block sums, and the rounding error coded in
// 8 more bits. Shared helpers for those kernels.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace folio_int8_dot {

constexpr int64_t BLOCK = 32;  // activation block: one int8 scale per 32 values
constexpr int64_t HALF = BLOCK / 2;
// The kernels also take each activation's rounding error, in 1/256ths of the block's step: x ~
// scale * (code + residual / 256), 15 significant bits instead of 8. Activations have outlier channels
// (up to ~4000x the median on smollm2), and a block holding one leaves its other values a few steps
// of 8-bit codes. On smollm2 that was 1-2% error per layer, and next-token distributions ~10x further
// from fp32 than bf16's (development measurements); with the residual the difference is negligible
// (tests/oracle/test_packed_gguf_weights.py). At one activation row the doubled integer products cost
// no measurable time (loading and unpacking the weights dominates); at many rows they do, which is
// part of where the callers switch to a GEMM.
// `exact = false` leaves the residuals zero: 8-bit activations, as llama.cpp's Q8 ones, for callers
// who trade that accuracy for half the integer products (the kernels then skip the residual's).
constexpr float RESIDUAL_STEPS = 256.f;

struct QuantizedRows {            // x [M, K] as int8 blocks
  std::vector<int8_t> codes;      // [M, K]
  std::vector<int8_t> residuals;  // [M, K]: x - codes * scale in steps of scale / 256
  std::vector<float> scales;      // [M, K / 32]
  std::vector<float> sums;        // [M, K / 32]: exact sums of x per block, for the 4-bit mins
  // [M, K / 16]: 128 * (256 * sum(codes) + sum(residuals)) over each half block, for the 8-bit kernel,
  // whose weight bytes are code + 128 (the offset a half block's integer dot product then carries).
  std::vector<int32_t> offsets;
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K, bool with_offsets, bool exact = true) {
  const int64_t blocks = M * (K / BLOCK);
  QuantizedRows q{std::vector<int8_t>(M * K), std::vector<int8_t>(M * K), std::vector<float>(blocks),
                  std::vector<float>(blocks), std::vector<int32_t>(with_offsets ? 2 * blocks : 0)};
  for (int64_t i = 0; i < blocks; ++i) {
    const T* src = x + i * BLOCK;
    float amax = 0.f, sum = 0.f;
    for (int64_t j = 0; j < BLOCK; ++j) {
      const float v = static_cast<float>(src[j]);
      amax = std::max(amax, std::fabs(v));
      sum += v;
    }
    const float scale = amax / 127.f;
    // 1 / scale overflows (or flushes) for blocks below ~1e-37; those divide in double (rare, slower).
    const bool tiny = amax < 1e-30f;
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t j = 0; j < BLOCK; ++j) {
      const float v = static_cast<float>(src[j]);
      const float scaled = !tiny ? v * inverse : (amax > 0.f ? static_cast<float>(127.0 * v / amax) : 0.f);
      const float code = std::nearbyint(scaled);
      q.codes[i * BLOCK + j] = static_cast<int8_t>(code);
      if (!exact) continue;
      const float residual = std::nearbyint((scaled - code) * RESIDUAL_STEPS);  // |scaled - code| <= 1/2
      q.residuals[i * BLOCK + j] = static_cast<int8_t>(std::clamp(residual, -127.f, 127.f));
    }
    q.scales[i] = scale;
    q.sums[i] = sum;
  }
  if (with_offsets) {
    for (int64_t h = 0; h < 2 * blocks; ++h) {
      int32_t total = 0;
      for (int64_t j = 0; j < HALF; ++j) total += 256 * q.codes[h * HALF + j] + q.residuals[h * HALF + j];
      q.offsets[h] = 128 * total;
    }
  }
  return q;
}

inline float to_float(const at::Half& h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}
inline float to_float(float f) { return f; }

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline std::vector<int32_t> groups_of_blocks(int64_t K, int64_t group) {
  std::vector<int32_t> g(K / BLOCK + 1);
  for (int64_t b = 0; b <= K / BLOCK; ++b) g[b] = static_cast<int32_t>(std::min(b * BLOCK / group, K / group - 1));
  return g;
}

}  // namespace folio_int8_dot
