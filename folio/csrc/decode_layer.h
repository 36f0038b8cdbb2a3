// The pieces of a decode stack's layer (decode_stack.cpp): the kernels it calls, its projections in
// whatever format they are kept, its norms, and the KV cache its keys and values go to.
#pragma once

#include <torch/extension.h>

#include <cstring>
#include <optional>
#include <vector>

#include "decode_plan.h"
#include "folio_kernels.h"

namespace folio_decode {

// The kernels a step calls, from the merged `entries` of the fused_ops, int8_dot and paged_decode
// extensions. The *_rows ones are the float32 code of rms_norm, add_rms_norm, rotary and activation on
// raw rows, for the team path's own buffers.
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
  folio::RmsNormRows::Fn rms_norm_rows;
  folio::AddRmsNormRows::Fn add_rms_norm_rows;
  folio::RotaryRows::Fn rotary_rows;
  folio::GatedActivationRows::Fn activation_rows;
  folio::LoraAdd::Fn lora_add;

  static Kernels from(const py::dict& entries) {
    using namespace folio;
    return {entry<Int4Linear>(entries),   entry<Int8Linear>(entries),      entry<PagedDecodeAttention>(entries),
            entry<RmsNorm>(entries),      entry<AddRmsNorm>(entries),      entry<Rotary>(entries),
            entry<GatedActivation>(entries), entry<LinearTiles>(entries),  entry<TiledWeightOf>(entries),
            entry<RmsNormRows>(entries),  entry<AddRmsNormRows>(entries),  entry<RotaryRows>(entries),
            entry<GatedActivationRows>(entries), entry<LoraAdd>(entries)};
  }
};

// LoRA adapters' slots on a projection (folio/layers/lora.py's LoRASlots: a [S, W, in], b [S, R, N], each
// part's first row and rows, flattened), added to the rows a step's slots name (lora_rows.h).
struct LoraSlots {
  torch::Tensor a, b;
  std::vector<int64_t> parts;
};

// A projection: a dense weight [N, K], 4-bit (or 5-bit) or 8-bit tiles (int8_dot.cpp's layouts) with N
// rows, or row blocks of those (`parts`, e.g. a fused q/k/v whose v is in another format), outputs joined.
// With `lora` and a step's row slots, each adapter row gains its adapter's low-rank product.
struct Projection {
  enum class Kind { kDense, kInt4, kInt8, kRowBlocks };
  Kind kind;
  torch::Tensor weight;  // dense: the weight; else the tiles
  std::optional<torch::Tensor> scales, mins, bias;
  int64_t group = 0, rows = 0;
  bool exact = true;  // activations in 8 + 8 bits into the dot products, else 8 (int8_activations.h)
  torch::Tensor high_bits = torch::empty({0}, torch::kUInt8);  // 5-bit codes' fifth bits (int8_tiles.h)
  std::vector<Projection> parts;
  std::optional<LoraSlots> lora;

  torch::Tensor operator()(const Kernels& k, const torch::Tensor& x, const std::optional<torch::Tensor>& slots) const {
    torch::Tensor out = (*this)(k, x);
    if (lora && slots) k.lora_add(x, out, lora->a, lora->b, *slots, lora->parts);
    return out;
  }

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
inline Plan plan_of(const Projection& projection, folio::TiledWeightOf::Fn tiled_weight_of) {
  Plan plan;
  plan.bias = projection.bias;
  const bool joined = projection.kind == Projection::Kind::kRowBlocks;
  const Projection* parts = joined ? projection.parts.data() : &projection;
  const size_t count = joined ? projection.parts.size() : 1;
  if (count > static_cast<size_t>(folio_decode::TeamState::kMaxParts)) return plan;
  for (size_t p = 0; p < count; ++p) {
    const Projection& part = parts[p];
    const bool part_bias = joined && part.bias;  // a single projection's bias is the plan's own
    if (part_bias || (part.kind != Projection::Kind::kInt4 && part.kind != Projection::Kind::kInt8)) return plan;
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

// Token t's row (`bytes` long, rows `stride` bytes apart) into slot[t] of a contiguous cache of such rows.
inline void copy_to_slots(void* cache, int64_t bytes, const int64_t* slot, const void* rows, int64_t stride,
                          int64_t tokens) {
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(static_cast<char*>(cache) + slot[t] * bytes, static_cast<const char*>(rows) + t * stride, bytes);
}

// rows [T, kv_heads, head_dim] (a view into the fused qkv output: each token's heads side by side) into
// the cache's slots, one copy a token. index_copy_ builds a TensorIterator per call, twice a layer; at one
// token that set-up is most of its cost. A cache this cannot address (not contiguous) takes index_copy_.
inline void write_slots(const torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& rows) {
  const int64_t tokens = rows.size(0), width = rows.size(1) * rows.size(2);
  const bool direct = cache.is_contiguous() && cache.scalar_type() == rows.scalar_type() && cache.dim() == 3 &&
                      cache.size(1) * cache.size(2) == width && rows.stride(2) == 1 && rows.stride(1) == rows.size(2) &&
                      slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == tokens;
  if (!direct) {
    cache.index_copy_(0, slots, rows);
    return;
  }
  const int64_t capacity = cache.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " outside the KV cache's ", capacity);
  copy_to_slots(cache.data_ptr(), width * rows.element_size(), slot, rows.data_ptr(),
                rows.stride(0) * rows.element_size(), tokens);
}

// What every layer of a stack shares: its attention's heads and the norms' and activation's settings.
struct StackShape {
  int64_t heads, kv_heads, head_dim, block_size;
  double scale, eps, offset;  // the attention's scale; the norms' epsilon and weight offset (Gemma: 1)
  bool gelu, sandwich;        // GeGLU rather than SwiGLU; Gemma 3's four norms a layer
};

struct Layer {
  Norms norms;
  Projection qkv, o, gate_up, down;
  Plan qkv_plan, o_plan, gate_up_plan, down_plan;
  torch::Tensor k_cache, v_cache;
  int64_t window;
  int64_t rope;      // which of forward's RoPE tables: 0, or 1 for Gemma's local layers
  int64_t kv_group;  // whose slots and block tables it reads (one table per KV cache group)
};

}  // namespace folio_decode
