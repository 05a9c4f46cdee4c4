// Linear layers for decode steps of a few rows, on weights packed for them.
//
// Why: a decode step of one sequence streams every weight from memory once,
// and ATen's bf16 matrix kernel reaches ~11 GB/s on such a step here (M = 1
// is a matrix-vector product; its blocking is for large M). Packed so that
// one 64-byte load holds 16 output rows x 2 inputs, the weights stream
// front to back and each load feeds one bf16 dot-product instruction
// (AVX512-BF16 `vdpbf16ps`), with no horizontal sums: ~30 GB/s on the same
// 2-core Xeon.
//
// Layout (carpool/model/packed_linear.py `pack_weight`): [out / 16][in / 2][16][2] bf16, i.e. group g
// of 16 output rows is a contiguous [in / 2][16][2] slab.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "packed_block.h"

namespace {

using namespace carpool::packed;

template <int M, int G>
inline void block_to_output(const uint16_t* w, const uint32_t* x, int64_t x_pairs,
                            int64_t pairs, int64_t g, const uint16_t* bias, uint16_t* y,
                            int64_t out) {
  alignas(64) float acc[M * G * 16];
  block<M, G>(w, x, x_pairs, pairs, g, acc);
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < G; ++j)
      for (int r = 0; r < 16; ++r) {
        const int64_t col = (g + j) * 16 + r;
        float v = acc[(m * G + j) * 16 + r];
        if (bias != nullptr) v += bf16_to_float(bias[col]);
        y[m * out + col] = float_to_bf16(v);
      }
}

template <int G>
inline void rows_block(const uint16_t* w, const uint32_t* x, int64_t rows, int64_t pairs,
                       int64_t g, const uint16_t* bias, uint16_t* y, int64_t out) {
  // Rows in chunks of kMaxRows over one block of groups: the block's
  // weights (G x 16 rows x in) stay in L2 between chunks.
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    const uint32_t* xr = x + r * pairs;
    uint16_t* yr = y + r * out;
    switch (std::min<int64_t>(kMaxRows, rows - r)) {
      case 1: block_to_output<1, G>(w, xr, pairs, pairs, g, bias, yr, out); break;
      case 2: block_to_output<2, G>(w, xr, pairs, pairs, g, bias, yr, out); break;
      case 3: block_to_output<3, G>(w, xr, pairs, pairs, g, bias, yr, out); break;
      default: block_to_output<4, G>(w, xr, pairs, pairs, g, bias, yr, out); break;
    }
  }
}

void groups_range(const uint16_t* w, const uint32_t* x, int64_t rows, int64_t pairs,
                  int64_t begin, int64_t end, const uint16_t* bias, uint16_t* y, int64_t out) {
  int64_t g = begin;
  for (; g + 4 <= end; g += 4) rows_block<4>(w, x, rows, pairs, g, bias, y, out);
  for (; g < end; ++g) rows_block<1>(w, x, rows, pairs, g, bias, y, out);
}

}  // namespace

// x [rows, in] bf16 times a packed [out, in] weight (+ bias [out]) -> [rows, out] bf16.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.scalar_type() == at::kBFloat16, "expected bf16 x [rows, in] and a packed weight");
  const int64_t rows = x.size(0), in = x.size(1), groups = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(rows >= 1, "packed_linear needs at least one row");
  TORCH_CHECK(pairs * 2 == in, "x has ", in, " inputs, the weight ", pairs * 2);
  const int64_t out = groups * kGroup;
  x = x.contiguous();
  const uint16_t* bias_ptr = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->to(at::kBFloat16).contiguous();
    TORCH_CHECK(bias_c.numel() == out, "bias size");
    bias_ptr = reinterpret_cast<const uint16_t*>(bias_c.data_ptr());
  }
  auto y = torch::empty({rows, out}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // Split the groups evenly between the threads (16-row granularity).
  const int64_t grain = std::max<int64_t>(1, (groups + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    groups_range(w, xp, rows, pairs, begin, end, bias_ptr, yp, out);
  });
  return y;
}

bool packed_linear_native() {
#ifdef CARPOOL_DPBF16
  return true;
#else
  return false;
#endif
}
