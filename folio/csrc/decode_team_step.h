// A small decode step (decode_stack.cpp) in teams (decode_team.h): one parallel region from each layer's
// attention output to the next layer's queries, the attention between them in its own (it spreads its
// heads and key chunks over the threads).
//
// The work between projections runs on thread 0 while the others prefetch. At batch 1 it is a few
// hundred floats at a time, so what it cost was the tensors around it: ~150 stretches a step at ~8 us
// each, in allocations, views and the tensor entries' checks. Here it is raw loops over buffers the step
// allocates once: the float32 code of the norm, rotary and activation entries (folio_kernels.h's *Rows,
// the same compiled functions the tensor entries run), and the dot products' tiles. Each value is
// computed by the same code, in the same order, as the kernel-by-kernel path: the results are its bits.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <vector>

#include "decode_layer.h"
#include "decode_team.h"

namespace folio_decode {

// Whether every layer's tensors are what the team's raw loops read: float32 and contiguous norm weights,
// biases and K/V caches ([slots, kv_heads, head_dim]), of the shape's widths.
inline bool team_can_run(const Layer& layer, const StackShape& shape) {
  auto is_floats = [](const torch::Tensor& t, int64_t numel) {
    return t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == numel;
  };
  const Norms& norms = layer.norms;
  const int64_t hidden = layer.o_plan.rows, kv = shape.kv_heads * shape.head_dim;
  bool ok = is_floats(norms.input, hidden) && is_floats(norms.post_attention, hidden);
  for (const auto* norm : {&norms.pre_feedforward, &norms.post_feedforward})
    ok = ok && (!*norm || is_floats(**norm, hidden));
  for (const auto* norm : {&norms.q, &norms.k}) ok = ok && (!*norm || is_floats(**norm, shape.head_dim));
  for (const Plan* plan : {&layer.qkv_plan, &layer.o_plan, &layer.gate_up_plan, &layer.down_plan})
    ok = ok && (!plan->bias || is_floats(*plan->bias, plan->rows));
  for (const torch::Tensor* cache : {&layer.k_cache, &layer.v_cache})
    ok = ok && cache->scalar_type() == torch::kFloat32 && cache->is_contiguous() && cache->dim() == 3 &&
         cache->size(1) * cache->size(2) == kv;
  return ok;
}

class TeamStep {
 public:
  TeamStep(const Kernels& kernels, const StackShape& shape, const std::vector<Layer>& layers, int64_t widest_mlp)
      : k_(kernels), shape_(shape), layers_(layers), widest_mlp_(widest_mlp) {}

  // As DecodeStack.forward, for hidden [T, D] float32 contiguous, T at most a few tokens, rope tables and
  // slots as the team's loops read them (DecodeStack checks all that first); every slot is checked here
  // against every cache it is written to before anything is computed.
  std::vector<torch::Tensor> operator()(torch::Tensor hidden, const std::vector<torch::Tensor>& rope,
                                        const std::vector<torch::Tensor>& slots,
                                        const std::vector<torch::Tensor>& block_tables,
                                        const torch::Tensor& seq_lens) {
    tokens_ = hidden.size(0);
    for (const Layer& layer : layers_) {
      const int64_t* slot = slots[static_cast<size_t>(layer.kv_group)].data_ptr<int64_t>();
      const int64_t capacity = std::min(layer.k_cache.size(0), layer.v_cache.size(0));
      for (int64_t t = 0; t < tokens_; ++t)
        TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " outside the KV cache's ", capacity);
    }
    allocate(hidden);
    residual_ = hidden.data_ptr<float>();
    const int64_t count = static_cast<int64_t>(layers_.size());
    const float* out = nullptr;  // the last layer's output
    torch::Tensor attended;      // a layer's attention output [T, H * D]
    for (int64_t i = 0; i <= count; ++i) {
      const Layer* prev = i > 0 ? &layers_[i - 1] : nullptr;
      const Layer* layer = i < count ? &layers_[i] : nullptr;
      run_team(at::get_num_threads(), [&](Team& team) {
        auto prefetch = [&](const Plan* next) { return [&team, next] { prefetch_first_tiles(next, team); }; };
        if (prev != nullptr) {  // the rest of the previous layer
          team.serial([&] { ready_tiles(team.state, prev->o_plan); }, prefetch(&prev->o_plan));
          multiply(team, prev->o_plan, attended.data_ptr<float>(), projected_);
          team.serial([&] {
            add_bias(prev->o_plan, projected_);
            mlp_input(*prev);
            ready_tiles(team.state, prev->gate_up_plan);
          }, prefetch(&prev->gate_up_plan));
          multiply(team, prev->gate_up_plan, normed_, gate_up_);
          team.serial([&] {
            add_bias(prev->gate_up_plan, gate_up_);
            k_.activation_rows(gate_up_, prev->gate_up_plan.rows, tokens_, prev->down_plan.cols, activated_, shape_.gelu);
            ready_tiles(team.state, prev->down_plan);
          }, prefetch(&prev->down_plan));
          multiply(team, prev->down_plan, activated_, down_);
          team.serial([&] {
            add_bias(prev->down_plan, down_);
            out = down_;
            if (shape_.sandwich) norm(down_, *prev->norms.post_feedforward, sandwiched_), out = sandwiched_;
            if (layer == nullptr) return;
            add_norm(out, layer->norms.input, normed_);
            ready_tiles(team.state, layer->qkv_plan);
          }, prefetch(layer != nullptr ? &layer->qkv_plan : nullptr));
        } else {
          team.serial([&] {
            norm(residual_, layer->norms.input, normed_);
            ready_tiles(team.state, layer->qkv_plan);
          }, prefetch(&layer->qkv_plan));
        }
        if (layer == nullptr) return;
        multiply(team, layer->qkv_plan, normed_, qkv_);
        team.serial([&] { queries(*layer, rope, slots); }, prefetch(&layer->o_plan));
      });
      if (layer == nullptr) break;
      const size_t group = static_cast<size_t>(layer->kv_group);
      attended = k_.attention(queries_, layer->k_cache, layer->v_cache, block_tables[group], seq_lens,
                              shape_.block_size, shape_.scale, layer->window, std::nullopt, std::nullopt);
      TORCH_CHECK(attended.is_contiguous() && attended.scalar_type() == torch::kFloat32, "attention: float32 rows");
    }
    const int64_t width = layers_.back().down_plan.rows;
    return {memory_.narrow(0, (out - memory_.data_ptr<float>()), tokens_ * width).view({tokens_, width}), hidden};
  }

 private:
  // The step's buffers, in one allocation.
  void allocate(const torch::Tensor& hidden) {
    const int64_t width = hidden.size(1), q = shape_.heads * shape_.head_dim, kv = shape_.kv_heads * shape_.head_dim;
    const int64_t widths[] = {width, width, q + 2 * kv, q, kv, width, widest_mlp_, widest_mlp_ / 2, width};
    int64_t total = 0;
    for (int64_t w : widths) total += tokens_ * w;
    memory_ = torch::empty({total}, hidden.options());
    float* at = memory_.data_ptr<float>();
    float** buffers[] = {&normed_, &sandwiched_, &qkv_, &q_, &keys_, &projected_, &gate_up_, &activated_, &down_};
    for (size_t b = 0; b < std::size(buffers); ++b) *buffers[b] = at, at += tokens_ * widths[b];
    queries_ = memory_.narrow(0, q_ - memory_.data_ptr<float>(), tokens_ * q).view({tokens_, shape_.heads, shape_.head_dim});
  }

  // y = x @ W^T for `plan`, its tiles handed out to the team (ready_tiles first); y's rows plan.rows apart.
  void multiply(Team& team, const Plan& plan, const float* x, float* y) const {
    if (!team.failed()) {
      int64_t column = 0;
      for (size_t p = 0; p < plan.parts.size(); ++p) {
        const folio::TiledWeight& w = plan.parts[p];
        TwoEndedTiles* halves = team.state.halves[p];
        TileTaker taker{team.size == 2 ? &halves[team.id] : nullptr, &halves[1 - team.id % 2], 0, 0};
        own_tiles(w.tile_count, team.id, team.size, &taker.begin, &taker.end);
        k_.linear_tiles(w, x, tokens_, y + column, plan.rows, {&TileTaker::next, &taker});
        column += w.rows;
      }
    }
    team.barrier();
  }

  void add_bias(const Plan& plan, float* y) const {
    if (!plan.bias) return;
    const float* bias = plan.bias->data_ptr<float>();
    for (int64_t t = 0; t < tokens_; ++t)
      for (int64_t j = 0; j < plan.rows; ++j) y[t * plan.rows + j] += bias[j];
  }

  void norm(const float* x, const torch::Tensor& weight, float* out) const {
    const int64_t width = weight.numel();
    k_.rms_norm_rows(x, width, weight.data_ptr<float>(), static_cast<float>(shape_.eps),
                     static_cast<float>(shape_.offset), out, tokens_, width);
  }
  // The residual stream gains x, then out = its norm.
  void add_norm(const float* x, const torch::Tensor& weight, float* out) const {
    const int64_t width = weight.numel();
    k_.add_rms_norm_rows(x, width, residual_, weight.data_ptr<float>(), static_cast<float>(shape_.eps),
                         static_cast<float>(shape_.offset), out, tokens_, width);
  }

  // The MLP's normed input (normed_) from the attention's projected output, which the residual stream gains.
  void mlp_input(const Layer& layer) const {
    if (!shape_.sandwich) return add_norm(projected_, layer.norms.post_attention, normed_);
    norm(projected_, layer.norms.post_attention, sandwiched_);
    add_norm(sandwiched_, *layer.norms.pre_feedforward, normed_);
  }

  // The layer's queries (queries_, [T, H, D]) from its q/k/v output: heads normed where the model norms
  // them, rotated; its keys (normed, rotated) and values written to its cache's slots.
  void queries(const Layer& layer, const std::vector<torch::Tensor>& rope, const std::vector<torch::Tensor>& slots) {
    add_bias(layer.qkv_plan, qkv_);
    const int64_t dim = shape_.head_dim, q = shape_.heads * dim, kv = shape_.kv_heads * dim, row = q + 2 * kv;
    const float eps = static_cast<float>(shape_.eps), offset = static_cast<float>(shape_.offset);
    float* keys = qkv_ + q;  // rotated where they are, unless normed into keys_
    int64_t key_stride = row;
    if (layer.norms.q) {
      for (int64_t t = 0; t < tokens_; ++t) {
        k_.rms_norm_rows(qkv_ + t * row, dim, layer.norms.q->data_ptr<float>(), eps, offset, q_ + t * q, shape_.heads, dim);
        k_.rms_norm_rows(qkv_ + t * row + q, dim, layer.norms.k->data_ptr<float>(), eps, offset, keys_ + t * kv,
                         shape_.kv_heads, dim);
      }
      keys = keys_, key_stride = kv;
    } else {
      for (int64_t t = 0; t < tokens_; ++t) std::memcpy(q_ + t * q, qkv_ + t * row, q * sizeof(float));
    }
    const size_t table = rope.size() == 4 ? 2 * static_cast<size_t>(layer.rope) : 0;
    const float* cos = rope[table].data_ptr<float>();
    const float* sin = rope[table + 1].data_ptr<float>();
    k_.rotary_rows(q_, q, tokens_, shape_.heads, dim, cos, sin);
    k_.rotary_rows(keys, key_stride, tokens_, shape_.kv_heads, dim, cos, sin);
    const int64_t* slot = slots[static_cast<size_t>(layer.kv_group)].data_ptr<int64_t>();
    const int64_t bytes = kv * static_cast<int64_t>(sizeof(float));
    copy_to_slots(layer.k_cache.data_ptr(), bytes, slot, keys, key_stride * static_cast<int64_t>(sizeof(float)), tokens_);
    copy_to_slots(layer.v_cache.data_ptr(), bytes, slot, qkv_ + q + kv, row * static_cast<int64_t>(sizeof(float)), tokens_);
  }

  const Kernels& k_;
  const StackShape& shape_;
  const std::vector<Layer>& layers_;
  const int64_t widest_mlp_;  // the widest gate/up output of any layer
  int64_t tokens_ = 0;
  float* residual_ = nullptr;  // the residual stream: the step's hidden states, in place
  torch::Tensor memory_, queries_;
  // [T, width] each: a norm's output (the projections' input), Gemma's extra norms' outputs, the q/k/v
  // projection's output, the queries, the normed keys, the attention's projection, gate/up, activation, down.
  float *normed_ = nullptr, *sandwiched_ = nullptr, *qkv_ = nullptr, *q_ = nullptr, *keys_ = nullptr,
        *projected_ = nullptr, *gate_up_ = nullptr, *activated_ = nullptr, *down_ = nullptr;
};

}  // namespace folio_decode
