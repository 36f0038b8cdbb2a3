// y = x @ W^T for a weight held as int8 codes with one float scale per group of `group` values
// along K (GGUF Q8_0: groups of 32): W[n, k] = scales[n, k / group] * codes[n, k].
//
// Decode multiplies few rows by a large weight, so the cost is reading the codes once. Each OpenMP
// task takes output rows n; a row is widened once into a float buffer (K floats, in L1) and then
// dotted with every activation row, so extra activation rows cost only their FMAs. The loops are
// plain float code that the compiler vectorizes (-O3 -march=native -ffast-math).
#include <torch/extension.h>

#include <vector>

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
#pragma omp parallel
  {
    std::vector<float> row(K);
    float* w = row.data();
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* c = cs + n * K;
      const float* s = ss + n * G;
      for (int64_t g = 0; g < G; ++g) {
        const float scale = s[g];
        for (int64_t i = 0; i < group; ++i) w[g * group + i] = scale * static_cast<float>(c[g * group + i]);
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xs + m * K;
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += xr[k] * w[k];
        ys[m * N + n] = acc;
      }
    }
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_linear", &q8_linear, "x @ W^T for int8 codes with per-group float scales");
}
