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

#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "decode_plan.h"
#include "folio_kernels.h"

namespace {

using folio_decode::Plan;
using folio_decode::Team;

// Steps of at most this many tokens take the team path (decode_team.h): one parallel region a layer,
// the serial work between projections on thread 0 while the others prefetch. A larger batch keeps the
// kernel-by-kernel path, whose norms, activation and attention spread over the threads.
constexpr int64_t kTeamMaxTokens = 4;

struct Kernels {
  folio::Int4Linear::Fn int4_linear;
  folio::Int8Linear::Fn int8_linear;
  folio::PagedDecodeAttention::Fn attention;
  folio::RmsNorm::Fn rms_norm;
  folio::AddRmsNorm::Fn add_rms_norm;
  folio::Rotary::Fn rotary;
  folio::GatedActivation::Fn activation;
  folio::LinearTiles::Fn linear_tiles;
  folio::TiledWeightOf::Fn tiled_weight_of;
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

// The team's view of a projection (decode_plan.h): tiled, or not (dense weights, or tensors the int8
// kernels' checks refuse, keep the kernel-by-kernel path, which reports those).
Plan plan_of(const Projection& projection, folio::TiledWeightOf::Fn tiled_weight_of) {
  Plan plan;
  plan.bias = projection.bias;
  const bool joined = projection.kind == Projection::Kind::kRowBlocks;
  const Projection* parts = joined ? projection.parts.data() : &projection;
  const size_t count = joined ? projection.parts.size() : 1;
  if (count > static_cast<size_t>(folio_decode::TeamState::kMaxParts)) return plan;
  for (size_t p = 0; p < count; ++p) {
    const Projection& part = parts[p];
    if (part.bias || (part.kind != Projection::Kind::kInt4 && part.kind != Projection::Kind::kInt8)) return plan;
    const bool four = part.kind == Projection::Kind::kInt4;
    try {
      plan.parts.push_back(tiled_weight_of(part.weight, part.high_bits, *part.scales, four ? &*part.mins : nullptr,
                                           part.group, part.rows, part.exact));
    } catch (const c10::Error&) {
      return plan;
    }
    if (plan.parts.back().cols != plan.parts[0].cols) return plan;
    plan.rows += part.rows;
  }
  plan.cols = plan.parts[0].cols;
  plan.tiled = true;
  return plan;
}

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
  Plan qkv_plan, o_plan, gate_up_plan, down_plan;
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
                 folio::entry<folio::GatedActivation>(entries), folio::entry<folio::LinearTiles>(entries),
                 folio::entry<folio::TiledWeightOf>(entries)},
        heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), block_size_(block_size), scale_(scale),
        eps_(eps), offset_(norm_offset), gelu_(gelu), sandwich_(sandwich) {}

  void add_layer(Norms norms, Projection qkv, Projection o, Projection gate_up, Projection down, torch::Tensor k_cache,
                 torch::Tensor v_cache, int64_t window, int64_t rope, int64_t kv_group) {
    TORCH_CHECK(norms.q.has_value() == norms.k.has_value(), "q and k norms come together");
    TORCH_CHECK(!sandwich_ || (norms.pre_feedforward && norms.post_feedforward), "a sandwich layer has four norms");
    TORCH_CHECK(rope == 0 || rope == 1, "rope: table 0 or 1");
    TORCH_CHECK(kv_group >= 0, "kv_group: a group's index");
    const auto of = kernels_.tiled_weight_of;
    Plan plans[] = {plan_of(qkv, of), plan_of(o, of), plan_of(gate_up, of), plan_of(down, of)};
    tiled_ = tiled_ && plans[0].tiled && plans[1].tiled && plans[2].tiled && plans[3].tiled &&
             plans[0].rows == heads_ * head_dim_ + 2 * kv_heads_ * head_dim_ && plans[1].cols == heads_ * head_dim_ &&
             plans[2].cols == plans[1].rows && plans[3].cols * 2 == plans[2].rows && plans[3].rows == plans[1].rows;
    layers_.push_back({std::move(norms), qkv, o, gate_up, down, plans[0], plans[1], plans[2], plans[3], k_cache,
                       v_cache, window, rope, kv_group});
  }

  // hidden [T, D]: the embedded tokens, one per sequence; rope: [cos, sin] or [cos, sin, local cos, local
  // sin], each [T, head_dim]; per KV cache group, slots [T] and block_tables [T, max_blocks]; seq_lens [T].
  // Returns (x, residual):
  // the model's hidden states are residual + x, still to be added and normed as the Python layers'
  // final norm does. `hidden` itself becomes the residual stream (written in place).
  // Steps taken in teams (one parallel region a layer), and kernel by kernel.
  int64_t team_steps() const { return team_steps_.load(); }
  int64_t kernel_steps() const { return kernel_steps_.load(); }

  std::vector<torch::Tensor> forward(torch::Tensor hidden, std::vector<torch::Tensor> rope,
                                     std::vector<torch::Tensor> slots, std::vector<torch::Tensor> block_tables,
                                     torch::Tensor seq_lens) const {
    const Kernels& k = kernels_;
    TORCH_CHECK(rope.size() == 2 || rope.size() == 4, "rope: one or two (cos, sin) pairs");
    TORCH_CHECK(slots.size() == block_tables.size(), "slots and block tables: one of each per KV cache group");
    for (const Layer& layer : layers_) TORCH_CHECK(layer.kv_group < static_cast<int64_t>(slots.size()), "kv_group");
    const int64_t tokens = hidden.size(0);
    if (tiled_ && !layers_.empty() && tokens <= kTeamMaxTokens && hidden.scalar_type() == torch::kFloat32 &&
        hidden.is_contiguous() && hidden.size(1) == layers_[0].qkv_plan.cols)
      return forward_in_teams(hidden, rope, slots, block_tables, seq_lens);
    ++kernel_steps_;
    torch::Tensor residual = hidden, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const Norms& norms = layer.norms;
      h = i == 0 ? k.rms_norm(residual, norms.input, eps_, offset_) : k.add_rms_norm(h, residual, norms.input, eps_, offset_);
      const torch::Tensor q = queries(layer, layer.qkv(k, h), rope, slots);
      const torch::Tensor projected = layer.o(k, attend(layer, q, block_tables, seq_lens));
      h = layer.down(k, k.activation(layer.gate_up(k, mlp_input(layer, projected, residual)), gelu_));
      if (sandwich_) h = k.rms_norm(h, *norms.post_feedforward, eps_, offset_);
    }
    return {h, residual};
  }

 private:
  // The same step in teams (decode_team.h): one parallel region from each layer's attention output to
  // the next layer's queries, the attention between them in its own (it spreads its heads and key
  // chunks over the threads). The kernels are the same, in the same order, each row's products summed
  // by the same tile code: the results are the kernel-by-kernel path's, bit for bit.
  std::vector<torch::Tensor> forward_in_teams(torch::Tensor hidden, const std::vector<torch::Tensor>& rope,
                                              const std::vector<torch::Tensor>& slots,
                                              const std::vector<torch::Tensor>& block_tables,
                                              const torch::Tensor& seq_lens) const {
    const Kernels& k = kernels_;
    ++team_steps_;
    const int64_t tokens = hidden.size(0), count = static_cast<int64_t>(layers_.size());
    torch::Tensor residual = hidden, h, q, attended, out, act;  // shared by the team: thread 0 writes them
    // Thread 0, then: out made for `plan`'s product, its tiles ready to hand out.
    auto ready = [&](folio_decode::TeamState& state, const Plan& plan) {
      out = torch::empty({tokens, plan.rows}, hidden.options());
      folio_decode::ready_tiles(state, plan);
    };
    auto multiply = [&](Team& team, const Plan& plan, const torch::Tensor& x) {
      if (!team.failed()) {
        const float* xs = x.data_ptr<float>();
        float* ys = out.data_ptr<float>();
        int64_t column = 0;
        for (size_t p = 0; p < plan.parts.size(); ++p) {
          const folio::TiledWeight& w = plan.parts[p];
          folio_decode::TwoEndedTiles* halves = team.state.halves[p];
          folio_decode::TileTaker taker{team.size == 2 ? &halves[team.id] : nullptr, &halves[1 - team.id % 2], 0, 0};
          folio_decode::own_tiles(w.tile_count, team.id, team.size, &taker.begin, &taker.end);
          k.linear_tiles(w, xs, tokens, ys + column, plan.rows, {&folio_decode::TileTaker::next, &taker});
          column += w.rows;
        }
      }
      team.barrier();
    };
    auto biased = [&](const Plan& plan) { return plan.bias ? out + *plan.bias : out; };
    for (int64_t i = 0; i <= count; ++i) {
      const Layer* prev = i > 0 ? &layers_[i - 1] : nullptr;
      const Layer* layer = i < count ? &layers_[i] : nullptr;
      folio_decode::run_team(at::get_num_threads(), [&](Team& team) {
        auto prefetch = [&](const Plan* next) { return [&team, next] { folio_decode::prefetch_first_tiles(next, team); }; };
        if (prev != nullptr) {  // the rest of the previous layer
          team.serial([&] { ready(team.state, prev->o_plan); }, prefetch(&prev->o_plan));
          multiply(team, prev->o_plan, attended.view({tokens, prev->o_plan.cols}));
          team.serial([&] {
            h = mlp_input(*prev, biased(prev->o_plan), residual);
            ready(team.state, prev->gate_up_plan);
          }, prefetch(&prev->gate_up_plan));
          multiply(team, prev->gate_up_plan, h);
          team.serial([&] {
            act = k.activation(biased(prev->gate_up_plan), gelu_);
            ready(team.state, prev->down_plan);
          }, prefetch(&prev->down_plan));
          multiply(team, prev->down_plan, act);
          team.serial([&] {
            h = biased(prev->down_plan);
            if (sandwich_) h = k.rms_norm(h, *prev->norms.post_feedforward, eps_, offset_);
            if (layer == nullptr) return;
            h = k.add_rms_norm(h, residual, layer->norms.input, eps_, offset_);
            ready(team.state, layer->qkv_plan);
          }, prefetch(layer != nullptr ? &layer->qkv_plan : nullptr));
        } else {
          team.serial([&] {
            h = k.rms_norm(residual, layer->norms.input, eps_, offset_);
            ready(team.state, layer->qkv_plan);
          }, prefetch(&layer->qkv_plan));
        }
        if (layer == nullptr) return;
        multiply(team, layer->qkv_plan, h);
        team.serial([&] { q = queries(*layer, biased(layer->qkv_plan), rope, slots); }, prefetch(&layer->o_plan));
      });
      if (layer != nullptr) attended = attend(*layer, q, block_tables, seq_lens);
    }
    return {h, residual};
  }

  // A layer's queries [T, H, D] from its q/k/v projection's output [T, q + 2 kv]: each head normed
  // where the model norms heads, rotated; its keys (normed, rotated) and values written to its cache.
  torch::Tensor queries(const Layer& layer, const torch::Tensor& qkv, const std::vector<torch::Tensor>& rope,
                        const std::vector<torch::Tensor>& slots) const {
    const Kernels& k = kernels_;
    const int64_t tokens = qkv.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads_, head_dim_});
    torch::Tensor key = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads_, head_dim_});
    const torch::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads_, head_dim_});
    if (layer.norms.q) {  // each head's rows normed (a copy: the heads of a fused output are not evenly strided)
      q = k.rms_norm(q.reshape({tokens * heads_, head_dim_}), *layer.norms.q, eps_, offset_).view({tokens, heads_, head_dim_});
      key = k.rms_norm(key.reshape({tokens * kv_heads_, head_dim_}), *layer.norms.k, eps_, offset_)
                .view({tokens, kv_heads_, head_dim_});
    }
    const size_t table = rope.size() == 4 ? 2 * static_cast<size_t>(layer.rope) : 0;
    k.rotary(q, key, rope[table], rope[table + 1]);
    const size_t group = static_cast<size_t>(layer.kv_group);
    write_slots(layer.k_cache, slots[group], key);
    write_slots(layer.v_cache, slots[group], value);
    return q.contiguous();
  }

  // The attention of a layer's queries [T, H, D] over its cache: [T, H * D].
  torch::Tensor attend(const Layer& layer, const torch::Tensor& q, const std::vector<torch::Tensor>& block_tables,
                       const torch::Tensor& seq_lens) const {
    const size_t group = static_cast<size_t>(layer.kv_group);
    const torch::Tensor attended = kernels_.attention(q, layer.k_cache, layer.v_cache, block_tables[group], seq_lens,
                                                      block_size_, scale_, layer.window, std::nullopt, std::nullopt);
    return attended.view({q.size(0), heads_ * head_dim_});
  }

  // The MLP's normed input from the attention's projected output; the residual stream gains it.
  torch::Tensor mlp_input(const Layer& layer, const torch::Tensor& projected, torch::Tensor& residual) const {
    const Kernels& k = kernels_;
    if (!sandwich_) return k.add_rms_norm(projected, residual, layer.norms.post_attention, eps_, offset_);
    const torch::Tensor normed = k.rms_norm(projected, layer.norms.post_attention, eps_, offset_);
    return k.add_rms_norm(normed, residual, *layer.norms.pre_feedforward, eps_, offset_);
  }

  Kernels kernels_;
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_, block_size_;
  double scale_, eps_, offset_;
  bool gelu_, sandwich_;
  bool tiled_ = true;  // every layer's projections tiled: the team path can take a small step
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
      .def_property_readonly("team_steps", [](const DecodeStack& s) { return s.team_steps(); })
      .def_property_readonly("kernel_steps", [](const DecodeStack& s) { return s.kernel_steps(); })
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}
