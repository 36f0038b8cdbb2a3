// y = x @ W^T for a weight held as int8 codes with one float scale per group of `group` values
// along K (GGUF Q8_0: groups of 32): W[n, k] = scales[n, k / group] * codes[n, k].
//
// Decode multiplies few rows by a large weight, so the cost is reading the codes once. Each OpenMP
// task takes four output rows; they are widened once into float buffers (4 x K floats, in L1) and
// then dotted with every activation row, four independent sums at a time, so extra activation rows
// cost only their FMAs. The loops are plain float code that the compiler vectorizes (-O3
// -march=native -ffast-math).
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "folio_kernels.h"

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8 && codes.is_contiguous(), "codes: int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous(), "scales: float32 [N, K / group]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && K % group == 0 && scales.numel() == N * (K / group), "shape mismatch");
  const int64_t G = K / group;
  auto y = torch::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const int8_t* cs = codes.data_ptr<int8_t>();
  const float* ss = scales.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  constexpr int64_t R = 4;  // output rows per task: four independent accumulators per activation row
#pragma omp parallel
  {
    std::vector<float> rows(R * K);
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += R) {
      const int64_t r_end = std::min(R, N - n0);
      for (int64_t r = 0; r < r_end; ++r) {
        const int8_t* c = cs + (n0 + r) * K;
        const float* s = ss + (n0 + r) * G;
        float* w = rows.data() + r * K;
        for (int64_t g = 0; g < G; ++g) {
          const float scale = s[g];
          for (int64_t i = 0; i < group; ++i) w[g * group + i] = scale * static_cast<float>(c[g * group + i]);
        }
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
  m.def("q8_linear", &q8_linear, py::call_guard<py::gil_scoped_release>(), "x @ W^T for int8 codes with per-group float scales");
  py::dict entries;  // for C++ callers in other extensions, typed by folio_kernels.h
  folio::add_entry<folio::Q8Linear>(entries, &q8_linear);
  m.attr("entries") = entries;
}
