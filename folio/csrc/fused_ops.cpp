// Small fused CPU ops for the layers around the matmuls: RMSNorm (with the residual add before it),
// rotary embedding in place, and gated activations; the greedy pick's row argmax (row_argmax.h) and the
// LoRA adapters' rows (lora_rows.h).
// Each replaces 5-15 PyTorch ops, and at decode, where a token's whole layer is a few microseconds of
// arithmetic, the per-op dispatch is the cost.
//
// Arithmetic is float32 and rounds to the tensor's dtype where the PyTorch path (the oracle, in
// norm.py, rotary.py and activation.py) rounds: the residual sum, the normalized x before Llama's
// weight, the output.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "folio_kernels.h"
#include "lora_rows.h"
#include "row_argmax.h"
#include "vec_exp.h"

namespace {

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// out[r] = norm(x[r]) * w for rows [begin, end), as RMSNorm in norm.py: Llama rounds the normalized row to T
// before the weight (weight_offset == 0); Gemma multiplies by (1 + w) in float32 and rounds once.
template <typename T, typename W>
void rms_norm_range(const T* x, int64_t x_stride, const W* w, float eps, float offset, T* out, int64_t begin,
                    int64_t end, int64_t dim) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * x_stride;
    float squares = 0.f;
    for (int64_t i = 0; i < dim; ++i) {
      const float v = static_cast<float>(xr[i]);
      squares += v * v;
    }
    const float inverse = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
    T* o = out + r * dim;
    if (offset != 0.f) {
      for (int64_t i = 0; i < dim; ++i) o[i] = round_to<T>(static_cast<float>(xr[i]) * inverse * (static_cast<float>(w[i]) + offset));
    } else {
      for (int64_t i = 0; i < dim; ++i) {
        const float normed = static_cast<float>(round_to<T>(static_cast<float>(xr[i]) * inverse));
        o[i] = round_to<T>(static_cast<float>(w[i]) * normed);
      }
    }
  }
}

// The float32 rows of RmsNormRows (folio_kernels.h), out of line: the tensor entry's float32 rows run this
// same code, so a caller of either gets the same bits (-ffast-math may compile an inlined copy otherwise).
__attribute__((noinline)) void rms_norm_rows_f32(const float* x, int64_t x_stride, const float* w, float eps,
                                                  float offset, float* out, int64_t rows, int64_t dim) {
  rms_norm_range<float, float>(x, x_stride, w, eps, offset, out, 0, rows, dim);
}

template <typename T, typename W>
void rms_norm_rows(const T* x, int64_t x_stride, const W* w, float eps, float offset, T* out, int64_t rows,
                   int64_t dim) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<T, float> && std::is_same_v<W, float>) {
      rms_norm_rows_f32(x + begin * x_stride, x_stride, w, eps, offset, out + begin * dim, end - begin, dim);
    } else {
      rms_norm_range<T, W>(x, x_stride, w, eps, offset, out, begin, end, dim);
    }
  });
}

// residual[r] += x[r] (rounded to T, as `residual + x` would be) for rows [0, rows); residual's rows contiguous.
template <typename T>
void add_rows(const T* x, int64_t x_stride, T* residual, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < dim; ++i)
      residual[r * dim + i] = round_to<T>(static_cast<float>(residual[r * dim + i]) + static_cast<float>(x[r * x_stride + i]));
}

// AddRmsNormRows (folio_kernels.h), as add_rms_norm does it.
void add_rms_norm_rows_f32(const float* x, int64_t x_stride, float* residual, const float* w, float eps, float offset,
                           float* out, int64_t rows, int64_t dim) {
  add_rows(x, x_stride, residual, rows, dim);
  rms_norm_rows_f32(residual, dim, w, eps, offset, out, rows, dim);
}

void check_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rows: [T, D] with contiguous rows");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset) {
  check_rows(x);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "rms_norm_weight", [&] {
      rms_norm_rows<T, scalar_t>(x.data_ptr<T>(), x.stride(0), weight.data_ptr<scalar_t>(), static_cast<float>(eps),
                                 static_cast<float>(offset), out.data_ptr<T>(), x.size(0), x.size(1));
    });
  });
  return out;
}

// residual += x (rounded to its dtype, as `residual + x` would be), then rms_norm(residual).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, double offset) {
  check_rows(x);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual: contiguous, like x");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_residual", [&] {
    add_rows(x.data_ptr<scalar_t>(), x.stride(0), residual.data_ptr<scalar_t>(), x.size(0), x.size(1));
  });
  return rms_norm(residual, weight, eps, offset);
}

// In place, rotate-half layout: x[t, h, :D/2], x[t, h, D/2:] = a*cos - b*sin, b*cos + a*sin, for x [T, H, D]
// whose tokens are `stride` apart and heads contiguous; cos, sin: [T, D].
template <typename T>
static void rotate_rows(T* data, int64_t stride, int64_t tokens, int64_t heads, int64_t dim, const T* c, const T* s) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* ct = c + t * dim;
    const T* st = s + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = data + t * stride + h * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
        v[i] = round_to<T>(a * static_cast<float>(ct[i]) - b * static_cast<float>(st[i]));
        v[i + half] = round_to<T>(b * static_cast<float>(ct[i + half]) + a * static_cast<float>(st[i + half]));
      }
    }
  }
}

// RotaryRows (folio_kernels.h): the float32 rotation the tensor entry runs too, out of line (one copy of its code).
__attribute__((noinline)) static void rotary_rows_f32(float* x, int64_t stride, int64_t tokens, int64_t heads, int64_t dim,
                                                const float* cos, const float* sin) {
  rotate_rows(x, stride, tokens, heads, dim, cos, sin);
}

// rotate_rows, through rotary_rows_f32 for float32.
template <typename T>
static void rotate(T* x, int64_t stride, int64_t tokens, int64_t heads, int64_t dim, const T* cos, const T* sin) {
  rotate_rows(x, stride, tokens, heads, dim, cos, sin);
}
static void rotate(float* x, int64_t stride, int64_t tokens, int64_t heads, int64_t dim, const float* cos, const float* sin) {
  rotary_rows_f32(x, stride, tokens, heads, dim, cos, sin);
}

// rotate on q and k (strided views of a fused qkv output are fine). cos, sin: [T, D] in x's dtype.
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous(), "cos, sin: contiguous [T, D]");
  for (auto* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2), "q, k: [T, H, D], rows of heads");
    TORCH_CHECK(x->scalar_type() == cos.scalar_type() && x->size(0) == cos.size(0) && x->size(2) == cos.size(1),
                "cos/sin: x's dtype and [T, D]");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    for (auto* x : {&q, &k})
      rotate(x->data_ptr<scalar_t>(), x->stride(0), x->size(0), x->size(1), x->size(2), cos.data_ptr<scalar_t>(),
             sin.data_ptr<scalar_t>());
  });
}

#if defined(__AVX512F__)
using folio_vec::exp16;

// act(g) = g * sigmoid(z) = g / (1 + e^-z): silu with z = g; gelu's tanh form with z = 2u, as
// 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3) (no cancellation in its tails).
static inline __m512 activate16(__m512 g, bool gelu) {
  __m512 z = g;
  if (gelu) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    z = _mm512_mul_ps(_mm512_set1_ps(2.0f * 0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, g));
  }
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
}

// 16 values of T as float32, and back (bfloat16: to nearest even, as a cast rounds).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m256i to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
static inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
}
// v rounded to T and widened again (identity for float32).
static inline __m512 round16(__m512 v, const float*) { return v; }
static inline __m512 round16(__m512 v, const at::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}
#elif defined(__AVX2__)
using folio_vec::exp8;

// activate16 on 8 lanes (AVX2 alone).
static inline __m256 activate8(__m256 g, bool gelu) {
  __m256 z = g;
  if (gelu) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    z = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, g));
  }
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
}

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// 8 floats to bfloat16 bits (to nearest even), in the low 128 bits.
static inline __m128i to_bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i high = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08));
}
static inline void store8(at::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_bits(v)); }
static inline __m256 round8(__m256 v, const float*) { return v; }
static inline __m256 round8(__m256 v, const at::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16_bits(v)), 16));
}
#endif

// out[0, 16) = act(gate[0, 16)) * gate[width, width + 16), rounded as the scalar loop rounds; false where
// there is no vector path (neither AVX-512 nor AVX2, or float16).
template <typename T>
static inline bool gated16(const T* gate, int64_t width, T* out, bool gelu) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    const __m512 activated = round16(activate16(load16(gate), gelu), gate);
    store16(out, _mm512_mul_ps(activated, load16(gate + width)));
    return true;
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    for (int h = 0; h < 16; h += 8) {
      const __m256 activated = round8(activate8(load8(gate + h), gelu), gate);
      store8(out + h, _mm256_mul_ps(activated, load8(gate + width + h)));
    }
    return true;
  }
#endif
  return false;
}

// out[i] = act(gate) * up for the flat indices [begin, end) of [T, I] (x: [T, 2I] = [gate | up], rows `stride`
// apart); 16 of one row at a time where it can, one at a time otherwise.
template <typename T>
static void gated_range(const T* xs, int64_t stride, int64_t width, T* o, int64_t begin, int64_t end, bool gelu) {
  for (int64_t i = begin; i < end;) {
    const int64_t r = i / width, j = i % width;
    if (j + 16 <= width && i + 16 <= end && gated16(xs + r * stride + j, width, o + i, gelu)) {
      i += 16;  // 16 of one row
      continue;
    }
    const float g = static_cast<float>(xs[r * stride + j]), u = static_cast<float>(xs[r * stride + width + j]);
    float activated;
    if (gelu) {
      activated = 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    } else {
      activated = g / (1.f + std::exp(-g));
    }
    o[i] = round_to<T>(static_cast<float>(round_to<T>(activated)) * u);
    ++i;
  }
}

// GatedActivationRows (folio_kernels.h) over [begin, end): the float32 code the tensor entry runs too.
__attribute__((noinline)) static void gated_range_f32(const float* x, int64_t stride, int64_t width, float* out,
                                                int64_t begin, int64_t end, bool gelu) {
  gated_range(x, stride, width, out, begin, end, gelu);
}

// gated_range, through gated_range_f32 for float32.
template <typename T>
static void gate(const T* x, int64_t stride, int64_t width, T* out, int64_t begin, int64_t end, bool gelu) {
  gated_range(x, stride, width, out, begin, end, gelu);
}
static void gate(const float* x, int64_t stride, int64_t width, float* out, int64_t begin, int64_t end, bool gelu) {
  gated_range_f32(x, stride, width, out, begin, end, gelu);
}

static void gated_activation_rows_f32(const float* x, int64_t stride, int64_t rows, int64_t width, float* out, bool gelu) {
  gated_range_f32(x, stride, width, out, 0, rows * width, gelu);
}

// [T, 2I] = [gate | up] -> act(gate) * up, [T, I]. gelu: the tanh approximation.
torch::Tensor gated_activation(torch::Tensor x, bool gelu) {
  check_rows(x);
  const int64_t rows = x.size(0), width = x.size(1) / 2, stride = x.stride(0);
  auto out = torch::empty({rows, width}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_activation", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * width, 2048, [&](int64_t begin, int64_t end) {
      gate(xs, stride, width, o, begin, end, gelu);
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "RMSNorm of rows");
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>(), "residual += x; RMSNorm(residual)");
  m.def("rotary_", &rotary_, py::call_guard<py::gil_scoped_release>(), "rotate-half rotary embedding of q and k, in place");
  m.def("gated_activation", &gated_activation, py::call_guard<py::gil_scoped_release>(), "act(gate) * up");
  m.def("row_argmax", &folio_row_argmax::row_argmax, py::call_guard<py::gil_scoped_release>(),
        "each row's maximum and its first index, as torch.max(x, dim=-1)");
  m.def("row_best", &folio_row_argmax::row_best, py::call_guard<py::gil_scoped_release>(), py::arg("values"),
        py::arg("first_row"), "[N, 3] float64: each row's maximum, first_row + its first index, 1 if not all finite");
  m.def("lora_add", &folio_lora::lora_add, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("out"),
        py::arg("a"), py::arg("b"), py::arg("slots"), py::arg("parts"),
        "out += each adapter row's x @ A[slot].T @ B[slot].T, in place (slot -1: none)");
  // For C++ callers in other extensions (decode_stack.cpp), typed by folio_kernels.h.
  py::dict entries;
  folio::add_entry<folio::RmsNorm>(entries, &rms_norm);
  folio::add_entry<folio::AddRmsNorm>(entries, &add_rms_norm);
  folio::add_entry<folio::Rotary>(entries, &rotary_);
  folio::add_entry<folio::GatedActivation>(entries, &gated_activation);
  folio::add_entry<folio::RmsNormRows>(entries, &rms_norm_rows_f32);
  folio::add_entry<folio::AddRmsNormRows>(entries, &add_rms_norm_rows_f32);
  folio::add_entry<folio::RotaryRows>(entries, &rotary_rows_f32);
  folio::add_entry<folio::GatedActivationRows>(entries, &gated_activation_rows_f32);
  folio::add_entry<folio::LoraAdd>(entries, &folio_lora::lora_add);
  m.attr("entries") = entries;
}
