// INT4 linear layers for decode steps of a few rows (``--quantization int4``).
//
// Why: ATen's weight-only INT4 kernel streams the default model's 4-bit
// layers at ~12 GB/s on a 2-core Xeon (5.6 ms a token): it is the largest
// share of an INT4 decode step. Here the codes are laid out as the bf16
// kernel's tiles (csrc/packed_linear.cpp), 16 output rows x 2 inputs, two
// tiles per 32-byte load (one in the low nibbles, the next in the high
// ones), widened to bf16 in registers (one OR: see `block`) and
// multiplied with `vdpbf16ps`; each group of 32 inputs then applies its
// scale and minimum (w = code * scale + min) as two fused multiply-adds:
//   sum_k w[k] x[k] = scale * sum_k code[k] x[k] + min * sum_k x[k].
//
// Layout (carpool/model/quant.py `pack_int4`), for group g of 16 output rows:
//   codes  uint8 [out/16][in/4][32]: byte 2r+s of quad u =
//          code[16g+r][4u+s] | code[16g+r][4u+2+s] << 4   (r < 16, s < 2)
//   scales, mins  fp16 [out/16][in/32][16]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define CARPOOL_INT4_NATIVE 1
#endif

namespace {

constexpr int64_t kRows = 16;      // output rows per group
constexpr int64_t kQuantGroup = 32;  // inputs per scale
constexpr int kMaxRows = 4;         // token rows one pass over the weights takes

inline float bf16_bits_to_float(uint32_t v) {
  uint32_t bits = v << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline uint16_t to_bf16(float v) {  // round to nearest even, as torch
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

struct Int4Weight {
  const uint8_t* codes;
  const at::Half* scales;
  const at::Half* mins;
  int64_t quads, quant_groups;  // in / 4, in / 32
};

// acc [M][G][16] = x[m] . w[rows of groups g..g+G) for M token rows.
template <int M, int G>
void block(const Int4Weight& w, const uint32_t* x, const float* xsum, int64_t g, float* acc_out) {
#ifdef CARPOOL_INT4_NATIVE
  // A code c in the low bits of bf16 128.0 (0x4300, 7 mantissa bits) reads
  // as 128 + c exactly: one OR widens it; the 128s come off per group below.
  const __m512i bias128 = _mm512_set1_epi16(0x4300);
  const __m512i low_nibble = _mm512_set1_epi16(0x0f);
  __m512 y[M][G];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < G; ++j) y[m][j] = _mm512_setzero_ps();
  for (int64_t q = 0; q < w.quant_groups; ++q) {
    __m512 dot[M][G];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < G; ++j) dot[m][j] = _mm512_setzero_ps();
    for (int64_t u = q * (kQuantGroup / 4); u < (q + 1) * (kQuantGroup / 4); ++u) {
      // 32 bytes = the tiles of pairs 2u (low nibbles) and 2u + 1 (high).
      __m512bh lo[G], hi[G];
      for (int j = 0; j < G; ++j) {
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w.codes + ((g + j) * w.quads + u) * 2 * kRows)));
        lo[j] = (__m512bh)_mm512_ternarylogic_epi32(words, low_nibble, bias128, 0xEA);  // (a & b) | c
        hi[j] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), bias128);
      }
      for (int m = 0; m < M; ++m) {
        const uint32_t* xm = x + m * 2 * w.quads + 2 * u;
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(xm[0]));
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(xm[1]));
        for (int j = 0; j < G; ++j) {
          dot[m][j] = _mm512_dpbf16_ps(dot[m][j], lo[j], x0);
          dot[m][j] = _mm512_dpbf16_ps(dot[m][j], hi[j], x1);
        }
      }
    }
    for (int j = 0; j < G; ++j) {
      const int64_t at = ((g + j) * w.quant_groups + q) * kRows;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + at)));
      const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + at)));
      for (int m = 0; m < M; ++m) {
        const __m512 sum = _mm512_set1_ps(xsum[m * w.quant_groups + q]);
        const __m512 codes_dot = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), sum, dot[m][j]);
        y[m][j] = _mm512_fmadd_ps(scale, codes_dot, y[m][j]);
        y[m][j] = _mm512_fmadd_ps(min, sum, y[m][j]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < G; ++j) _mm512_storeu_ps(acc_out + (m * G + j) * kRows, y[m][j]);
#else
  // Portable: the same sums in plain loops (for CPUs without AVX512-BF16; slow).
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < G; ++j)
      for (int64_t r = 0; r < kRows; ++r) {
        float total = 0.f;
        for (int64_t q = 0; q < w.quant_groups; ++q) {
          float dot = 0.f;
          for (int64_t u = q * (kQuantGroup / 4); u < (q + 1) * (kQuantGroup / 4); ++u) {
            const uint8_t* tile = w.codes + ((g + j) * w.quads + u) * 2 * kRows + 2 * r;
            const uint32_t* xm = x + m * 2 * w.quads + 2 * u;
            for (int s = 0; s < 2; ++s) {  // input 4u + s (low nibble), 4u + 2 + s (high)
              const float low_x = bf16_bits_to_float(s ? xm[0] >> 16 : xm[0] & 0xffff);
              const float high_x = bf16_bits_to_float(s ? xm[1] >> 16 : xm[1] & 0xffff);
              dot += static_cast<float>(tile[s] & 0xf) * low_x +
                     static_cast<float>(tile[s] >> 4) * high_x;
            }
          }
          const int64_t at = ((g + j) * w.quant_groups + q) * kRows + r;
          total += static_cast<float>(w.scales[at]) * dot +
                   static_cast<float>(w.mins[at]) * xsum[m * w.quant_groups + q];
        }
        acc_out[(m * G + j) * kRows + r] = total;
      }
#endif
}

template <int M, int G>
void block_to_output(const Int4Weight& w, const uint32_t* x, const float* xsum, int64_t g,
                     const uint16_t* bias, uint16_t* y, int64_t out) {
  alignas(64) float acc[M * G * kRows];
  block<M, G>(w, x, xsum, g, acc);
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < G; ++j)
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t col = (g + j) * kRows + r;
        float v = acc[(m * G + j) * kRows + r];
        if (bias != nullptr) v += bf16_bits_to_float(bias[col]);
        y[m * out + col] = to_bf16(v);
      }
}

template <int M>
void groups_range(const Int4Weight& w, const uint32_t* x, const float* xsum, int64_t begin,
                  int64_t end, const uint16_t* bias, uint16_t* y, int64_t out) {
  constexpr int G = M <= 2 ? 4 : 2;  // accumulators: 2 x M x G of the 32 vector registers
  int64_t g = begin;
  for (; g + G <= end; g += G) block_to_output<M, G>(w, x, xsum, g, bias, y, out);
  for (; g < end; ++g) block_to_output<M, 1>(w, x, xsum, g, bias, y, out);
}

void rows_range(const Int4Weight& w, const uint32_t* x, const float* xsum, int64_t rows,
                int64_t begin, int64_t end, const uint16_t* bias, uint16_t* y, int64_t out) {
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    const uint32_t* xr = x + r * 2 * w.quads;
    const float* sr = xsum + r * w.quant_groups;
    uint16_t* yr = y + r * out;
    switch (std::min<int64_t>(kMaxRows, rows - r)) {
      case 1: groups_range<1>(w, xr, sr, begin, end, bias, yr, out); break;
      case 2: groups_range<2>(w, xr, sr, begin, end, bias, yr, out); break;
      case 3: groups_range<3>(w, xr, sr, begin, end, bias, yr, out); break;
      default: groups_range<4>(w, xr, sr, begin, end, bias, yr, out); break;
    }
  }
}

}  // namespace

// x [rows, in] bf16 times the INT4 weight (codes, scales, mins as laid out
// above) (+ bias [out]) -> [rows, out] bf16.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          torch::Tensor mins, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "expected bf16 x [rows, in]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == 2 * kRows,
              "expected codes [out/16, in/4, 32] uint8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf &&
                  scales.sizes() == mins.sizes() && scales.dim() == 3,
              "expected fp16 scales and mins [out/16, in/32, 16]");
  const int64_t rows = x.size(0), in = x.size(1), groups = codes.size(0);
  TORCH_CHECK(rows >= 1, "int4_linear needs at least one row");
  TORCH_CHECK(codes.size(1) * 4 == in && in % kQuantGroup == 0 &&
                  scales.size(0) == groups && scales.size(1) * kQuantGroup == in,
              "x has ", in, " inputs, the weight ", codes.size(1) * 4);
  const int64_t out = groups * kRows;
  x = x.contiguous();
  codes = codes.contiguous();
  scales = scales.contiguous();
  mins = mins.contiguous();
  const uint16_t* bias_ptr = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->to(at::kBFloat16).contiguous();
    TORCH_CHECK(bias_c.numel() == out, "bias size");
    bias_ptr = reinterpret_cast<const uint16_t*>(bias_c.data_ptr());
  }
  // Each row's sum over each group of 32 inputs (the minimums' term), in
  // a plain loop: three ATen ops here cost more than the sums.
  const int64_t quant_groups = in / kQuantGroup;
  std::vector<float> xsum(rows * quant_groups, 0.f);
  const auto* xbits = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < in; ++k)
      xsum[r * quant_groups + k / kQuantGroup] += bf16_bits_to_float(xbits[r * in + k]);
  auto y = torch::empty({rows, out}, x.options());
  const Int4Weight w{codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                     mins.data_ptr<at::Half>(), in / 4, in / kQuantGroup};
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const float* sp = xsum.data();
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t grain = std::max<int64_t>(1, (groups + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    rows_range(w, xp, sp, rows, begin, end, bias_ptr, yp, out);
  });
  return y;
}
