// Fused row-wise ops for CPU: one pass over memory instead of the five or
// six a chain of torch elementwise ops makes (which dominate prefill steps
// in bf16 here). Math is fp32 whatever the storage dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "bf16.h"

namespace {

using carpool::bf16_float;

template <typename T>
inline float widen(T v) { return static_cast<float>(v); }

// RMSNorm as the reference computes it: normalise in fp32, round to the
// storage dtype, then multiply by the weight.
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t cols, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * cols;
      T* orow = out + r * cols;
      float sum = 0.f;
      for (int64_t c = 0; c < cols; ++c) {
        const float v = widen(xr[c]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
      for (int64_t c = 0; c < cols; ++c) {
        const T normed = static_cast<T>(widen(xr[c]) * inv);
        orow[c] = static_cast<T>(widen(weight[c]) * widen(normed));
      }
    }
  });
}

// The first index of each row's largest value, as torch.max(dim) gives it
// (a NaN counts as the largest: the first NaN's index). The sampler's greedy
// rows: ATen's bf16 max walks a 49k-wide row element by element. One
// vectorized pass keeps the max of each chunk of 64 and the first chunk
// that raised the running max (NaNs are found by their bits, which
// -ffast-math cannot assume away); then that chunk is searched.
constexpr int64_t kArgmaxChunk = 64;

inline bool bf16_is_nan(uint16_t b) { return (b & 0x7fff) > 0x7f80; }

int64_t argmax_row(const at::BFloat16* row, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_chunk = 0;
  int nan = 0;
  for (int64_t start = 0; start < n; start += kArgmaxChunk) {
    const int64_t stop = std::min(n, start + kArgmaxChunk);
    float chunk_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : chunk_max) reduction(| : nan)
    for (int64_t i = start; i < stop; ++i) {
      chunk_max = std::max(chunk_max, bf16_float(bits[i]));
      nan |= bf16_is_nan(bits[i]);
    }
    if (chunk_max > best) {
      best = chunk_max;
      best_chunk = start;
    }
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i)
      if (bf16_is_nan(bits[i])) return i;
  }
  for (int64_t i = best_chunk; i < n; ++i)
    if (bf16_float(bits[i]) == best) return i;
  return 0;  // every value -inf
}

// SwiGLU: out = silu(gate) * up for x = [gate | up] along the last dim.
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t half) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * half;
      const T* up = gate + half;
      T* orow = out + r * half;
      for (int64_t c = 0; c < half; ++c) {
        const float g = widen(gate[c]);
        const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
        orow[c] = static_cast<T>(widen(silu) * widen(up[c]));
      }
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), "bad shapes");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
  return out;
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "expected [rows, 2 * width]");
  x = x.contiguous();
  const int64_t half = x.size(1) / 2;
  auto out = torch::empty({x.size(0), half}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), half);
  });
  return out;
}

torch::Tensor row_argmax(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "expected [rows, cols]");
  // ATen's own max is vectorized for float32 (and fast enough): bf16 only.
  if (x.scalar_type() != at::kBFloat16 || x.stride(1) != 1 || x.size(1) == 0) {
    return std::get<1>(x.max(1));
  }
  const int64_t rows = x.size(0), cols = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  int64_t* idx = out.data_ptr<int64_t>();
  const at::BFloat16* data = x.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) idx[r] = argmax_row(data + r * stride, cols);
  });
  return out;
}

// Structured outputs' mask: every logit whose bit in the row's bitmask is
// clear becomes -inf, in place (bit j of word w: token 32w + j). A word of
// all ones (every token allowed) is skipped; the select over 32 lanes
// vectorizes. torch's unpack-and-fill takes ~3 ms for 32 rows of a
// 49,152-token vocabulary on a 2-core EPYC; this, well under one.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [rows, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                  bitmask.size(0) == logits.size(0) &&
                  bitmask.size(1) * 32 >= logits.size(1) && bitmask.is_contiguous(),
              "bitmask must be int32 [rows, ceil(vocab / 32)]");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  const int64_t words = bitmask.size(1);
  float* data = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = data + r * stride;
      const uint32_t* mask = bits + r * words;
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t m = mask[w];
        if (m == 0xffffffffu) continue;
        const int64_t base = w * 32;
        if (base + 32 <= vocab) {
          float* chunk = row + base;
          for (int j = 0; j < 32; ++j) chunk[j] = ((m >> j) & 1u) ? chunk[j] : ninf;
        } else {
          for (int64_t j = 0; base + j < vocab; ++j)
            if (!((m >> j) & 1u)) row[base + j] = ninf;
        }
      }
    }
  });
}
