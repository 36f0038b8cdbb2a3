// One decode step through all decoder layers of a model, in C++: the Llama family, Qwen3 (QK-norm) and
// Gemma 3 (QK-norm, a norm before and after both the attention and the MLP, two RoPE tables).
//
// At batch-1 decode a layer is ~15 kernel calls of a few microseconds each; driven from Python, each
// also pays for module calls, argument parsing and small tensor views, which together cost more than
// the quantized matmuls. This runs the same kernels, in the same order, on the same tensors, from one
// call per step: the norms, rotary and activation of fused_ops.cpp, the 4-bit and 8-bit dot products
// of int8_dot.cpp (or a dense GEMM), and the paged decode attention of paged_decode.cpp. Those live in
// their own extensions and hand their entry points over as capsules, named and typed by
// folio_kernels.h, so nothing is compiled twice. The Python layers stay the oracle, and the path for
// everything this does not take (prefill, 8-bit KV caches, other weight formats).
#include <torch/extension.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "folio_kernels.h"

namespace {

struct Kernels {
  folio::Int4Linear::Fn int4_linear;
  folio::Int8Linear::Fn int8_linear;
  folio::PagedDecodeAttention::Fn attention;
  folio::RmsNorm::Fn rms_norm;
  folio::AddRmsNorm::Fn add_rms_norm;
  folio::Rotary::Fn rotary;
  folio::GatedActivation::Fn activation;
};

// A projection: a dense weight [N, K], 4-bit (or 5-bit) or 8-bit tiles (int8_dot.cpp's layouts) with N
// rows, or row blocks of those (`parts`, e.g. a fused q/k/v whose v is in another format), outputs joined.
struct Projection {
  enum class Kind { kDense, kInt4, kInt8, kRowBlocks };
  Kind kind;
  torch::Tensor weight;  // dense: the weight; else the tiles
  std::optional<torch::Tensor> scales, mins, bias;
  int64_t group = 0, rows = 0;
  bool exact = true;  // activations in 8 + 8 bits into the dot products, else 8 (int8_activations.h)
  torch::Tensor high_bits = torch::empty({0}, torch::kUInt8);  // 5-bit codes' fifth bits (int8_tiles.h)
  std::vector<Projection> parts;

  torch::Tensor operator()(const Kernels& k, const torch::Tensor& x) const {
    if (kind == Kind::kDense) return torch::linear(x, weight, bias);
    torch::Tensor out;
    if (kind == Kind::kRowBlocks) {
      std::vector<torch::Tensor> outs;
      for (const Projection& part : parts) outs.push_back(part(k, x));
      out = torch::cat(outs, 1);
    } else {
      out = kind == Kind::kInt4 ? k.int4_linear(x, weight, high_bits, *scales, *mins, group, rows, exact)
                                : k.int8_linear(x, weight, *scales, group, rows, exact);
    }
    return bias ? out + *bias : out;
  }
};

// A layer's norm weights. Llama: input and post_attention (before the MLP). Gemma 3 adds
// pre_feedforward and post_feedforward, and its post_attention norm is of the attention's output.
// Qwen3 and Gemma 3 norm each query and key head (q_norm, k_norm).
struct Norms {
  torch::Tensor input, post_attention;
  std::optional<torch::Tensor> pre_feedforward, post_feedforward, q, k;
};

// rows [T, kv_heads, head_dim] (a view into the fused qkv output: each token's heads side by side) into
// the cache's slots, one copy a token. index_copy_ builds a TensorIterator per call, twice a layer; at one
// token that set-up is most of its cost. A cache this cannot address (not contiguous) takes index_copy_.
void write_slots(const torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& rows) {
  const int64_t tokens = rows.size(0), width = rows.size(1) * rows.size(2);
  const bool direct = cache.is_contiguous() && cache.scalar_type() == rows.scalar_type() && cache.dim() == 3 &&
                      cache.size(1) * cache.size(2) == width && rows.stride(2) == 1 && rows.stride(1) == rows.size(2) &&
                      slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == tokens;
  if (!direct) {
    cache.index_copy_(0, slots, rows);
    return;
  }
  const int64_t bytes = width * rows.element_size(), capacity = cache.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  char* to = static_cast<char*>(cache.data_ptr());
  const char* from = static_cast<const char*>(rows.data_ptr());
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " outside the KV cache's ", capacity);
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(to + slot[t] * bytes, from + t * rows.stride(0) * rows.element_size(), bytes);
}

struct Layer {
  Norms norms;
  Projection qkv, o, gate_up, down;
  torch::Tensor k_cache, v_cache;
  int64_t window;
  int64_t rope;      // which of forward's RoPE tables: 0, or 1 for Gemma's local layers
  int64_t kv_group;  // whose slots and block tables it reads (one table per KV cache group)
};

class DecodeStack {
 public:
  // entries: the merged `entries` of the fused_ops, int8_dot and paged_decode extensions.
  // norm_offset: 0 (weight) or 1 (Gemma's 1 + weight). sandwich: Gemma 3's four norms a layer.
  DecodeStack(const py::dict& entries, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
              double scale, double eps, double norm_offset, bool gelu, bool sandwich)
      : kernels_{folio::entry<folio::Int4Linear>(entries), folio::entry<folio::Int8Linear>(entries),
                 folio::entry<folio::PagedDecodeAttention>(entries), folio::entry<folio::RmsNorm>(entries),
                 folio::entry<folio::AddRmsNorm>(entries), folio::entry<folio::Rotary>(entries),
                 folio::entry<folio::GatedActivation>(entries)},
        heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), block_size_(block_size), scale_(scale),
        eps_(eps), offset_(norm_offset), gelu_(gelu), sandwich_(sandwich) {}

  void add_layer(Norms norms, Projection qkv, Projection o, Projection gate_up, Projection down, torch::Tensor k_cache,
                 torch::Tensor v_cache, int64_t window, int64_t rope, int64_t kv_group) {
    TORCH_CHECK(norms.q.has_value() == norms.k.has_value(), "q and k norms come together");
    TORCH_CHECK(!sandwich_ || (norms.pre_feedforward && norms.post_feedforward), "a sandwich layer has four norms");
    TORCH_CHECK(rope == 0 || rope == 1, "rope: table 0 or 1");
    TORCH_CHECK(kv_group >= 0, "kv_group: a group's index");
    layers_.push_back({std::move(norms), qkv, o, gate_up, down, k_cache, v_cache, window, rope, kv_group});
  }

  // hidden [T, D]: the embedded tokens, one per sequence; rope: [cos, sin] or [cos, sin, local cos, local
  // sin], each [T, head_dim]; per KV cache group, slots [T] and block_tables [T, max_blocks]; seq_lens [T].
  // Returns (x, residual):
  // the model's hidden states are residual + x, still to be added and normed as the Python layers'
  // final norm does. `hidden` itself becomes the residual stream (written in place).
  std::vector<torch::Tensor> forward(torch::Tensor hidden, std::vector<torch::Tensor> rope,
                                     std::vector<torch::Tensor> slots, std::vector<torch::Tensor> block_tables,
                                     torch::Tensor seq_lens) const {
    const Kernels& k = kernels_;
    TORCH_CHECK(rope.size() == 2 || rope.size() == 4, "rope: one or two (cos, sin) pairs");
    TORCH_CHECK(slots.size() == block_tables.size(), "slots and block tables: one of each per KV cache group");
    for (const Layer& layer : layers_) TORCH_CHECK(layer.kv_group < static_cast<int64_t>(slots.size()), "kv_group");
    const int64_t tokens = hidden.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    torch::Tensor residual = hidden, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const Norms& norms = layer.norms;
      h = i == 0 ? k.rms_norm(residual, norms.input, eps_, offset_) : k.add_rms_norm(h, residual, norms.input, eps_, offset_);
      const torch::Tensor qkv = layer.qkv(k, h);
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads_, head_dim_});
      torch::Tensor key = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads_, head_dim_});
      const torch::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads_, head_dim_});
      if (norms.q) {  // each head's rows normed (a copy: the heads of a fused output are not evenly strided)
        q = k.rms_norm(q.reshape({tokens * heads_, head_dim_}), *norms.q, eps_, offset_).view({tokens, heads_, head_dim_});
        key = k.rms_norm(key.reshape({tokens * kv_heads_, head_dim_}), *norms.k, eps_, offset_)
                  .view({tokens, kv_heads_, head_dim_});
      }
      const size_t table = rope.size() == 4 ? 2 * static_cast<size_t>(layer.rope) : 0;
      k.rotary(q, key, rope[table], rope[table + 1]);
      const size_t group = static_cast<size_t>(layer.kv_group);
      write_slots(layer.k_cache, slots[group], key);
      write_slots(layer.v_cache, slots[group], value);
      const torch::Tensor attended = k.attention(q.contiguous(), layer.k_cache, layer.v_cache, block_tables[group], seq_lens,
                                                 block_size_, scale_, layer.window, std::nullopt, std::nullopt);
      const torch::Tensor projected = layer.o(k, attended.view({tokens, q_size}));
      if (sandwich_) {
        const torch::Tensor normed = k.rms_norm(projected, norms.post_attention, eps_, offset_);
        h = k.add_rms_norm(normed, residual, *norms.pre_feedforward, eps_, offset_);
      } else {
        h = k.add_rms_norm(projected, residual, norms.post_attention, eps_, offset_);
      }
      h = layer.down(k, k.activation(layer.gate_up(k, h), gelu_));
      if (sandwich_) h = k.rms_norm(h, *norms.post_feedforward, eps_, offset_);
    }
    return {h, residual};
  }

 private:
  Kernels kernels_;
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_, block_size_;
  double scale_, eps_, offset_;
  bool gelu_, sandwich_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using Kind = Projection::Kind;
  using Tensor = torch::Tensor;
  using Maybe = std::optional<torch::Tensor>;
  py::class_<Projection>(m, "Projection")
      .def_static("dense", [](Tensor weight, Maybe bias) { return Projection{Kind::kDense, weight, {}, {}, bias}; },
                  py::arg("weight"), py::arg("bias"))
      .def_static("int4",
                  [](Tensor tiles, Tensor high_bits, Tensor scales, Tensor mins, int64_t group, int64_t rows, Maybe bias,
                     bool exact) {
                    return Projection{Kind::kInt4, tiles, scales, mins, bias, group, rows, exact, high_bits};
                  },
                  py::arg("tiles"), py::arg("high_bits"), py::arg("scales"), py::arg("mins"), py::arg("group"),
                  py::arg("rows"), py::arg("bias"), py::arg("exact") = true)
      .def_static("row_blocks",
                  [](std::vector<Projection> parts, Maybe bias) {
                    TORCH_CHECK(!parts.empty(), "row_blocks: at least one part");
                    Projection joined{Kind::kRowBlocks, torch::Tensor(), {}, {}, bias};
                    joined.parts = std::move(parts);
                    return joined;
                  },
                  py::arg("parts"), py::arg("bias"))
      .def_static("int8",
                  [](Tensor tiles, Tensor scales, int64_t group, int64_t rows, Maybe bias, bool exact) {
                    return Projection{Kind::kInt8, tiles, scales, {}, bias, group, rows, exact};
                  },
                  py::arg("tiles"), py::arg("scales"), py::arg("group"), py::arg("rows"), py::arg("bias"),
                  py::arg("exact") = true);
  py::class_<Norms>(m, "Norms")
      .def(py::init([](Tensor input, Tensor post_attention, Maybe pre_feedforward, Maybe post_feedforward, Maybe q,
                       Maybe k) { return Norms{input, post_attention, pre_feedforward, post_feedforward, q, k}; }),
           py::arg("input"), py::arg("post_attention"), py::arg("pre_feedforward"), py::arg("post_feedforward"),
           py::arg("q"), py::arg("k"));
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<const py::dict&, int64_t, int64_t, int64_t, int64_t, double, double, double, bool, bool>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}
