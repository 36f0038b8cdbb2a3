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
// everything this does not take (prefill, 8-bit KV caches, other weight formats). A step of a few float32
// tokens over tiled weights runs in teams instead (decode_team_step.h): the same code, in raw loops over
// buffers of its own, one parallel region a layer.
#include <torch/extension.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <vector>

#include "decode_layer.h"
#include "decode_team_step.h"
#include "folio_kernels.h"

namespace {

using folio_decode::Kernels;
using folio_decode::Layer;
using folio_decode::Norms;
using folio_decode::Plan;
using folio_decode::Projection;
using folio_decode::StackShape;

// Steps of at most this many tokens take the team path (decode_team_step.h): one parallel region a layer,
// the serial work between projections on thread 0 while the others prefetch. A larger batch keeps the
// kernel-by-kernel path, whose norms, activation and attention spread over the threads.
constexpr int64_t kTeamMaxTokens = 4;

class DecodeStack {
 public:
  // entries: the merged `entries` of the fused_ops, int8_dot and paged_decode extensions.
  // norm_offset: 0 (weight) or 1 (Gemma's 1 + weight). sandwich: Gemma 3's four norms a layer.
  DecodeStack(const py::dict& entries, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
              double scale, double eps, double norm_offset, bool gelu, bool sandwich)
      : kernels_{Kernels::from(entries)},
        shape_{num_heads, num_kv_heads, head_dim, block_size, scale, eps, norm_offset, gelu, sandwich} {}

  void add_layer(Norms norms, Projection qkv, Projection o, Projection gate_up, Projection down, torch::Tensor k_cache,
                 torch::Tensor v_cache, int64_t window, int64_t rope, int64_t kv_group) {
    TORCH_CHECK(norms.q.has_value() == norms.k.has_value(), "q and k norms come together");
    TORCH_CHECK(!shape_.sandwich || (norms.pre_feedforward && norms.post_feedforward), "a sandwich layer has four norms");
    TORCH_CHECK(rope == 0 || rope == 1, "rope: table 0 or 1");
    TORCH_CHECK(kv_group >= 0, "kv_group: a group's index");
    const auto of = kernels_.tiled_weight_of;
    Plan plans[] = {folio_decode::plan_of(qkv, of), folio_decode::plan_of(o, of), folio_decode::plan_of(gate_up, of),
                     folio_decode::plan_of(down, of)};
    const int64_t q_size = shape_.heads * shape_.head_dim, kv_size = shape_.kv_heads * shape_.head_dim;
    in_teams_ = in_teams_ && plans[0].tiled && plans[1].tiled && plans[2].tiled && plans[3].tiled &&
                plans[0].rows == q_size + 2 * kv_size && plans[1].cols == q_size && plans[2].cols == plans[1].rows &&
                plans[3].cols * 2 == plans[2].rows && plans[3].rows == plans[1].rows &&
                (layers_.empty() || plans[1].rows == layers_[0].o_plan.rows);
    layers_.push_back({std::move(norms), qkv, o, gate_up, down, plans[0], plans[1], plans[2], plans[3], k_cache,
                       v_cache, window, rope, kv_group});
    in_teams_ = in_teams_ && folio_decode::team_can_run(layers_.back(), shape_);
    widest_mlp_ = std::max(widest_mlp_, plans[2].rows);
  }

  // LoRA slots for layer `layer`'s projection `which` (0 q/k/v, 1 o, 2 gate/up, 3 down), read by steps
  // given row slots.
  void set_lora(int64_t layer, int64_t which, torch::Tensor a, torch::Tensor b, std::vector<int64_t> parts) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && which >= 0 && which < 4,
                "set_lora: no such layer or projection");
    Layer& target = layers_[static_cast<size_t>(layer)];
    Projection* projections[] = {&target.qkv, &target.o, &target.gate_up, &target.down};
    projections[which]->lora = folio_decode::LoraSlots{std::move(a), std::move(b), std::move(parts)};
  }

  // Steps taken in teams (one parallel region a layer), and kernel by kernel.
  int64_t team_steps() const { return team_steps_.load(); }
  int64_t kernel_steps() const { return kernel_steps_.load(); }

  // hidden [T, D]: the embedded tokens, one per sequence; rope: [cos, sin] or [cos, sin, local cos, local
  // sin], each [T, head_dim]; per KV cache group, slots [T] and block_tables [T, max_blocks]; seq_lens [T];
  // lora_slots [T] int64: each token's LoRA slot (-1 none), or none for a step without adapters.
  // Returns (x, residual):
  // the model's hidden states are residual + x, still to be added and normed as the Python layers'
  // final norm does. `hidden` itself becomes the residual stream (written in place).
  std::vector<torch::Tensor> forward(torch::Tensor hidden, std::vector<torch::Tensor> rope,
                                     std::vector<torch::Tensor> slots, std::vector<torch::Tensor> block_tables,
                                     torch::Tensor seq_lens, std::optional<torch::Tensor> lora_slots) const {
    const Kernels& k = kernels_;
    TORCH_CHECK(rope.size() == 2 || rope.size() == 4, "rope: one or two (cos, sin) pairs");
    TORCH_CHECK(slots.size() == block_tables.size(), "slots and block tables: one of each per KV cache group");
    for (const Layer& layer : layers_) TORCH_CHECK(layer.kv_group < static_cast<int64_t>(slots.size()), "kv_group");
    if (!lora_slots && takes_in_teams(hidden, rope, slots)) {  // the team's loops add no adapter rows
      ++team_steps_;
      return folio_decode::TeamStep(kernels_, shape_, layers_, widest_mlp_)(hidden, rope, slots, block_tables, seq_lens);
    }
    ++kernel_steps_;
    torch::Tensor residual = hidden, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const Norms& norms = layer.norms;
      h = i == 0 ? k.rms_norm(residual, norms.input, shape_.eps, shape_.offset)
                 : k.add_rms_norm(h, residual, norms.input, shape_.eps, shape_.offset);
      const torch::Tensor q = queries(layer, layer.qkv(k, h, lora_slots), rope, slots);
      const torch::Tensor projected = layer.o(k, attend(layer, q, block_tables, seq_lens), lora_slots);
      const torch::Tensor gate_up = layer.gate_up(k, mlp_input(layer, projected, residual), lora_slots);
      h = layer.down(k, k.activation(gate_up, shape_.gelu), lora_slots);
      if (shape_.sandwich) h = k.rms_norm(h, *norms.post_feedforward, shape_.eps, shape_.offset);
    }
    return {h, residual};
  }

 private:
  // Whether a step takes the team path (decode_team_step.h): few float32 tokens, every layer's tensors
  // what its loops read, and rope tables and slots as they read them.
  bool takes_in_teams(const torch::Tensor& hidden, const std::vector<torch::Tensor>& rope,
                      const std::vector<torch::Tensor>& slots) const {
    const int64_t tokens = hidden.size(0);
    if (!in_teams_ || layers_.empty() || tokens > kTeamMaxTokens || hidden.scalar_type() != torch::kFloat32 ||
        !hidden.is_contiguous() || hidden.dim() != 2 || hidden.size(1) != layers_[0].qkv_plan.cols)
      return false;
    for (const torch::Tensor& table : rope)
      if (table.scalar_type() != torch::kFloat32 || !table.is_contiguous() || table.dim() != 2 ||
          table.size(0) != tokens || table.size(1) != shape_.head_dim)
        return false;
    for (const torch::Tensor& slot : slots)
      if (slot.scalar_type() != torch::kInt64 || !slot.is_contiguous() || slot.numel() != tokens) return false;
    return true;
  }

  // A layer's queries [T, H, D] from its q/k/v projection's output [T, q + 2 kv]: each head normed
  // where the model norms heads, rotated; its keys (normed, rotated) and values written to its cache.
  torch::Tensor queries(const Layer& layer, const torch::Tensor& qkv, const std::vector<torch::Tensor>& rope,
                        const std::vector<torch::Tensor>& slots) const {
    const Kernels& k = kernels_;
    const int64_t tokens = qkv.size(0), heads = shape_.heads, kv_heads = shape_.kv_heads, dim = shape_.head_dim;
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, dim});
    torch::Tensor key = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, dim});
    const torch::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, dim});
    if (layer.norms.q) {  // each head's rows normed (a copy: the heads of a fused output are not evenly strided)
      const double eps = shape_.eps, offset = shape_.offset;
      q = k.rms_norm(q.reshape({tokens * heads, dim}), *layer.norms.q, eps, offset).view({tokens, heads, dim});
      key = k.rms_norm(key.reshape({tokens * kv_heads, dim}), *layer.norms.k, eps, offset).view({tokens, kv_heads, dim});
    }
    const size_t table = rope.size() == 4 ? 2 * static_cast<size_t>(layer.rope) : 0;
    k.rotary(q, key, rope[table], rope[table + 1]);
    const size_t group = static_cast<size_t>(layer.kv_group);
    folio_decode::write_slots(layer.k_cache, slots[group], key);
    folio_decode::write_slots(layer.v_cache, slots[group], value);
    return q.contiguous();
  }

  // The attention of a layer's queries [T, H, D] over its cache: [T, H * D].
  torch::Tensor attend(const Layer& layer, const torch::Tensor& q, const std::vector<torch::Tensor>& block_tables,
                       const torch::Tensor& seq_lens) const {
    const size_t group = static_cast<size_t>(layer.kv_group);
    const torch::Tensor attended = kernels_.attention(q, layer.k_cache, layer.v_cache, block_tables[group], seq_lens,
                                                      shape_.block_size, shape_.scale, layer.window, std::nullopt,
                                                      std::nullopt);
    return attended.view({q.size(0), shape_.heads * shape_.head_dim});
  }

  // The MLP's normed input from the attention's projected output; the residual stream gains it.
  torch::Tensor mlp_input(const Layer& layer, const torch::Tensor& projected, torch::Tensor& residual) const {
    const Kernels& k = kernels_;
    const double eps = shape_.eps, offset = shape_.offset;
    if (!shape_.sandwich) return k.add_rms_norm(projected, residual, layer.norms.post_attention, eps, offset);
    const torch::Tensor normed = k.rms_norm(projected, layer.norms.post_attention, eps, offset);
    return k.add_rms_norm(normed, residual, *layer.norms.pre_feedforward, eps, offset);
  }

  Kernels kernels_;
  std::vector<Layer> layers_;
  StackShape shape_;
  bool in_teams_ = true;    // every layer's projections tiled, its tensors as the team reads them
  int64_t widest_mlp_ = 0;  // the widest gate/up output of any layer
  mutable std::atomic<int64_t> team_steps_{0}, kernel_steps_{0};  // steps each path took
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
      .def("set_lora", &DecodeStack::set_lora)
      .def_property_readonly("team_steps", [](const DecodeStack& s) { return s.team_steps(); })
      .def_property_readonly("kernel_steps", [](const DecodeStack& s) { return s.kernel_steps(); })
      .def("forward", &DecodeStack::forward, py::arg("hidden"), py::arg("rope"), py::arg("slots"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("lora_slots") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}
