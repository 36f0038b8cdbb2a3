// LoRA rows of a step, several adapters in one call (Punica's gathered matmul on a CPU): each token row
// t whose slot s is not -1 gains x[t] @ A[s].T @ B[s].T, its own adapter's low-rank product.
//
// A [S, W, in] and B [S, R, N] are folio/layers/lora.py's LoRASlots: W = parts * R columns of A, part p of
// the output rows reading only its own R of them, and B transposed, each part's B in its own rows'
// columns. Rows are grouped by slot so each adapter's matrices are read once a step, however many rows
// use it, and both products run as one parallel region each over every (group, column) and
// (group, output row) pair: a step of 16 rows with 16 adapters costs two parallel regions, not 32
// matmuls. Arithmetic is float32; each output element is rounded to the tensor's dtype once.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace folio_lora {

// Eight floats at a time in GCC/Clang vector types: the products below keep their sums in registers,
// which the compilers do not manage on their own for these loops (measured: 2-3x slower).
typedef float Floats __attribute__((vector_size(32)));
typedef uint16_t Halves __attribute__((vector_size(16)));
typedef uint32_t Words __attribute__((vector_size(32)));

inline Floats load8(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Floats load8(const at::BFloat16* p) {  // bfloat16 is float32's high half
  Halves raw;
  std::memcpy(&raw, p, sizeof raw);
  const Words wide = __builtin_convertvector(raw, Words) << 16;
  Floats v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}
inline float total(Floats v) {
  float sum = 0.f;
  for (int i = 0; i < 8; ++i) sum += v[i];
  return sum;
}

// a . x over n, in float32.
template <typename W, typename T>
inline float dot(const W* a, const T* x, int64_t n) {
  Floats s{}, t{};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s += load8(a + i) * load8(x + i);
    t += load8(a + i + 8) * load8(x + i + 8);
  }
  float sum = total(s + t);
  for (; i < n; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(x[i]);
  return sum;
}

// Four rows' dot products with one row a: a read once, eight independent sums so the FMAs overlap.
template <typename W, typename T>
inline void dot4(const W* a, const T* const x[4], int64_t n, float* sums) {
  Floats s[4] = {}, t[4] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const Floats v = load8(a + i), w = load8(a + i + 8);
    for (int j = 0; j < 4; ++j) {
      s[j] += v * load8(x[j] + i);
      t[j] += w * load8(x[j] + i + 8);
    }
  }
  for (int j = 0; j < 4; ++j) {
    sums[j] = total(s[j] + t[j]);
    for (int64_t k = i; k < n; ++k) sums[j] += static_cast<float>(a[k]) * static_cast<float>(x[j][k]);
  }
}

// Output rows an expand item adds to at once: eight registers of sums.
constexpr int64_t kChunkRows = 64;

inline void store8(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }
inline void store8(at::BFloat16* p, Floats v) {  // rounded to nearest even, as a cast rounds
  for (int i = 0; i < 8; ++i) p[i] = static_cast<at::BFloat16>(v[i]);
}

// o[0 .. rows) += sum over r < rank of c[r] * b[r * stride + ...], in float32, each output rounded once.
// A full chunk (rows == kChunkRows) keeps its sums in registers; a part's tail takes the scalar loop.
// (No arrays of sums: GCC turns their copies from and to o into calls of memcpy, a fifth of the time.)
template <typename W, typename T>
inline void expand(const float* c, const W* b, int64_t stride, int64_t rank, T* o, int64_t rows) {
  if (rows == kChunkRows) {
    Floats acc[kChunkRows / 8];
    for (int j = 0; j < kChunkRows / 8; ++j) acc[j] = load8(o + 8 * j);
    for (int64_t r = 0; r < rank; ++r) {
      const float cr = c[r];
      const W* row = b + r * stride;
      __builtin_prefetch(row + 4 * kChunkRows);  // this row's chunk four items on: rank streams at once
      __builtin_prefetch(row + 4 * kChunkRows + 64 / sizeof(W));
      for (int j = 0; j < kChunkRows / 8; ++j) acc[j] += cr * load8(row + 8 * j);
    }
    for (int j = 0; j < kChunkRows / 8; ++j) store8(o + 8 * j, acc[j]);
    return;
  }
  for (int64_t j = 0; j < rows; ++j) {
    float sum = static_cast<float>(o[j]);
    for (int64_t r = 0; r < rank; ++r) sum += c[r] * static_cast<float>(b[r * stride + j]);
    o[j] = static_cast<T>(sum);
  }
}

// The rows of each slot in use, grouped: order[first[g] .. first[g + 1]) are group g's rows, of slot slot[g].
struct Groups {
  std::vector<int64_t> order, first, slot;

  Groups(const int64_t* slots, int64_t tokens, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "lora_add: slot ", slots[t], " outside [-1, ", num_slots, ")");
    for (int64_t t = 0; t < tokens; ++t)
      if (slots[t] >= 0) order.push_back(t);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return slots[x] < slots[y]; });
    for (size_t i = 0; i < order.size(); ++i)
      if (i == 0 || slots[order[i]] != slots[order[i - 1]]) {
        first.push_back(static_cast<int64_t>(i));
        slot.push_back(slots[order[i]]);
      }
    first.push_back(static_cast<int64_t>(order.size()));
  }
  int64_t count() const { return static_cast<int64_t>(slot.size()); }
};

template <typename T, typename W>
void add_rows(const T* x, int64_t x_stride, T* out, int64_t out_stride, const W* a, const W* b, int64_t b_slot_stride,
              int64_t b_row_stride, const Groups& groups, int64_t in, int64_t width, int64_t rank,
              const std::vector<int64_t>& parts) {
  const int64_t count = groups.count(), picked = static_cast<int64_t>(groups.order.size());
  if (count == 0) return;
  // shrunk[i * width + c] = x[order[i]] . A[slot][c]: each A row is read once for all of its group's rows.
  std::vector<float> shrunk(static_cast<size_t>(picked * width));
  const int64_t shrink_grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, in * picked / count));
  at::parallel_for(0, count * width, shrink_grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / width, c = item % width;
      const W* a_row = a + (groups.slot[g] * width + c) * in;
      const int64_t last = groups.first[g + 1];
      const auto row = [&](int64_t i) { return x + groups.order[i] * x_stride; };
      int64_t i = groups.first[g];
      for (float sums[4]; i + 4 <= last; i += 4) {
        const T* const rows4[4] = {row(i), row(i + 1), row(i + 2), row(i + 3)};
        dot4(a_row, rows4, in, sums);
        for (int64_t j = 0; j < 4; ++j) shrunk[(i + j) * width + c] = sums[j];
      }
      for (; i < last; ++i) shrunk[i * width + c] = dot(a_row, row(i), in);
    }
  });
  // out[t][row] += shrunk[t][part's R columns] @ B[slot][:, row], over chunks of output rows within one part:
  // an axpy a rank column, vectorized along the rows, in float32, each output rounded once.
  struct Chunk {
    int64_t part, first, rows;
  };
  std::vector<Chunk> chunks;
  for (int64_t p = 0; p < static_cast<int64_t>(parts.size() / 2); ++p)
    for (int64_t row = parts[2 * p]; row < parts[2 * p] + parts[2 * p + 1]; row += kChunkRows)
      chunks.push_back({p, row, std::min(kChunkRows, parts[2 * p] + parts[2 * p + 1] - row)});
  const int64_t chunk_count = static_cast<int64_t>(chunks.size());
  const int64_t expand_grain = std::max<int64_t>(1, 64 / std::max<int64_t>(1, rank * picked / count));
  at::parallel_for(0, count * chunk_count, expand_grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / chunk_count;
      const Chunk& chunk = chunks[static_cast<size_t>(item % chunk_count)];
      const W* b_rows = b + groups.slot[g] * b_slot_stride + chunk.first;
      for (int64_t i = groups.first[g]; i < groups.first[g + 1]; ++i) {
        T* o = out + groups.order[i] * out_stride + chunk.first;
        const float* coefficients = shrunk.data() + i * width + chunk.part * rank;
        expand(coefficients, b_rows, b_row_stride, rank, o, chunk.rows);
      }
    }
  });
}

// out [T, N] += each adapter row's x [T, in] @ A[slot].T @ B[slot] (per part), in place. parts: each
// part's first output row and rows, flattened ([first0, rows0, first1, rows1, ...]); W = parts * R.
inline void lora_add(torch::Tensor x, torch::Tensor out, torch::Tensor a, torch::Tensor b, torch::Tensor slots,
                     std::vector<int64_t> parts) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && b.dim() == 3, "lora_add: x, out [T, *]; a, b [S, *, *]");
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && a.device().is_cpu() && b.device().is_cpu(), "lora_add: CPU tensors");
  const auto dtype = x.scalar_type(), weights = a.scalar_type();
  const auto floating = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; };
  TORCH_CHECK(floating(dtype) && out.scalar_type() == dtype, "lora_add: x and out float32 or bfloat16, alike");
  TORCH_CHECK(floating(weights) && b.scalar_type() == weights, "lora_add: a and b float32 or bfloat16, alike");
  TORCH_CHECK(a.is_contiguous() && b.stride(2) == 1, "lora_add: a contiguous, b's rows contiguous");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "lora_add: rows of x and out contiguous");
  const int64_t tokens = x.size(0), in = x.size(1), num_slots = a.size(0), width = a.size(1), n = b.size(2);
  TORCH_CHECK(!parts.empty() && parts.size() % 2 == 0, "lora_add: parts are (first row, rows) pairs");
  const int64_t rank = width / static_cast<int64_t>(parts.size() / 2);
  TORCH_CHECK(out.size(0) == tokens && out.size(1) == n && a.size(2) == in && b.size(0) == num_slots &&
              b.size(1) == rank && width == rank * static_cast<int64_t>(parts.size() / 2),
              "lora_add: shapes do not match");
  for (size_t p = 0; p < parts.size(); p += 2)
    TORCH_CHECK(parts[p] >= 0 && parts[p + 1] >= 0 && parts[p] + parts[p + 1] <= n, "lora_add: a part outside N");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "lora_add: slots [T] int64");
  const Groups groups(slots.data_ptr<int64_t>(), tokens, num_slots);
  const auto run = [&](auto* x_data, auto* out_data, auto* a_data, auto* b_data) {
    add_rows(x_data, x.stride(0), out_data, out.stride(0), a_data, b_data, b.stride(0), b.stride(1), groups, in, width,
             rank, parts);
  };
  const auto with_weights = [&](auto* x_data, auto* out_data) {
    if (weights == at::kFloat)
      run(x_data, out_data, a.data_ptr<float>(), b.data_ptr<float>());
    else
      run(x_data, out_data, a.data_ptr<at::BFloat16>(), b.data_ptr<at::BFloat16>());
  };
  if (dtype == at::kFloat)
    with_weights(x.data_ptr<float>(), out.data_ptr<float>());
  else
    with_weights(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
}

}  // namespace folio_lora
