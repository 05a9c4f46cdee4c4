// W8A8 linear layers: INT8 weights (one scale per output channel) times
// INT8 activations (one scale per 32 inputs of a row, computed here per
// call) (--quantization w8a8; carpool/model/w8a8.py).
//
// Why: a batched step on a CPU without AMX is bound by multiply-adds, and
// AVX512-VNNI's `vpdpbusd` does 64 8-bit multiply-adds per instruction,
// twice AVX512-BF16's `vdpbf16ps` (32). Each 32-input sum is exact and the
// float sum over them runs in one fixed order per row, so a row's result
// never depends on the other rows of its step, nor on the blocking.
//
// Why 32 inputs a scale, not one per row: the default model's activations
// have outlier channels (a row's max up to 39x its RMS), and one scale per
// row left 1 of 16 greedy answers as bf16's; per 32 inputs (as llama.cpp's
// Q8_0), 5-7 of 16, as weight-only INT8 (docs/numbers/cpu.md).
//
// `vpdpbusd` multiplies unsigned by signed bytes: the weights are stored
// + 128 as uint8. What the + 128 adds to a row's scaled sums, the sum over
// its spans of scale x 128 x the span's codes' sum, is one number per row
// (the same for every output): it comes off once, at the end.
//
// Weight layout (w8a8.py `pack_int8`): [out / 16][in / 4][16][4] uint8,
// group g of 16 output channels one contiguous [in / 4][16][4] slab; one
// 64-byte load holds 16 outputs x 4 inputs, one 32-bit lane per output.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>
#define CARPOOL_VNNI 1
#endif

namespace {

constexpr int64_t kGroup = 16;  // output channels per packed group
constexpr int64_t kSpan = 32;   // inputs per activation scale
constexpr int64_t kQuads = kSpan / 4;
// Measured on a 2-core AMD EPYC (AVX512-VNNI, no AMX), one layer's four
// matmuls (the default model's) at 64 rows: blocks of 6 rows x 2 groups
// (12 integer and 12 float accumulators) 0.82 ms, 4 x 2 0.91 ms, against
// 1.22 ms for oneDNN's blocked bf16; more accumulators spill registers.
constexpr int kRows = 6;   // rows one pass over a block of weights takes
constexpr int kBlock = 2;  // groups of 16 outputs per block
constexpr int kStreams = 8;  // groups per block for one row

// A row of x (bf16 or fp32) -> int8 codes and per 32 inputs a scale;
// returns what the weights' + 128 adds to the row's scaled sums.
template <typename T>
float quantize_row(const T* x, int64_t in, int8_t* codes, float* scales) {
  float offset = 0.f;
  for (int64_t s = 0; s < in / kSpan; ++s) {
    const T* xs = x + s * kSpan;
    float amax = 0.f;
    for (int64_t k = 0; k < kSpan; ++k) amax = std::max(amax, std::fabs(static_cast<float>(xs[k])));
    const float scale = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / scale;
    int32_t sum = 0;
    for (int64_t k = 0; k < kSpan; ++k) {
      const int q = static_cast<int>(std::clamp(std::nearbyint(static_cast<float>(xs[k]) * inv),
                                                -127.f, 127.f));
      codes[s * kSpan + k] = static_cast<int8_t>(q);
      sum += q;
    }
    scales[s] = scale;
    offset = std::fma(static_cast<float>(128 * sum), scale, offset);
  }
  return offset;
}

struct Operands {
  const int8_t* codes;     // [rows][in]
  const float* x_scale;    // [rows][in / 32]
  const float* x_offset;   // [rows]
  const uint8_t* w;        // packed, + 128
  const float* w_scale;    // [out]
  const float* bias;       // [out] or nullptr
  int64_t in, quads, spans, out;
};

inline void store(float* y, float v) { *y = v; }
inline void store(at::BFloat16* y, float v) {  // round to nearest even, as torch
  const uint16_t bits = carpool::float_bf16(v);
  std::memcpy(y, &bits, sizeof bits);
}

#ifdef CARPOOL_VNNI
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
inline void store16(at::BFloat16* y, __m512 v) {  // round to nearest even, as torch
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(rounded));
}

// y[m0 .. m0+M)[g*16 .. (g+G)*16) from the weights of groups g .. g+G.
template <int M, int G, typename T>
void block(const Operands& op, int64_t m0, int64_t g, T* y) {
  __m512 sums[M][G];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < G; ++j) sums[m][j] = _mm512_setzero_ps();
  const uint8_t* slab = op.w + g * op.quads * 64;
  const int8_t* x = op.codes + m0 * op.in;
  for (int64_t s = 0; s < op.spans; ++s) {
    __m512i acc[M][G];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < G; ++j) acc[m][j] = _mm512_setzero_si512();
    for (int64_t q = s * kQuads; q < (s + 1) * kQuads; ++q) {
      __m512i wv[G];
      for (int j = 0; j < G; ++j) wv[j] = _mm512_loadu_si512(slab + (j * op.quads + q) * 64);
      for (int m = 0; m < M; ++m) {
        int32_t four;
        std::memcpy(&four, x + m * op.in + 4 * q, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int j = 0; j < G; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], wv[j], xv);
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m512 scale = _mm512_set1_ps(op.x_scale[(m0 + m) * op.spans + s]);
      for (int j = 0; j < G; ++j)
        sums[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][j]), scale, sums[m][j]);
    }
  }
  for (int m = 0; m < M; ++m) {
    T* row = y + (m0 + m) * op.out;
    const __m512 offset = _mm512_set1_ps(op.x_offset[m0 + m]);
    for (int j = 0; j < G; ++j) {
      const int64_t col = (g + j) * kGroup;
      const __m512 bias = op.bias != nullptr ? _mm512_loadu_ps(op.bias + col) : _mm512_setzero_ps();
      store16(row + col, _mm512_fmadd_ps(_mm512_sub_ps(sums[m][j], offset),
                                         _mm512_loadu_ps(op.w_scale + col), bias));
    }
  }
}
#else
// Portable: the same exact integer sums, and the same float steps, in plain loops.
template <int M, int G, typename T>
void block(const Operands& op, int64_t m0, int64_t g, T* y) {
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < G; ++j) {
      const uint8_t* slab = op.w + (g + j) * op.quads * 64;
      const int8_t* x = op.codes + (m0 + m) * op.in;
      float sums[kGroup] = {};
      for (int64_t s = 0; s < op.spans; ++s) {
        int32_t acc[kGroup] = {};
        for (int64_t q = s * kQuads; q < (s + 1) * kQuads; ++q)
          for (int r = 0; r < kGroup; ++r)
            for (int i = 0; i < 4; ++i)
              acc[r] += static_cast<int32_t>(slab[(q * kGroup + r) * 4 + i]) * x[4 * q + i];
        const float scale = op.x_scale[(m0 + m) * op.spans + s];
        for (int r = 0; r < kGroup; ++r) sums[r] = std::fma(static_cast<float>(acc[r]), scale, sums[r]);
      }
      for (int r = 0; r < kGroup; ++r) {
        const int64_t col = (g + j) * kGroup + r;
        store(y + (m0 + m) * op.out + col, std::fma(sums[r] - op.x_offset[m0 + m], op.w_scale[col],
                                                    op.bias != nullptr ? op.bias[col] : 0.f));
      }
    }
}
#endif

// The last `left` (< kRows) rows with a block of exactly that many.
template <int M, int G, typename T>
void tail_rows(const Operands& op, int64_t left, int64_t m0, int64_t g, T* y) {
  if constexpr (M == 1) {
    block<1, G>(op, m0, g, y);
  } else {
    if (left == M) block<M, G>(op, m0, g, y);
    else tail_rows<M - 1, G>(op, left, m0, g, y);
  }
}

template <int G, typename T>
void rows_of_block(const Operands& op, int64_t rows, int64_t g, T* y) {
  int64_t m = 0;
  for (; m + kRows <= rows; m += kRows) block<kRows, G>(op, m, g, y);
  if (m < rows) tail_rows<kRows - 1, G>(op, rows - m, m, g, y);
}

// Blocks of G groups of outputs, split between the threads.
template <int G, typename T>
void gemm_blocks(const Operands& op, int64_t rows, T* y) {
  const int64_t groups = op.out / kGroup;
  const int64_t blocks = (groups + G - 1) / G;
  const int64_t grain = std::max<int64_t>(1, (blocks + at::get_num_threads() - 1) /
                                                 at::get_num_threads());
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t g = b * G;
      if (g + G <= groups) {
        rows_of_block<G>(op, rows, g, y);
      } else {
        for (int64_t one = g; one < groups; ++one) rows_of_block<1>(op, rows, one, y);
      }
    }
  });
}

// One row streams the weights once: more groups at a time keep more loads
// in flight. Any G computes each output in the same steps (the same bits).
template <typename T>
void gemm(const Operands& op, int64_t rows, T* y) {
  if (rows == 1) gemm_blocks<kStreams>(op, rows, y);
  else gemm_blocks<kBlock>(op, rows, y);
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t in, int8_t* codes, float* scales,
                   float* offsets) {
  const int64_t spans = in / kSpan;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      offsets[r] = quantize_row(x + r * in, in, codes + r * in, scales + r * spans);
  });
}

}  // namespace

// x [rows, in] (bf16 or fp32) times packed INT8 weights -> [rows, out] in x's dtype.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "w8a8_linear: x must be bf16 or fp32 [rows, in]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(2) == kGroup &&
                  packed.size(3) == 4, "w8a8_linear: weights must be packed uint8 [out/16, in/4, 16, 4]");
  const int64_t rows = x.size(0), in = x.size(1), quads = packed.size(1);
  const int64_t out = packed.size(0) * kGroup;
  TORCH_CHECK(quads * 4 == in && in % kSpan == 0, "w8a8_linear: x has ", in,
              " inputs, the weights ", quads * 4, " (a multiple of 32 needed)");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == out,
              "w8a8_linear: the weight scales must be fp32, one per output");
  x = x.contiguous();
  const int64_t spans = in / kSpan;
  auto codes = torch::empty({rows, in}, x.options().dtype(at::kChar));
  auto x_scale = torch::empty({rows, spans}, x.options().dtype(at::kFloat));
  auto x_offset = torch::empty({rows}, x.options().dtype(at::kFloat));
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == out, "w8a8_linear: bias size");
  }
  auto y = torch::empty({rows, out}, x.options());
  Operands op{codes.data_ptr<int8_t>(), x_scale.data_ptr<float>(), x_offset.data_ptr<float>(),
              packed.data_ptr<uint8_t>(), w_scale.data_ptr<float>(),
              bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, in, quads, spans, out};
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows(x.data_ptr<at::BFloat16>(), rows, in, codes.data_ptr<int8_t>(),
                  x_scale.data_ptr<float>(), x_offset.data_ptr<float>());
    gemm(op, rows, y.data_ptr<at::BFloat16>());
  } else {
    quantize_rows(x.data_ptr<float>(), rows, in, codes.data_ptr<int8_t>(),
                  x_scale.data_ptr<float>(), x_offset.data_ptr<float>());
    gemm(op, rows, y.data_ptr<float>());
  }
  return y;
}

bool w8a8_linear_native() {
#ifdef CARPOOL_VNNI
  return true;
#else
  return false;
#endif
}
