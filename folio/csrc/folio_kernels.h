// The entry points folio's extensions publish for C++ callers in other extensions, declared once.
//
// Each extension is its own shared library, built and loaded on its own (folio/ops.py), so a kernel
// one of them calls in another is handed over as a PyCapsule: a named pointer. Every such entry is
// declared here as a struct holding its capsule name and its exact C++ type, and every extension
// includes this header:
//   - the defining extension publishes it with add_entry<Entry>(entries, &function), which compiles
//     only if the function has exactly Entry::Fn's type;
//   - a caller gets it back with entry<Entry>(entries), which refuses a missing entry or a capsule of
//     another name.
// Both sides compile against this header and every build's key covers it (folio/cpp_extension.py),
// so changing a signature breaks a build, never a call through a stale pointer.
//
// Every Python entry point of these extensions releases the GIL while it runs
// (py::call_guard<py::gil_scoped_release>): none touches a Python object, and a served engine's step
// then leaves the interpreter to the server's event loop instead of holding it for the whole step.
#pragma once

#include <torch/extension.h>

#include <cstring>
#include <optional>
#include <vector>

namespace folio {

// fused_ops.cpp: RMSNorm of rows; x [T, D], weight [D]; offset 0 (Llama) or 1 (Gemma's 1 + w).
struct RmsNorm {
  static constexpr const char* name = "folio.fused_ops.rms_norm";
  using Fn = torch::Tensor (*)(torch::Tensor x, torch::Tensor weight, double eps, double offset);
};

// fused_ops.cpp: residual += x, then RMSNorm(residual).
struct AddRmsNorm {
  static constexpr const char* name = "folio.fused_ops.add_rms_norm";
  using Fn = torch::Tensor (*)(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps,
                               double offset);
};

// fused_ops.cpp: rotate-half rotary embedding of q and k [T, H, D], in place; cos, sin [T, D].
struct Rotary {
  static constexpr const char* name = "folio.fused_ops.rotary";
  using Fn = void (*)(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
};

// fused_ops.cpp: [T, 2I] = [gate | up] -> act(gate) * up; gelu (tanh) or silu.
struct GatedActivation {
  static constexpr const char* name = "folio.fused_ops.gated_activation";
  using Fn = torch::Tensor (*)(torch::Tensor x, bool gelu);
};

// fused_ops.cpp: the float32 code of the four entries above on raw rows, on the calling thread, for a caller
// that keeps its own buffers and threads (decode_stack.cpp's teams). The tensor entries run the same
// compiled functions on float32, so either way gives the same bits.
// out[r] = RMSNorm(x[r]) for rows `x_stride` apart; out's rows contiguous (may be x itself where x_stride == dim).
struct RmsNormRows {
  static constexpr const char* name = "folio.fused_ops.rms_norm_rows";
  using Fn = void (*)(const float* x, int64_t x_stride, const float* weight, float eps, float offset, float* out,
                      int64_t rows, int64_t dim);
};

// residual[r] += x[r] (residual's rows contiguous), then out[r] = RMSNorm(residual[r]).
struct AddRmsNormRows {
  static constexpr const char* name = "folio.fused_ops.add_rms_norm_rows";
  using Fn = void (*)(const float* x, int64_t x_stride, float* residual, const float* weight, float eps, float offset,
                      float* out, int64_t rows, int64_t dim);
};

// x [T, H, D], tokens `stride` apart, heads contiguous: rotated in place by cos, sin [T, D].
struct RotaryRows {
  static constexpr const char* name = "folio.fused_ops.rotary_rows";
  using Fn = void (*)(float* x, int64_t stride, int64_t tokens, int64_t heads, int64_t dim, const float* cos,
                      const float* sin);
};

// x [T, 2I] = [gate | up], rows `stride` apart -> out [T, I] contiguous.
struct GatedActivationRows {
  static constexpr const char* name = "folio.fused_ops.gated_activation_rows";
  using Fn = void (*)(const float* x, int64_t stride, int64_t rows, int64_t width, float* out, bool gelu);
};

// fused_ops.cpp (lora_rows.h): out [T, N] += x [T, in] @ A[slot].T @ B[slot] (per part) for each row whose
// slot is not -1; a [S, W, in], b [S, R, N]; parts: each part's (first row, rows), flattened.
struct LoraAdd {
  static constexpr const char* name = "folio.fused_ops.lora_add";
  using Fn = void (*)(torch::Tensor x, torch::Tensor out, torch::Tensor a, torch::Tensor b, torch::Tensor slots,
                      std::vector<int64_t> parts);
};

// int8_dot.cpp: x [M, K] @ W^T for a 4-bit weight in tiles of 16 rows (5-bit: with its fifth bits, else
// high_bits empty); N output rows; exact: activations in 8 + 8 bits, else 8.
struct Int4Linear {
  static constexpr const char* name = "folio.int8_dot.int4_linear";
  using Fn = torch::Tensor (*)(torch::Tensor x, torch::Tensor tiles, torch::Tensor high_bits, torch::Tensor scales,
                               torch::Tensor mins, int64_t group, int64_t rows, bool exact);
};

// int8_dot.cpp: x [M, K] @ W^T for an 8-bit weight in groups and tiles of 16 rows; N output rows.
struct Int8Linear {
  static constexpr const char* name = "folio.int8_dot.int8_linear";
  using Fn = torch::Tensor (*)(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales, int64_t group,
                               int64_t rows, bool exact);
};

// A 4-, 5- or 8-bit weight in int8_dot.cpp's tiles of 16 rows, as raw memory: for a caller that runs
// its own threads (decode_stack.cpp) and hands out the tiles itself. Made by TiledWeightOf, so the
// layout (and each tile's bytes in every array, for prefetching) is known in int8_dot.cpp alone.
struct TiledWeight {
  int bits;                  // 4, 5 (4-bit tiles and their fifth bits) or 8
  const uint8_t* tiles;      // uint8 [tile_count, code_bytes]
  const uint8_t* high_bits;  // 5-bit: [tile_count, fifth_bytes]; else null
  const void* scales;        // [tile_count, K / group, 16]: float16 (4/5-bit, or 8-bit where half_scales), else float32
  bool half_scales;
  const at::Half* mins;      // 4/5-bit: float16, as scales; else null
  int64_t group, rows, cols; // group size, N, K
  bool exact;                // activations in 8 + 8 bits, else 8
  int64_t tile_count, code_bytes, fifth_bytes, scale_bytes, min_bytes;  // tiles, and each tile's bytes per array
};

// int8_dot.cpp: the TiledWeight of a 4/5-bit (mins given) or 8-bit (mins null) weight's tensors, after
// the checks int4_linear and int8_linear run on them (which throw where they refuse it).
struct TiledWeightOf {
  static constexpr const char* name = "folio.int8_dot.tiled_weight_of";
  using Fn = TiledWeight (*)(const torch::Tensor& tiles, const torch::Tensor& high_bits, const torch::Tensor& scales,
                             const torch::Tensor* mins, int64_t group, int64_t rows, bool exact);
};

// Where a thread takes its next tiles from: next(state, &begin, &end) is false once none are left.
struct TileSource {
  bool (*next)(void* state, int64_t* begin, int64_t* end);
  void* state;
};

// int8_dot.cpp: y[:, 16 * tile ...] = x @ W^T for the tiles `source` hands this thread, on this thread
// only (no parallel region of its own): float32 x [M, K] contiguous, y rows ldy floats apart. Each
// caller quantizes x itself, as int4_linear and int8_linear do, so every row's sums are theirs exactly.
struct LinearTiles {
  static constexpr const char* name = "folio.int8_dot.linear_tiles";
  using Fn = void (*)(const TiledWeight& weight, const float* x, int64_t M, float* y, int64_t ldy,
                      const TileSource& source);
};

// q8_linear.cpp: float32 x [M, K] @ W^T for int8 codes [N, K] with float32 scales per group.
struct Q8Linear {
  static constexpr const char* name = "folio.q8_linear.q8_linear";
  using Fn = torch::Tensor (*)(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t group);
};

// nf4_linear.cpp: float32 x [M, K] @ W^T for NF4 codes with double-quantized block absmax.
struct Nf4Linear {
  static constexpr const char* name = "folio.nf4_linear.nf4_linear";
  using Fn = torch::Tensor (*)(torch::Tensor x, torch::Tensor codes, torch::Tensor absmax_codes,
                               torch::Tensor absmax_scales, double offset, torch::Tensor codebook);
};

// paged_decode.cpp: attention of single-token queries [N, H, D] over paged K/V caches.
struct PagedDecodeAttention {
  static constexpr const char* name = "folio.paged_decode.paged_decode_attention";
  using Fn = torch::Tensor (*)(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size, double scale,
                               int64_t window, std::optional<torch::Tensor> k_scales,
                               std::optional<torch::Tensor> v_scales);
};

// Publishes `fn` under Entry's name in `entries` (an extension's `entries` attribute).
template <typename Entry>
void add_entry(py::dict& entries, typename Entry::Fn fn) {
  entries[Entry::name] = py::capsule(reinterpret_cast<void*>(fn), Entry::name);
}

// Entry's function from `entries` (the merged `entries` of the extensions that define them).
template <typename Entry>
typename Entry::Fn entry(const py::dict& entries) {
  TORCH_CHECK(entries.contains(Entry::name), "no kernel entry point ", Entry::name,
              " (the extension that defines it was not passed in)");
  const py::object value = entries[Entry::name];
  PyObject* capsule = value.ptr();
  TORCH_CHECK(PyCapsule_CheckExact(capsule), "kernel entry point ", Entry::name, " is not a capsule");
  const char* found = PyCapsule_GetName(capsule);
  TORCH_CHECK(found != nullptr && std::strcmp(found, Entry::name) == 0, "kernel entry point ", Entry::name,
              ": refused a capsule named ", found ? found : "(none)");
  void* pointer = PyCapsule_GetPointer(capsule, Entry::name);
  if (pointer == nullptr) throw py::error_already_set();
  return reinterpret_cast<typename Entry::Fn>(pointer);
}

}  // namespace folio
