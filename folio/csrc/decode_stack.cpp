// One decode step through all decoder layers of a Llama-family model, in C++.
//
// At batch-1 decode a layer is ~15 kernel calls of a few microseconds each; driven from Python, each
// also pays for module calls, argument parsing and small tensor views, which together cost more than
// the 4-bit matmuls. This runs the same kernels, in the same order, on the same tensors, from one call
// per step: the norms, rotary and activation of fused_ops.cpp, the 4-bit dot products of
// int8_dot.cpp (or a dense GEMM), and the paged decode attention of paged_decode.cpp. Those live in
// their own extensions and hand their entry points over as capsules, named and typed by
// folio_kernels.h, so nothing is compiled twice. The Python layers (models/llama.py) stay the oracle,
// and the path for everything this does not take (prefill, 8-bit KV caches, other weight formats).
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "folio_kernels.h"

namespace {

struct Kernels {
  folio::Int4Linear::Fn int4_linear;
  folio::PagedDecodeAttention::Fn attention;
  folio::RmsNorm::Fn rms_norm;
  folio::AddRmsNorm::Fn add_rms_norm;
  folio::Rotary::Fn rotary;
  folio::GatedActivation::Fn activation;
};

// A projection: a dense weight [N, K], or 4-bit tiles (int8_dot.cpp's layout) with N rows.
struct Projection {
  std::optional<torch::Tensor> weight, tiles, scales, mins, bias;
  int64_t group = 0, rows = 0;

  torch::Tensor operator()(const Kernels& k, const torch::Tensor& x) const {
    if (weight) return torch::linear(x, *weight, bias);
    torch::Tensor out = k.int4_linear(x, *tiles, *scales, *mins, group, rows);
    return bias ? out + *bias : out;
  }
};

struct Layer {
  torch::Tensor input_norm, post_attention_norm;
  Projection qkv, o, gate_up, down;
  torch::Tensor k_cache, v_cache;
  int64_t window;
};

class DecodeStack {
 public:
  // entries: the merged `entries` of the fused_ops, int8_dot and paged_decode extensions.
  DecodeStack(const py::dict& entries, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
              double scale, double eps, bool gelu)
      : kernels_{folio::entry<folio::Int4Linear>(entries), folio::entry<folio::PagedDecodeAttention>(entries),
                 folio::entry<folio::RmsNorm>(entries), folio::entry<folio::AddRmsNorm>(entries),
                 folio::entry<folio::Rotary>(entries), folio::entry<folio::GatedActivation>(entries)},
        heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), block_size_(block_size), scale_(scale),
        eps_(eps), gelu_(gelu) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm, Projection qkv, Projection o,
                 Projection gate_up, Projection down, torch::Tensor k_cache, torch::Tensor v_cache, int64_t window) {
    layers_.push_back({input_norm, post_attention_norm, qkv, o, gate_up, down, k_cache, v_cache, window});
  }

  // hidden [T, D]: the embedded tokens, one per sequence; cos, sin [T, head_dim]; slots [T]; block_tables
  // [T, max_blocks]; seq_lens [T]. Returns (the last MLP's output, the residual stream before it), as
  // LlamaModel's layer loop leaves them; `hidden` itself becomes the residual stream (written in place).
  std::vector<torch::Tensor> forward(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                                     torch::Tensor block_tables, torch::Tensor seq_lens) const {
    const Kernels& k = kernels_;
    const int64_t tokens = hidden.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    torch::Tensor residual = hidden, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      h = i == 0 ? k.rms_norm(residual, layer.input_norm, eps_, 0.0)
                 : k.add_rms_norm(h, residual, layer.input_norm, eps_, 0.0);
      const torch::Tensor qkv = layer.qkv(k, h);
      const torch::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads_, head_dim_});
      const torch::Tensor key = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads_, head_dim_});
      const torch::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads_, head_dim_});
      k.rotary(q, key, cos, sin);
      layer.k_cache.index_copy_(0, slots, key);
      layer.v_cache.index_copy_(0, slots, value);
      const torch::Tensor attended = k.attention(q.contiguous(), layer.k_cache, layer.v_cache, block_tables, seq_lens,
                                                 block_size_, scale_, layer.window, std::nullopt, std::nullopt);
      h = k.add_rms_norm(layer.o(k, attended.view({tokens, q_size})), residual, layer.post_attention_norm, eps_, 0.0);
      h = layer.down(k, k.activation(layer.gate_up(k, h), gelu_));
    }
    return {h, residual};
  }

 private:
  Kernels kernels_;
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_, block_size_;
  double scale_, eps_;
  bool gelu_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Projection>(m, "Projection")
      .def(py::init([](std::optional<torch::Tensor> weight, std::optional<torch::Tensor> tiles,
                       std::optional<torch::Tensor> scales, std::optional<torch::Tensor> mins, int64_t group,
                       int64_t rows, std::optional<torch::Tensor> bias) {
             TORCH_CHECK(weight.has_value() != tiles.has_value(), "a projection is dense or 4-bit tiles");
             return Projection{weight, tiles, scales, mins, bias, group, rows};
           }),
           py::arg("weight"), py::arg("tiles"), py::arg("scales"), py::arg("mins"), py::arg("group"), py::arg("rows"),
           py::arg("bias"));
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<const py::dict&, int64_t, int64_t, int64_t, int64_t, double, double, bool>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward);
}
