// y = x @ W^T for an NF4 weight (QLoRA's 4-bit NormalFloat, double-quantized block scales):
//   W[n, k] = codebook[code(n, k)] * absmax[b],  b = (n * K + k) / 64,
//   absmax[b] = (absmax_codes[b] - 128) * absmax_scales[b / 256] + offset,
// with two codes per byte, the even k in the high nibble (bitsandbytes' order).
//
// Decode multiplies few rows by a large weight, so the cost is reading the packed codes once. Each
// OpenMP task takes four output rows and widens them into float buffers (4 x K floats, in L1): per
// block of 64 the absmax is decoded and the 16 codebook values are scaled into a small table, so a
// weight costs one table lookup. The rows are then dotted with every activation row, four independent
// sums at a time, so extra activation rows cost only their FMAs. To keep the widening loop free of
// interleaved stores, the rows are widened in a permuted order (per 32 weights: the 16 high nibbles,
// then the 16 low ones, i.e. k = 0, 2, ..., 30, 1, 3, ..., 31) and x is permuted the same way once per
// call; a dot product does not care about the order of its terms.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "folio_kernels.h"

namespace {

constexpr int64_t kBlock = 64;         // weights per absmax
constexpr int64_t kScaleBlock = 256;   // absmax values per double-quantization scale
constexpr int64_t kGroup = 32;         // weights per permutation group (16 bytes)

// Widen one row of packed codes [K / 2] into `w` [K] in the permuted order.
inline void widen_row(const uint8_t* codes, int64_t first_block, int64_t blocks, const uint8_t* absmax_codes,
                      const float* absmax_scales, float offset, const float* codebook, float* w) {
  float lut[16];
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t idx = first_block + b;
    const float a = (static_cast<float>(absmax_codes[idx]) - 128.f) * absmax_scales[idx / kScaleBlock] + offset;
    for (int j = 0; j < 16; ++j) lut[j] = codebook[j] * a;
    for (int64_t g = 0; g < kBlock / kGroup; ++g) {
      const uint8_t* c = codes + b * (kBlock / 2) + g * (kGroup / 2);
      float* out = w + b * kBlock + g * kGroup;
      for (int64_t i = 0; i < kGroup / 2; ++i) out[i] = lut[c[i] >> 4];
      for (int64_t i = 0; i < kGroup / 2; ++i) out[kGroup / 2 + i] = lut[c[i] & 15];
    }
  }
}

}  // namespace

torch::Tensor nf4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor absmax_codes, torch::Tensor absmax_scales,
                         double offset, torch::Tensor codebook) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8 && codes.is_contiguous(),
              "codes: uint8 [N, K / 2]");
  TORCH_CHECK(absmax_codes.scalar_type() == torch::kUInt8 && absmax_codes.is_contiguous(), "absmax_codes: uint8");
  TORCH_CHECK(absmax_scales.scalar_type() == torch::kFloat32 && absmax_scales.is_contiguous(), "absmax_scales: float32");
  TORCH_CHECK(codebook.scalar_type() == torch::kFloat32 && codebook.numel() == 16, "codebook: float32 [16]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % kBlock == 0 && codes.size(1) == K / 2, "shape mismatch");
  const int64_t B = K / kBlock;  // absmax blocks per row
  TORCH_CHECK(absmax_codes.numel() == N * B && absmax_scales.numel() == (N * B + kScaleBlock - 1) / kScaleBlock,
              "absmax shape mismatch");

  // x in the widened rows' order: per group of 32, the even k, then the odd k.
  auto xp = x.view({M, K / kGroup, kGroup / 2, 2}).transpose(2, 3).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xs = xp.data_ptr<float>();
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  const uint8_t* acs = absmax_codes.data_ptr<uint8_t>();
  const float* ass = absmax_scales.data_ptr<float>();
  const float* cb = codebook.data_ptr<float>();
  const float off = static_cast<float>(offset);
  float* ys = y.data_ptr<float>();
  constexpr int64_t R = 4;  // output rows per task: four independent accumulators per activation row
#pragma omp parallel
  {
    std::vector<float> rows(R * K);
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += R) {
      const int64_t r_end = std::min(R, N - n0);
      for (int64_t r = 0; r < r_end; ++r) {
        const int64_t n = n0 + r;
        widen_row(cs + n * (K / 2), n * B, B, acs, ass, off, cb, rows.data() + r * K);
      }
      const float* w0 = rows.data();
      const float* w1 = w0 + K;
      const float* w2 = w1 + K;
      const float* w3 = w2 + K;
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xs + m * K;
        float* yr = ys + m * N + n0;
        if (r_end == R) {
          float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
          for (int64_t k = 0; k < K; ++k) {
            const float v = xr[k];
            a0 += v * w0[k];
            a1 += v * w1[k];
            a2 += v * w2[k];
            a3 += v * w3[k];
          }
          yr[0] = a0;
          yr[1] = a1;
          yr[2] = a2;
          yr[3] = a3;
        } else {
          for (int64_t r = 0; r < r_end; ++r) {
            const float* w = w0 + r * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; ++k) acc += xr[k] * w[k];
            yr[r] = acc;
          }
        }
      }
    }
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("nf4_linear", &nf4_linear, py::call_guard<py::gil_scoped_release>(), "x @ W^T for NF4 codes with double-quantized block absmax");
  py::dict entries;  // for C++ callers in other extensions, typed by folio_kernels.h
  folio::add_entry<folio::Nf4Linear>(entries, &nf4_linear);
  m.attr("entries") = entries;
}
