// y = x @ W^T for a weight held as int8 codes with one float scale per group of `group` values
// along K (GGUF Q8_0: groups of 32): W[n, k] = scales[n, k / group] * codes[n, k].
//
// Decode multiplies few rows by a large weight, so the cost is reading the codes once: one OpenMP
// task per block of output rows, each codes row read once and reused for every activation row while
// it is in L1. The inner loops are plain float FMAs over int8 converted on the fly, which the
// compiler vectorizes (-O3 -march=native -ffast-math).
#include <torch/extension.h>

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
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* row = cs + n * K;
    const float* s = ss + n * G;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = xs + m * K;
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* c = row + g * group;
        const float* xg = xr + g * group;
        float dot = 0.f;
        for (int64_t i = 0; i < group; ++i) dot += xg[i] * static_cast<float>(c[i]);
        acc += s[g] * dot;
      }
      ys[m * N + n] = acc;
    }
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_linear", &q8_linear, "x @ W^T for int8 codes with per-group float scales");
}
