// A mixture-of-experts layer's routed experts in one call, on packed bf16
// weights (carpool/model/moe.py `MoEBlock.pack_experts`).
//
// Why: the grouped torch path runs two oneDNN products per active expert
// plus a gather, a pad and a concatenation per product, the activation, the
// routing-weight scale and the scatter-add: at a decode step of 64 tokens
// (8 experts, top-2, ~16 rows an expert) that is ~35 ops and 0.8 ms of a
// 2.4 ms layer outside the products on a 2-core AMD EPYC. Here each thread
// takes a fixed slice of the output columns of every expert (so the work
// splits evenly whatever the routing), in two parallel regions: gate/up
// with the activation fused, then down with the weighting and the sum per
// token fused.
//
// Numerics are the grouped path's, rounding for rounding: gate and up
// rounded to bf16, silu(gate) rounded, times up rounded; down's output
// rounded, times the routing weight (fp32) rounded; a token's rows summed
// in fp32 in expert order and rounded once. Only the products' summation
// order differs from oneDNN's (fp32 accumulators either way).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "packed_block.h"

namespace {

using namespace carpool::packed;

struct Segment {
  int64_t expert, start, rows;  // an active expert's rows of the sorted batch
};

inline float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// gate_up is packed with gate and up groups interleaved (gate 0, up 0,
// gate 1, up 1, ...), so one block of 2*Q groups holds Q column groups of
// both: the activation is made where the products are.
template <int M, int Q>
void gate_up_block(const uint16_t* w, const uint32_t* x, int64_t pairs, int64_t q,
                   uint16_t* act, int64_t inter) {
  alignas(64) float acc[M * 2 * Q * 16];
  block<M, 2 * Q>(w, x, pairs, pairs, 2 * q, acc);
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < Q; ++j)
      for (int r = 0; r < 16; ++r) {
        const float gate = round_bf16(acc[(m * 2 * Q + 2 * j) * 16 + r]);
        const float up = round_bf16(acc[(m * 2 * Q + 2 * j + 1) * 16 + r]);
        const float silu = round_bf16(gate / (1.f + std::exp(-gate)));
        act[m * inter + (q + j) * 16 + r] = float_to_bf16(silu * up);
      }
}

template <int Q>
void gate_up_rows(const uint16_t* w, const uint32_t* x, int64_t rows, int64_t pairs, int64_t q,
                  uint16_t* act, int64_t inter) {
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    const uint32_t* xr = x + r * pairs;
    uint16_t* ar = act + r * inter;
    switch (std::min<int64_t>(kMaxRows, rows - r)) {
      case 1: gate_up_block<1, Q>(w, xr, pairs, q, ar, inter); break;
      case 2: gate_up_block<2, Q>(w, xr, pairs, q, ar, inter); break;
      case 3: gate_up_block<3, Q>(w, xr, pairs, q, ar, inter); break;
      default: gate_up_block<4, Q>(w, xr, pairs, q, ar, inter); break;
    }
  }
}

// Down's columns [g*16, (g+G)*16) for M rows of one expert: weighted, then
// added to their tokens' fp32 sums (this thread owns these columns).
template <int M, int G>
void down_block(const uint16_t* w, const uint32_t* act, int64_t pairs, int64_t g,
                const int64_t* tokens, const float* weights, float* sums, int64_t hidden) {
  alignas(64) float acc[M * G * 16];
  block<M, G>(w, act, pairs, pairs, g, acc);
  for (int m = 0; m < M; ++m) {
    float* sum = sums + tokens[m] * hidden + g * 16;
    for (int i = 0; i < G * 16; ++i) sum[i] += round_bf16(round_bf16(acc[m * G * 16 + i]) * weights[m]);
  }
}

template <int G>
void down_rows(const uint16_t* w, const uint32_t* act, int64_t rows, int64_t pairs, int64_t g,
               const int64_t* tokens, const float* weights, float* sums, int64_t hidden) {
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    const uint32_t* ar = act + r * pairs;
    switch (std::min<int64_t>(kMaxRows, rows - r)) {
      case 1: down_block<1, G>(w, ar, pairs, g, tokens + r, weights + r, sums, hidden); break;
      case 2: down_block<2, G>(w, ar, pairs, g, tokens + r, weights + r, sums, hidden); break;
      case 3: down_block<3, G>(w, ar, pairs, g, tokens + r, weights + r, sums, hidden); break;
      default: down_block<4, G>(w, ar, pairs, g, tokens + r, weights + r, sums, hidden); break;
    }
  }
}

std::vector<Segment> segments_of(const torch::Tensor& counts, int64_t num_rows) {
  std::vector<Segment> segments;
  const int64_t* c = counts.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t e = 0; e < counts.numel(); ++e) {
    if (c[e] > 0) segments.push_back({e, start, c[e]});
    start += c[e];
  }
  TORCH_CHECK(start == num_rows, "expert counts sum to ", start, ", not the ", num_rows, " rows");
  return segments;
}

}  // namespace

// x [T, H] bf16; row_tokens [N] int64: the token of each (token, expert)
// row sorted by expert; counts [E] int64 (CPU): each expert's rows;
// row_weights [N] fp32: each row's routing weight; gate_up [E, 2I/16, H/2,
// 16, 2] (gate and up groups interleaved), down [E, H/16, I/2, 16, 2]:
// packed bf16. Returns [T, H] bf16: each token's weighted expert outputs.
torch::Tensor packed_moe_experts(torch::Tensor x, torch::Tensor row_tokens, torch::Tensor counts,
                                 torch::Tensor row_weights, torch::Tensor gate_up,
                                 torch::Tensor down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bf16 [T, H]");
  TORCH_CHECK(gate_up.dim() == 5 && down.dim() == 5 && gate_up.scalar_type() == at::kBFloat16 &&
                  down.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() &&
                  down.is_contiguous(), "expected packed bf16 expert weights [E, G, P, 16, 2]");
  TORCH_CHECK(row_tokens.scalar_type() == at::kLong && counts.scalar_type() == at::kLong &&
                  row_weights.scalar_type() == at::kFloat && counts.device().is_cpu(),
              "row_tokens, counts (int64, CPU) and row_weights (fp32) expected");
  const int64_t tokens = x.size(0), hidden = x.size(1), rows = row_tokens.numel();
  const int64_t experts = gate_up.size(0), inter = gate_up.size(1) * kGroup / 2;
  TORCH_CHECK(gate_up.size(2) * 2 == hidden && down.size(0) == experts &&
                  down.size(1) * kGroup == hidden && down.size(2) * 2 == inter &&
                  counts.numel() == experts && row_weights.numel() == rows,
              "the expert weights, counts and rows disagree on their sizes");
  x = x.contiguous();
  row_tokens = row_tokens.contiguous();
  row_weights = row_weights.contiguous();
  const auto segments = segments_of(counts.contiguous(), rows);
  const int64_t* tok = row_tokens.data_ptr<int64_t>();
  // The rows in expert order: one gather, so each expert's rows are contiguous.
  auto gathered = torch::empty({rows, hidden}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* gp = reinterpret_cast<uint16_t*>(gathered.data_ptr());
  for (int64_t n = 0; n < rows; ++n) {
    TORCH_CHECK(tok[n] >= 0 && tok[n] < tokens, "row token ", tok[n], " out of range");
    std::memcpy(gp + n * hidden, xp + tok[n] * hidden, hidden * sizeof(uint16_t));
  }
  auto act = torch::empty({rows, inter}, x.options());
  auto* actp = reinterpret_cast<uint16_t*>(act.data_ptr());
  const auto* gu = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  const int64_t gu_pairs = hidden / 2, gu_stride = gate_up[0].numel();
  const int64_t column_groups = inter / kGroup;
  const int threads = at::get_num_threads();
  at::parallel_for(0, column_groups, (column_groups + threads - 1) / threads,
                   [&](int64_t begin, int64_t end) {
    for (const Segment& s : segments) {
      const uint16_t* w = gu + s.expert * gu_stride;
      const auto* xs = reinterpret_cast<const uint32_t*>(gp + s.start * hidden);
      uint16_t* a = actp + s.start * inter;
      int64_t q = begin;
      for (; q + 2 <= end; q += 2) gate_up_rows<2>(w, xs, s.rows, gu_pairs, q, a, inter);
      for (; q < end; ++q) gate_up_rows<1>(w, xs, s.rows, gu_pairs, q, a, inter);
    }
  });
  auto sums = torch::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  float* sp = sums.data_ptr<float>();
  const float* wp = row_weights.data_ptr<float>();
  const auto* dn = reinterpret_cast<const uint16_t*>(down.data_ptr());
  const int64_t dn_pairs = inter / 2, dn_stride = down[0].numel(), out_groups = hidden / kGroup;
  at::parallel_for(0, out_groups, (out_groups + threads - 1) / threads,
                   [&](int64_t begin, int64_t end) {
    for (const Segment& s : segments) {  // in expert order: each token's sum in that order
      const uint16_t* w = dn + s.expert * dn_stride;
      const auto* a = reinterpret_cast<const uint32_t*>(actp + s.start * inter);
      int64_t g = begin;
      for (; g + 4 <= end; g += 4)
        down_rows<4>(w, a, s.rows, dn_pairs, g, tok + s.start, wp + s.start, sp, hidden);
      for (; g < end; ++g)
        down_rows<1>(w, a, s.rows, dn_pairs, g, tok + s.start, wp + s.start, sp, hidden);
    }
  });
  return sums.to(at::kBFloat16);
}
