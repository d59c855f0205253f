// Decode attention on CPU straight from the paged KV cache of the tgis_native engine.
//
// One query token per sequence, attended over that sequence's blocks where they lie in the
// cache: no gather into a padded copy, no mask tensor. Each task is one (sequence, KV head);
// its query heads are taken in groups of at most 8, each group with online softmax over the
// blocks (running maximum and sum per head, flash-decoding style) and float accumulators.
//
//   query    [rows, heads, dim]                             the new token of each sequence
//   cache    [2 (K, V), kv_heads, num_blocks, block_size * dim]   one layer of the paged cache:
//            a block of V is [block_size, dim] (a row per token), a block of K is [dim,
//            block_size] (a row per dimension), so that one vector load gives one dimension of
//            16 consecutive keys and a block's scores need no horizontal sums
//   tables   [rows, width] int64                            block tables, padded (entries past
//                                                           a sequence's length are ignored)
//   lengths  [rows] int64                                   keys of each sequence, the new one included
//   window   > 0: only the last `window` keys count (sliding-window attention)
//   -> [rows, heads, dim], the dtype of query
//
// Blocks of 16k tokens and head dims of 16k take the vector path (GCC vector extensions of the
// native width: AVX-512 or AVX2 registers; 16-lane vectors made AVX2 code move its accumulators
// through the stack: 32 sequences of 140 keys, 8 query / 2 KV heads, head dim 64, float32, took
// 806 us against 247-266 us now on a 2-core AMD EPYC with AVX2 only); other shapes a scalar path
// with the same arithmetic. Built at first use by text_generation_server/kernels/cpu_kernels.py
// (torch's extension builder, -O3 -march=native -ffast-math) as torch.ops.tgis_cpu.paged_decode.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_vectors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace tgis_cpu;

// -ffast-math assumes no infinities: the running maximum starts at the lowest finite float
// instead of -inf (exp of it minus any score is 0), and keys outside the window score it too.
constexpr float kNoScore = std::numeric_limits<float>::lowest();

// ---- one sequence, one group of query heads -------------------------------------------------

// The running state of `groups` query heads: q (scaled), acc [groups][dim], max and sum.
struct Heads {
  int64_t groups, dim;
  float* q;
  float* acc;
  float* top;
  float* total;
};

// Softmax step of one block for head g: scores s[lo, hi) become probabilities under the
// running maximum, and what was accumulated is rescaled when the maximum grows.
inline void softmax_block(Heads& h, int64_t g, float* s, int64_t lo, int64_t hi) {
  float best = h.top[g];
  for (int64_t t = lo; t < hi; ++t) best = std::max(best, s[t]);
  if (best > h.top[g]) {
    const float factor = std::exp(h.top[g] - best);  // 0 the first time (top = kNoScore)
    h.total[g] *= factor;
    float* a = h.acc + g * h.dim;
    for (int64_t i = 0; i < h.dim; ++i) a[i] *= factor;
    h.top[g] = best;
  }
  float sum = 0.f;
  for (int64_t t = lo; t < hi; ++t) {
    s[t] = std::exp(s[t] - best);
    sum += s[t];
  }
  h.total[g] += sum;
}

// The cache lines of a K block and a V block of `elements` values each on their way to the caches.
template <typename T>
inline void prefetch_block(const T* key_block, const T* value_block, int64_t elements) {
  const int64_t bytes = elements * static_cast<int64_t>(sizeof(T));
  for (const T* block : {key_block, value_block}) {
    const char* c = reinterpret_cast<const char*>(block);
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(c + offset, 0, 3);
  }
}

// Calls visit(kt, vb, lo, hi) for each block holding keys [first, length) of a sequence: its K
// block (transposed, [dim][block_size]), its V block ([block_size][dim]) and the slots in use.
// The next block's K and V are prefetched while one is visited: blocks lie anywhere in the cache,
// where the CPU's own prefetchers cannot guess them (32 sequences of 200 keys over 8 layers'
// caches of 6.5 MB each, bfloat16, 2-core Zen 4: 338-358 us a layer before, 165-173 us with this
// and the next task's first block prefetched).
template <typename T, typename Visit>
void each_block(
    const T* keys, const T* values, const int64_t* table, int64_t first, int64_t length, int64_t block_size,
    int64_t dim, Visit&& visit) {
  for (int64_t start = first - first % block_size; start < length; start += block_size) {
    const int64_t block = table[start / block_size];
    if (start + block_size < length) {
      const int64_t next = table[start / block_size + 1];
      prefetch_block(keys + next * block_size * dim, values + next * block_size * dim, block_size * dim);
    }
    const int64_t lo = std::max<int64_t>(first - start, 0), hi = std::min(block_size, length - start);
    visit(keys + block * block_size * dim, values + block * block_size * dim, lo, hi);
  }
}

// Vector path: G heads (a template constant, so that their accumulators stay in registers),
// block_size % 16 == 0, dim % 16 == 0, in vectors of the CPU's native width (kNative: 16 on
// AVX-512, 8 on AVX2). `scores` holds G * block_size floats.
template <typename T, int G>
void attend_vector(
    Heads& h, const T* keys, const T* values, const int64_t* table, int64_t first, int64_t length,
    int64_t block_size, float* scores) {
  const int64_t dim = h.dim;
  each_block(keys, values, table, first, length, block_size, dim, [&](const T* kt, const T* vb, int64_t lo, int64_t hi) {
    for (int64_t c = lo - lo % kNative; c < hi; c += kNative) {  // kNative keys at a time
      vn s[G];
      for (int g = 0; g < G; ++g) s[g] = vn{};
      for (int64_t i = 0; i < dim; ++i) {
        const vn k = load_native(kt + i * block_size + c);
        for (int g = 0; g < G; ++g) s[g] += h.q[g * dim + i] * k;
      }
      for (int g = 0; g < G; ++g) std::memcpy(scores + g * block_size + c, &s[g], sizeof(vn));
    }
    for (int g = 0; g < G; ++g) softmax_block(h, g, scores + g * block_size, lo, hi);
    for (int64_t j = 0; j < dim; j += kNative) {  // kNative dims of every head's accumulator at a time
      vn a[G];
      for (int g = 0; g < G; ++g) a[g] = load_native(h.acc + g * dim + j);
      for (int64_t t = lo; t < hi; ++t) {
        const vn v = load_native(vb + t * dim + j);
        for (int g = 0; g < G; ++g) a[g] += scores[g * block_size + t] * v;
      }
      for (int g = 0; g < G; ++g) std::memcpy(h.acc + g * dim + j, &a[g], sizeof(vn));
    }
  });
}

// Scalar path: any block size and head dim.
template <typename T>
void attend_scalar(
    Heads& h, const T* keys, const T* values, const int64_t* table, int64_t first, int64_t length,
    int64_t block_size, float* scores) {
  const int64_t dim = h.dim;
  each_block(keys, values, table, first, length, block_size, dim, [&](const T* kt, const T* vb, int64_t lo, int64_t hi) {
    for (int64_t g = 0; g < h.groups; ++g) {
      float* s = scores + g * block_size;
      for (int64_t t = lo; t < hi; ++t) {
        float sum = 0.f;
        for (int64_t i = 0; i < dim; ++i) sum += h.q[g * dim + i] * scalar(kt[i * block_size + t]);
        s[t] = sum;
      }
      softmax_block(h, g, s, lo, hi);
      float* a = h.acc + g * dim;
      for (int64_t t = lo; t < hi; ++t)
        for (int64_t i = 0; i < dim; ++i) a[i] += s[t] * scalar(vb[t * dim + i]);
    }
  });
}

template <typename T>
void decode(
    T* out, const T* query, const T* cache, const int64_t* tables, const int64_t* lengths, int64_t rows,
    int64_t heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size, int64_t dim, int64_t width,
    float scale, int64_t window) {
  const int64_t groups = heads / kv_heads;
  const int64_t head_stride = num_blocks * block_size * dim;  // one KV head of K (or V)
  const int64_t values_offset = kv_heads * head_stride;      // V after K
  const bool vector = block_size % kLanes == 0 && dim % kLanes == 0;
  // the first key a sequence of `length` keys attends (sliding window: its last `window`)
  const auto first_key = [&](int64_t length) { return window > 0 ? std::max<int64_t>(0, length - window) : 0; };
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(groups * dim), acc(groups * dim), top(groups), total(groups);
    std::vector<float> scores(std::max<int64_t>(groups, 8) * block_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / kv_heads, head = task % kv_heads;
      const int64_t length = lengths[seq];
      const int64_t first = first_key(length);
      if (task + 1 < end && lengths[(task + 1) / kv_heads] > 0) {  // the next task's first block meanwhile
        const int64_t next_seq = (task + 1) / kv_heads;
        const int64_t block = tables[next_seq * width + first_key(lengths[next_seq]) / block_size];
        const T* next_keys = cache + ((task + 1) % kv_heads) * head_stride + block * block_size * dim;
        prefetch_block(next_keys, next_keys + values_offset, block_size * dim);
      }
      const T* q_in = query + (seq * heads + head * groups) * dim;
      for (int64_t i = 0; i < groups * dim; ++i) q[i] = scalar(q_in[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(top.begin(), top.end(), kNoScore);
      std::fill(total.begin(), total.end(), 0.f);
      const T* keys = cache + head * head_stride;
      const T* values = keys + values_offset;
      const int64_t* table = tables + seq * width;
      for (int64_t g0 = 0; g0 < groups;) {  // heads in groups of 8, 4, 2, 1
        const int64_t n = groups - g0;
        const int64_t take = !vector ? n : n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1;
        Heads h{take, dim, &q[g0 * dim], &acc[g0 * dim], &top[g0], &total[g0]};
        if (!vector) {
          attend_scalar<T>(h, keys, values, table, first, length, block_size, scores.data());
        } else if (take == 8) {
          attend_vector<T, 8>(h, keys, values, table, first, length, block_size, scores.data());
        } else if (take == 4) {
          attend_vector<T, 4>(h, keys, values, table, first, length, block_size, scores.data());
        } else if (take == 2) {
          attend_vector<T, 2>(h, keys, values, table, first, length, block_size, scores.data());
        } else {
          attend_vector<T, 1>(h, keys, values, table, first, length, block_size, scores.data());
        }
        g0 += take;
      }
      T* o = out + (seq * heads + head * groups) * dim;
      for (int64_t g = 0; g < groups; ++g) {
        const float norm = total[g] > 0.f ? 1.f / total[g] : 0.f;
        for (int64_t i = 0; i < dim; ++i) o[g * dim + i] = static_cast<T>(acc[g * dim + i] * norm);
      }
    }
  });
}

at::Tensor paged_decode(
    const at::Tensor& query, const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lengths,
    int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3, "query must be [rows, heads, dim]");
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2, "cache must be [2, kv_heads, blocks, block_size * dim]");
  TORCH_CHECK(query.scalar_type() == cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong, "int64 tables and lengths");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == query.size(0) && lengths.numel() == query.size(0),
              "one block table and one length per query row");
  const int64_t heads = query.size(1), dim = query.size(2), kv_heads = cache.size(1);
  TORCH_CHECK(block_size > 0 && cache.size(3) == block_size * dim && heads % kv_heads == 0,
              "query and cache shapes do not match");
  TORCH_CHECK(cache.is_contiguous(), "the cache must be contiguous");
  const at::Tensor q = query.contiguous(), t = tables.contiguous(), n = lengths.contiguous();
  at::Tensor out = at::empty_like(q);
  auto run = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    decode<T>(
        out.data_ptr<T>(), q.data_ptr<T>(), cache.data_ptr<T>(), t.data_ptr<int64_t>(), n.data_ptr<int64_t>(),
        q.size(0), heads, kv_heads, cache.size(2), block_size, dim, t.size(1), static_cast<float>(scale), window);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tgis_cpu, m) {
  m.def(
      "paged_decode(Tensor query, Tensor cache, Tensor tables, Tensor lengths, int block_size, float scale, "
      "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
