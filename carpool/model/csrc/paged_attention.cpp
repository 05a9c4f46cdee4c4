// Paged decode attention for CPUs: one query token per sequence attends to
// its context straight from the KV blocks, reading each K/V row once (the
// portable torch path must first gather every context into a new tensor).
//
// Shapes: q [B, H, D]; k_cache [KVH, NB, D, BS] (blocks transposed, so the
// scores of a block are vertical multiply-adds over BS lanes); v_cache
// [KVH, NB, BS, D]; block_tables [B, MB] int64; context_lens [B] int64.
// Returns [B, H, D] in q's dtype.
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

// Widen N elements to float in registers (N known at compile time): the
// block loops below read the cache's rows directly, without a float copy.
template <int N>
inline void widen(const at::BFloat16* src, float* dst) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int i = 0; i < N; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <int N, typename T>
inline void widen(const T* src, float* dst) {
  for (int i = 0; i < N; ++i) dst[i] = static_cast<float>(src[i]);
}

// Ask for a block's cache lines (`elems` elements of T) ahead of their use
// (the generic shapes; the fixed ones spread theirs over their loops).
template <typename T>
inline void prefetch_block(const T* block, int64_t elems) {
  const char* bytes = reinterpret_cast<const char*>(block);
  const int64_t size = elems * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < size; off += 64) __builtin_prefetch(bytes + off, 0, 3);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Scores of one K block ([D][BS] floats) for `groups` query heads, written
// to lane[g * BS + t]. With G and BS known at compile time the G accumulators
// live in vector registers; the generic loop keeps them in memory.
// `block` is the cache's own K block ([D][BS] elements of T), each row
// widened in registers as it is used: one pass over the block's bytes.
template <int G, int BS, typename T>
void block_scores_fixed(const T* block, const float* queries, int64_t head_dim,
                        float* lane, const T* next) {
  // Two accumulators per head (even and odd rows of d): 2G independent
  // multiply-add chains instead of G, so the FMA units are not left waiting
  // on each other's latency (head_dim is even for every model we load).
  float acc[2][G][BS] = {};
  for (int64_t d = 0; d + 1 < head_dim; d += 2) {
    // The next block's same rows (`next`: the block read after this one),
    // a cache line or so per iteration. The next block lies elsewhere in
    // the pool, where the hardware prefetcher does not look; spread over
    // the loop, the requests never fill the core's miss queue at once (a
    // burst of 32 per block stalled on it). Measured, 30 layers of 64
    // sequences x 280 tokens: no prefetch 34.9 (consecutive blocks) / 53.5 ms
    // (scattered); a burst per block 29.8-32.3 / 34.4-38.4; spread 24.9 / 34.8.
    __builtin_prefetch(next + d * BS, 0, 3);
    __builtin_prefetch(next + (d + 1) * BS, 0, 3);
    float k0[BS], k1[BS];
    widen<BS>(block + d * BS, k0);
    widen<BS>(block + (d + 1) * BS, k1);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const float q0 = queries[g * head_dim + d], q1 = queries[g * head_dim + d + 1];
#pragma omp simd
      for (int t = 0; t < BS; ++t) {
        acc[0][g][t] += q0 * k0[t];
        acc[1][g][t] += q1 * k1[t];
      }
    }
  }
  if (head_dim % 2) {
    float kd[BS];
    widen<BS>(block + (head_dim - 1) * BS, kd);
    for (int g = 0; g < G; ++g) {
      const float qd = queries[g * head_dim + head_dim - 1];
#pragma omp simd
      for (int t = 0; t < BS; ++t) acc[0][g][t] += qd * kd[t];
    }
  }
  for (int g = 0; g < G; ++g) {
#pragma omp simd
    for (int t = 0; t < BS; ++t) lane[g * BS + t] = acc[0][g][t] + acc[1][g][t];
  }
}

// The scores of one K block (T: the cache's element type) for `groups`
// query heads into lane[g * BS + t]; `scratch` holds a float copy of the
// block for the generic shapes.
template <typename T>
inline void block_scores(const T* kblock, const float* queries, int64_t groups,
                         int64_t head_dim, int64_t block_size, float* lane, float* scratch,
                         const T* next) {
  if (block_size == 16) {
    switch (groups) {
      case 1: return block_scores_fixed<1, 16>(kblock, queries, head_dim, lane, next);
      case 2: return block_scores_fixed<2, 16>(kblock, queries, head_dim, lane, next);
      case 3: return block_scores_fixed<3, 16>(kblock, queries, head_dim, lane, next);
      case 4: return block_scores_fixed<4, 16>(kblock, queries, head_dim, lane, next);
      case 5: return block_scores_fixed<5, 16>(kblock, queries, head_dim, lane, next);
      case 6: return block_scores_fixed<6, 16>(kblock, queries, head_dim, lane, next);
      case 7: return block_scores_fixed<7, 16>(kblock, queries, head_dim, lane, next);
      case 8: return block_scores_fixed<8, 16>(kblock, queries, head_dim, lane, next);
      default: break;
    }
  }
  prefetch_block(next, head_dim * block_size);
  to_float(kblock, scratch, head_dim * block_size);
  const float* block = scratch;
  std::fill(lane, lane + groups * block_size, 0.f);
  for (int64_t d = 0; d < head_dim; ++d) {
    const float* kd = block + d * block_size;
    for (int64_t g = 0; g < groups; ++g) {
      const float qd = queries[g * head_dim + d];
      float* lg = lane + g * block_size;
#pragma omp simd
      for (int64_t t = 0; t < block_size; ++t) lg[t] += qd * kd[t];
    }
  }
}

// acc[g] += sum over t < count of p[g * stride + t] * rows[t] (rows [count][D]).
// Compile-time G and D keep the accumulators in vector registers.
template <int G, int D, typename T>
void weighted_rows_fixed(const T* rows, const float* p, int64_t stride, int64_t count,
                         float* acc, const T* next) {
  float sum[G][D];
  std::copy(acc, acc + G * D, &sum[0][0]);
  for (int64_t t = 0; t < count; ++t) {
    // The next block's row t (see block_scores_fixed).
    for (int64_t line = 0; line < static_cast<int64_t>(D * sizeof(T)); line += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(next + t * D) + line, 0, 3);
    float r[D];
    widen<D>(rows + t * D, r);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const float w = p[g * stride + t];
#pragma omp simd
      for (int d = 0; d < D; ++d) sum[g][d] += w * r[d];
    }
  }
  std::copy(&sum[0][0], &sum[0][0] + G * D, acc);
}

// V rows ([count][D] elements of T, the cache's own) weighted into acc;
// `scratch` holds a float copy for the generic shapes.
template <typename T>
inline void weighted_rows(const T* vrows, const float* p, int64_t stride, int64_t count,
                          int64_t groups, int64_t head_dim, float* acc, float* scratch,
                          const T* next) {
  const T* rows = vrows;
  if (head_dim == 64) {
    switch (groups) {
      case 1: return weighted_rows_fixed<1, 64>(rows, p, stride, count, acc, next);
      case 2: return weighted_rows_fixed<2, 64>(rows, p, stride, count, acc, next);
      case 3: return weighted_rows_fixed<3, 64>(rows, p, stride, count, acc, next);
      case 4: return weighted_rows_fixed<4, 64>(rows, p, stride, count, acc, next);
      case 5: return weighted_rows_fixed<5, 64>(rows, p, stride, count, acc, next);
      case 6: return weighted_rows_fixed<6, 64>(rows, p, stride, count, acc, next);
      default: break;
    }
  } else if (head_dim == 128) {
    switch (groups) {
      case 1: return weighted_rows_fixed<1, 128>(rows, p, stride, count, acc, next);
      case 2: return weighted_rows_fixed<2, 128>(rows, p, stride, count, acc, next);
      case 3: return weighted_rows_fixed<3, 128>(rows, p, stride, count, acc, next);
      default: break;
    }
  }
  prefetch_block(next, count * head_dim);
  to_float(vrows, scratch, count * head_dim);
  for (int64_t g = 0; g < groups; ++g) {
    float* a = acc + g * head_dim;
    for (int64_t t = 0; t < count; ++t) {
      const float w = p[g * stride + t];
      const float* r = scratch + t * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += w * r[d];
    }
  }
}

// One (sequence, kv head): scores for the `groups` query heads over the
// context block by block, softmax, then the weighted sum of V rows.
template <typename T>
void decode_one(const T* q, const T* k_head, const T* v_head, const int64_t* table,
                int64_t context_len, int64_t groups, int64_t head_dim, int64_t block_size,
                float scale, T* out, std::vector<float>& work) {
  const int64_t block_elems = block_size * head_dim;
  work.resize(groups * head_dim * 2 + groups * context_len + block_elems + groups * block_size);
  float* queries = work.data();
  float* acc = queries + groups * head_dim;
  float* scores = acc + groups * head_dim;
  float* block = scores + groups * context_len;
  float* lane = block + block_elems;
  to_float(q, queries, groups * head_dim);
  std::fill(acc, acc + groups * head_dim, 0.f);
  const int64_t num_blocks = (context_len + block_size - 1) / block_size;
  prefetch_block(k_head + table[0] * block_elems, block_elems);
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t count = std::min(block_size, context_len - j * block_size);
    // The block read next: this head's next K block, then its first V block.
    const T* next = j + 1 < num_blocks ? k_head + table[j + 1] * block_elems
                                       : v_head + table[0] * block_elems;
    block_scores(k_head + table[j] * block_elems, queries, groups, head_dim, block_size, lane,
                 block, next);  // K block [D][BS]
    for (int64_t g = 0; g < groups; ++g) {
      float* s = scores + g * context_len + j * block_size;
      for (int64_t t = 0; t < count; ++t) s[t] = lane[g * block_size + t] * scale;
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
    // After the last block, its own rows again: already cached, harmless.
    const T* next = v_head + table[std::min(j + 1, num_blocks - 1)] * block_elems;
    weighted_rows(v_head + table[j] * block_elems, scores + j * block_size, context_len, count,
                  groups, head_dim, acc, block, next);  // V rows [BS][D]
  }
  for (int64_t i = 0; i < groups * head_dim; ++i) out[i] = static_cast<T>(acc[i]);
}

}  // namespace

// Context tokens (summed over sequences and KV heads) below which one
// call runs serially.
constexpr int64_t kSerialContext = 2048;

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad shapes");
  TORCH_CHECK(k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "k_cache must be [KVH, NB, D, BS] and v_cache [KVH, NB, BS, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and context lengths must be int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = v_cache.size(0), num_blocks = v_cache.size(1),
                block_size = v_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && v_cache.size(3) == head_dim, "bad head layout");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t groups = heads / kv_heads;
  auto out = torch::empty_like(q);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  int64_t context_total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "bad context length");
    context_total += lens[b];
  }
  // Little work (one short sequence) runs on this thread: waking the
  // OpenMP team costs more than it saves. Measured in the default model's
  // decode of one ~300-token sequence: ~57 us a layer through the team
  // (most of it in libgomp's fork and join) against ~15 us alone.
  const int64_t items = batch * kv_heads;
  const int64_t grain = context_total * kv_heads < kSerialContext ? items + 1 : 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t head_stride = num_blocks * block_size * head_dim;
    at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
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
torch::Tensor row_argmax(torch::Tensor x);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
bool packed_linear_native();
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale,
                          c10::optional<torch::Tensor> bias);
bool w8a8_linear_native();
torch::Tensor packed_moe_experts(torch::Tensor x, torch::Tensor row_tokens, torch::Tensor counts,
                                 torch::Tensor row_weights, torch::Tensor gate_up,
                                 torch::Tensor down);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          torch::Tensor mins, c10::optional<torch::Tensor> bias);
torch::Tensor decode_attention_block(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                     torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor slot_blocks, torch::Tensor slot_offsets,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t heads, int64_t kv_heads, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over paged K/V (one query token per sequence)");
  m.def("rms_norm", &rms_norm, "RMSNorm over rows, fp32 math");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for rows of [gate | up]");
  m.def("row_argmax", &row_argmax, "first index of each row's max, as torch.max(dim)");
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "-inf, in place, at every token whose bit in the row's bitmask is clear");
  m.def("packed_linear", &packed_linear, "x [rows, in] bf16 times a packed weight (+ bias)");
  m.def("decode_attention_block", &decode_attention_block,
        "Rotary, K/V cache write and paged attention of a decode-only step's layer");
  m.def("int4_linear", &int4_linear, "x [rows, in] bf16 times packed INT4 codes, scales, mins");
  m.def("packed_moe_experts", &packed_moe_experts,
        "A MoE layer's routed experts on packed bf16 weights, rows sorted by expert");
  m.def("packed_linear_native", &packed_linear_native, "Whether packed_linear uses AVX512-BF16");
  m.def("w8a8_linear", &w8a8_linear,
        "x [rows, in], INT8 per 32 inputs, times packed INT8 weights (+ bias)");
  m.def("w8a8_linear_native", &w8a8_linear_native, "Whether w8a8_linear uses AVX512-VNNI");
}
