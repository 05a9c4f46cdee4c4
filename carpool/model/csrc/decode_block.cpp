// The attention part of a decode-only step's layer in one call: rotary on
// q and k, the new K/V written into the paged cache, paged decode attention.
//
// Why: in Python this is ~30 small torch ops a layer (split, views, the
// half-split rotary as slices, products, a sum and a concatenation for q
// and again for k, two indexed cache writes, the attention call, copies),
// ~5 us of dispatch each: ~4 ms of a one-sequence decode token of the
// default model (30 layers), as much as its attention and norms together.
//
// The arithmetic is the portable path's op for op (layers.py `Rotary.apply`:
// each product and sum rounded to the storage dtype, as torch's elementwise
// ops do), so outputs are identical to it, not merely close.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale);

namespace {

// The kernels build with -ffast-math; here each product must be rounded on
// its own, as torch's separate ops do (no fused multiply-add, no reordering).
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

template <typename T>
inline T rnd(float v) { return static_cast<T>(v); }  // to storage: rounds for bf16/fp16

// x [heads, D] rotated by the half-split convention into out (may alias x).
template <typename T>
inline void rotate_heads(const T* x, const T* cos, const T* sin, int64_t heads, int64_t dim,
                         T* out) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* xh = x + h * dim;
    T* oh = out + h * dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(xh[i]), x2 = static_cast<float>(xh[i + half]);
      const float c = static_cast<float>(cos[i]), s = static_cast<float>(sin[i]);
      const T a = rnd<T>(x1 * c), b = rnd<T>(x2 * s), d = rnd<T>(x2 * c), e = rnd<T>(x1 * s);
      oh[i] = rnd<T>(static_cast<float>(a) - static_cast<float>(b));
      oh[i + half] = rnd<T>(static_cast<float>(d) + static_cast<float>(e));
    }
  }
}

#pragma GCC pop_options

// bf16 as torch rounds it, in integer ops (bf16.h): inlined and vectorized,
// which the no-fast-math functions above cannot be (GCC does not inline
// c10's conversions into a function of other optimize options: 8% of a
// 64-sequence decode step went to those calls). A lone product or sum is IEEE's under -ffast-math too, and the
// roundings between them are integer ops that no contraction crosses, so
// this computes what rotate_heads does, bit for bit.
using carpool::bf16_float;
using carpool::float_bf16;

inline float round_bf16(float f) { return bf16_float(float_bf16(f)); }

inline void rotate_heads(const at::BFloat16* x16, const at::BFloat16* cos16,
                         const at::BFloat16* sin16, int64_t heads, int64_t dim,
                         at::BFloat16* out16) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(x16);
  const uint16_t* cos = reinterpret_cast<const uint16_t*>(cos16);
  const uint16_t* sin = reinterpret_cast<const uint16_t*>(sin16);
  uint16_t* out = reinterpret_cast<uint16_t*>(out16);
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const uint16_t* xh = x + h * dim;
    uint16_t* oh = out + h * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = bf16_float(xh[i]), x2 = bf16_float(xh[i + half]);
      const float c = bf16_float(cos[i]), s = bf16_float(sin[i]);
      const float a = round_bf16(x1 * c), b = round_bf16(x2 * s);
      const float d = round_bf16(x2 * c), e = round_bf16(x1 * s);
      oh[i] = float_bf16(a - b);
      oh[i + half] = float_bf16(d + e);
    }
  }
}

}  // namespace

// qkv [T, (H + 2 KVH) * D] of T decodes; cos, sin [T, D / 2]; caches as
// paged_decode_attention's; slot_blocks, slot_offsets [T] where each new
// K/V goes; block_tables [T, max_blocks], context_lens [T] (this token
// included). Returns the attention output [T, H * D].
torch::Tensor decode_attention_block(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                     torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor slot_blocks, torch::Tensor slot_offsets,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t heads, int64_t kv_heads, double scale) {
  const int64_t tokens = qkv.size(0), dim = v_cache.size(3), block_size = v_cache.size(2);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim, "bad qkv shape");
  TORCH_CHECK(cos.size(0) == tokens && cos.size(-1) == dim / 2 && sin.sizes() == cos.sizes(),
              "bad rotary tables");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && cos.scalar_type() == qkv.scalar_type(),
              "dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.size(0) == kv_heads,
              "caches must be contiguous [KVH, NB, D, BS] / [KVH, NB, BS, D]");
  TORCH_CHECK(slot_blocks.scalar_type() == torch::kLong && slot_offsets.scalar_type() == torch::kLong,
              "slots must be int64");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slot_blocks = slot_blocks.contiguous();
  slot_offsets = slot_offsets.contiguous();
  auto q = torch::empty({tokens, heads, dim}, qkv.options());
  const int64_t num_blocks = v_cache.size(1), width = qkv.size(1);
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(blocks[t] >= 0 && blocks[t] < num_blocks && offsets[t] >= 0 &&
                    offsets[t] < block_size, "slot out of the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "decode_block", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t head_stride = num_blocks * block_size * dim;
    // Tokens write distinct cache slots (the scheduler gives each its own).
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> k_rot(kv_heads * dim);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = src + t * width;
        const scalar_t *c = cp + t * (dim / 2), *s = sp + t * (dim / 2);
        rotate_heads(row, c, s, heads, dim, qp + t * heads * dim);
        rotate_heads(row + heads * dim, c, s, kv_heads, dim, k_rot.data());
        const scalar_t* v = row + (heads + kv_heads) * dim;
        for (int64_t h = 0; h < kv_heads; ++h) {
          // K blocks are stored transposed: [D, BS]; V blocks [BS, D].
          scalar_t* kb = kc + h * head_stride + blocks[t] * dim * block_size + offsets[t];
          scalar_t* vb = vc + h * head_stride + (blocks[t] * block_size + offsets[t]) * dim;
          for (int64_t i = 0; i < dim; ++i) {
            kb[i * block_size] = k_rot[h * dim + i];
            vb[i] = v[h * dim + i];
          }
        }
      }
    });
  });
  return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
      .view({tokens, heads * dim});
}
