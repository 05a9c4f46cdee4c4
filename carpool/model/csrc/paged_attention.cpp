// Paged decode attention for CPUs: one query token per sequence attends to
// its context straight from the KV blocks, reading each K/V row once (the
// portable torch path must first gather every context into a new tensor).
//
// Shapes: q [B, H, D]; k_cache, v_cache [KVH, NB, BS, D]; block_tables
// [B, MB] int64; context_lens [B] int64. Returns [B, H, D] in q's dtype.
// Work is split over (sequence, kv head) pairs; the H / KVH query heads that
// share a KV head are handled together so each K/V row is loaded once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// Widen a row to float. bf16 is the top half of a float32, so a shift does it
// and the loop vectorizes (c10's per-element conversion does not here).
inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// One (sequence, kv head): scores for the `groups` query heads over the
// context, block by block (a block's rows are contiguous), softmax, then the
// weighted sum of V rows.
template <typename T>
void decode_one(const T* q, const T* k_head, const T* v_head, const int64_t* table,
                int64_t context_len, int64_t groups, int64_t head_dim, int64_t block_size,
                float scale, T* out, std::vector<float>& work) {
  const int64_t block_elems = block_size * head_dim;
  work.resize(groups * head_dim * 2 + groups * context_len + block_elems);
  float* queries = work.data();
  float* acc = queries + groups * head_dim;
  float* scores = acc + groups * head_dim;
  float* rows = scores + groups * context_len;
  to_float(q, queries, groups * head_dim);
  std::fill(acc, acc + groups * head_dim, 0.f);
  const int64_t num_blocks = (context_len + block_size - 1) / block_size;
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t count = std::min(block_size, context_len - j * block_size);
    to_float(k_head + table[j] * block_elems, rows, count * head_dim);
    for (int64_t g = 0; g < groups; ++g) {
      float* s = scores + g * context_len + j * block_size;
      for (int64_t t = 0; t < count; ++t)
        s[t] = dot(queries + g * head_dim, rows + t * head_dim, head_dim) * scale;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* s = scores + g * context_len;
    const float peak = *std::max_element(s, s + context_len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < context_len; ++t) {
      s[t] = std::exp(s[t] - peak);
      total += s[t];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t t = 0; t < context_len; ++t) s[t] *= inv;
  }
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t count = std::min(block_size, context_len - j * block_size);
    to_float(v_head + table[j] * block_elems, rows, count * head_dim);
    for (int64_t g = 0; g < groups; ++g) {
      const float* s = scores + g * context_len + j * block_size;
      float* a = acc + g * head_dim;
      for (int64_t t = 0; t < count; ++t) {
        const float p = s[t];
        const float* r = rows + t * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * r[d];
      }
    }
  }
  for (int64_t i = 0; i < groups * head_dim; ++i) out[i] = static_cast<T>(acc[i]);
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and context lengths must be int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1),
                block_size = k_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == head_dim, "bad head layout");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t groups = heads / kv_heads;
  auto out = torch::empty_like(q);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "bad context length");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t head_stride = num_blocks * block_size * head_dim;
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> work;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / kv_heads, h = item % kv_heads;
        const int64_t offset = (b * heads + h * groups) * head_dim;
        decode_one<scalar_t>(qp + offset, kp + h * head_stride, vp + h * head_stride,
                             tables + b * max_blocks, lens[b], groups, head_dim, block_size,
                             static_cast<float>(scale), op + offset, work);
      }
    });
  });
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over paged K/V (one query token per sequence)");
  m.def("rms_norm", &rms_norm, "RMSNorm over rows, fp32 math");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for rows of [gate | up]");
}
