// Small fused CPU ops for the layers around the matmuls: RMSNorm (with the residual add before it),
// rotary embedding in place, and gated activations. Each replaces 5-15 PyTorch ops, and at decode,
// where a token's whole layer is a few microseconds of arithmetic, the per-op dispatch is the cost.
//
// Arithmetic is float32 and rounds to the tensor's dtype where the PyTorch path (the oracle, in
// norm.py, rotary.py and activation.py) rounds: the residual sum, the normalized x before Llama's
// weight, the output.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "folio_kernels.h"

namespace {

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// out[t] = norm(x[t]) * w, as RMSNorm in norm.py: Llama rounds the normalized row to T before the
// weight (weight_offset == 0); Gemma multiplies by (1 + w) in float32 and rounds once.
template <typename T, typename W>
void rms_norm_rows(const T* x, int64_t x_stride, const W* w, float eps, float offset, T* out, int64_t rows,
                   int64_t dim) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
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
  });
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
    const scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* rs = residual.data_ptr<scalar_t>();
    const int64_t rows = x.size(0), dim = x.size(1), stride = x.stride(0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < dim; ++i)
        rs[r * dim + i] = round_to<scalar_t>(static_cast<float>(rs[r * dim + i]) + static_cast<float>(xs[r * stride + i]));
  });
  return rms_norm(residual, weight, eps, offset);
}

// In place, rotate-half layout: x[t, h, :D/2], x[t, h, D/2:] = a*cos - b*sin, b*cos + a*sin, for q and k
// (strided views of a fused qkv output are fine). cos, sin: [T, D] in x's dtype.
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous(), "cos, sin: contiguous [T, D]");
  for (auto* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2), "q, k: [T, H, D], rows of heads");
    TORCH_CHECK(x->scalar_type() == cos.scalar_type() && x->size(0) == cos.size(0) && x->size(2) == cos.size(1),
                "cos/sin: x's dtype and [T, D]");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    for (auto* x : {&q, &k}) {
      scalar_t* data = x->data_ptr<scalar_t>();
      const int64_t tokens = x->size(0), heads = x->size(1), dim = x->size(2), half = dim / 2, stride = x->stride(0);
      for (int64_t t = 0; t < tokens; ++t) {
        const scalar_t* ct = c + t * dim;
        const scalar_t* st = s + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = data + t * stride + h * dim;
          for (int64_t i = 0; i < half; ++i) {
            const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
            v[i] = round_to<scalar_t>(a * static_cast<float>(ct[i]) - b * static_cast<float>(st[i]));
            v[i + half] = round_to<scalar_t>(b * static_cast<float>(ct[i + half]) + a * static_cast<float>(st[i + half]));
          }
        }
      }
    }
  });
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
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / width, j = i % width;
        const float g = static_cast<float>(xs[r * stride + j]), u = static_cast<float>(xs[r * stride + width + j]);
        float activated;
        if (gelu) {
          activated = 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
        } else {
          activated = g / (1.f + std::exp(-g));
        }
        o[i] = round_to<scalar_t>(static_cast<float>(round_to<scalar_t>(activated)) * u);
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual)");
  m.def("rotary_", &rotary_, "rotate-half rotary embedding of q and k, in place");
  m.def("gated_activation", &gated_activation, "act(gate) * up");
  // For C++ callers in other extensions (decode_stack.cpp), typed by folio_kernels.h.
  py::dict entries;
  folio::add_entry<folio::RmsNorm>(entries, &rms_norm);
  folio::add_entry<folio::AddRmsNorm>(entries, &add_rms_norm);
  folio::add_entry<folio::Rotary>(entries, &rotary_);
  folio::add_entry<folio::GatedActivation>(entries, &gated_activation);
  m.attr("entries") = entries;
}
