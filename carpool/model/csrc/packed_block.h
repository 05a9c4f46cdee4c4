// The inner block of the packed bf16 kernels (packed_linear.cpp, moe_experts.cpp):
// M rows (tokens) x G groups of 16 output rows of a packed weight, fp32
// accumulators. Layout of a packed weight (carpool/model/packed_linear.py
// `pack_weight`): [out / 16][in / 2][16][2] bf16, group g of 16 output rows
// one contiguous [in / 2][16][2] slab; one 64-byte load holds 16 outputs x 2
// inputs and feeds one AVX512-BF16 `vdpbf16ps`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define CARPOOL_DPBF16 1
#endif

namespace carpool::packed {

constexpr int64_t kGroup = 16;   // output rows per packed group
constexpr int kMaxRows = 4;      // rows (tokens) one pass over the weights takes


inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline uint16_t float_to_bf16(float v) {  // round to nearest even, as torch
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Rows x groups block: y[m][g*16 .. g*16+16*G) for m < M.
template <int M, int G>
inline void block(const uint16_t* w, const uint32_t* x, int64_t x_pairs, int64_t pairs,
                  int64_t g, float* acc_out /*[M][G][16]*/) {
  const uint16_t* slab = w + g * pairs * 32;
#ifdef CARPOOL_DPBF16
  __m512 acc[M][G];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < G; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[G];
    for (int j = 0; j < G; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(slab + (j * pairs + p) * 32);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * x_pairs + p]));
      for (int j = 0; j < G; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < G; ++j) _mm512_storeu_ps(acc_out + (m * G + j) * 16, acc[m][j]);
#else
  // Portable: the same order of operations in plain loops (vectorized by the compiler).
  std::fill(acc_out, acc_out + M * G * 16, 0.f);
  for (int64_t p = 0; p < pairs; ++p) {
    for (int m = 0; m < M; ++m) {
      const uint32_t pair = x[m * x_pairs + p];
      const float x0 = bf16_to_float(pair & 0xffff), x1 = bf16_to_float(pair >> 16);
      for (int j = 0; j < G; ++j) {
        const uint16_t* tile = slab + (j * pairs + p) * 32;
        float* a = acc_out + (m * G + j) * 16;
        for (int r = 0; r < 16; ++r)
          a[r] += bf16_to_float(tile[2 * r]) * x0 + bf16_to_float(tile[2 * r + 1]) * x1;
      }
    }
  }
#endif
}

}  // namespace carpool::packed
