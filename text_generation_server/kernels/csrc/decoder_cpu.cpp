// The decoder stack of a Llama-family model for one step on CPU, in one call.
//
// A step of a small model spends more time in Python and operator dispatch than in its matrix
// products: a transformers decoder layer is ~40 tensor operations, each a few microseconds of
// interpreter and dispatcher work on vectors of a few hundred elements. This runs every layer's
// operations from C++: the projections on the same kernels the model's modules use (at::linear,
// oneDNN's packed linear or our panels where the engine chose that layout), decode rows'
// attention on our paged decode kernel (paged_decode_cpu.cpp), prompt tokens' attention on SDPA
// as the modules' path does it (attention/paged.py), and the elementwise parts (RMS norm,
// residual adds, rotary embedding, KV cache writes) as loops that round where transformers'
// Llama code rounds (every elementwise result to the model's dtype, the norm's statistics in
// float), in parallel over tokens where a step has many.
//
// The step's T new tokens are packed, as in attention/layout.py's StepLayout:
//   embeddings [T, hidden]          their input embeddings
//   cos/sin    [T, head_dim]        the rotary embedding of each token's position, model dtype
//   params     16 per layer, then the final norm's weight:
//                input norm, q (weight, bias), k, v, o, post-attention norm, gate, up, down
//              (a missing bias is None); a weight of 3 dimensions is packed in panels of 16
//              outputs (weight_layout.py's `panels`, multiplied by panel_cpu.cpp)
//   onednn     7 per layer: whether q, k, v, o, gate, up, down hold oneDNN packed weights
//   int8       7 per layer: the oneDNN-packed int8 weights of a W8A8 layer (quantization/int8.py's
//              Int8Linear multiplying the 8-bit way), else None; such a projection's weight slot
//              holds its range row and its bias slot its float32 bias
//   w8a8       7 per layer: the int8 weights of a W8A8 layer in w8a8_cpu.cpp's layout (w8a8_pack),
//              multiplied on our exact kernel (Int8Linear's exact way), else None; its weight slot holds
//              its float32 scales [out] and its bias slot its float32 bias
//   grouped, grouped_order, grouped_out
//              7 per layer each: the weights of a layer quantized in groups of input channels
//              (else None): uint8, the packed 4-bit weights of a quantization/int4.py Int4Linear,
//              or int8, the values of a quantization/int8_groups.py Int8GroupLinear; its input
//              channel order (act-order, else None) and its output features; such a
//              projection's weight slot holds its scales and offsets and its bias slot its bias.
//              4-bit calls run grouped_cpu.cpp's int4_linear (AMX tiles where the CPU has them,
//              else torch's int4 kernel up to int4_max_rows rows and the product over unpacked
//              weights beyond), as Int4Linear.forward does; 8-bit ones grouped_cpu.cpp's
//              int8_group_linear, as Int8GroupLinear.forward does
//   fused      empty, or 4 per layer: q|k|v's panels and bias, gate|up's panels and bias (None where that
//              layer's are not fused): the projections' panels side by side in one tensor, of which
//              their own weight slots hold views (cpu_decoder.py `fuse_panels`). A fused group is one
//              product, one parallel region instead of 3 or 2 (every output's sum is the one it has
//              alone); a step whose adapters target one of its projections multiplies them one by one
//   caches     one per layer: [2, kv_heads, blocks, block_size * head_dim], K blocks transposed
//   slots      [T] int64            the cache slot of each new token's K/V
//   decode     [D] int64 or None    the packed index of each single-token row (None with no
//                                   pieces: every token is one, in order)
//   tables, lengths                 their block tables and key counts, as paged_decode
//   pieces     (start, end, keys) per sequence with several new tokens, its block table
//              (None: no cached tokens, it attends its own new K/V) and boolean mask [new, keys]
//              (None: SDPA's causal flag)
//   lora       None, or the step's LoRA adapters as lora_cpu.cpp's kernel takes them: `slots`
//              [T] (each token's adapter, -1: none), then per layer and projection (7 per
//              layer, in the order of `onednn`) one A, Bt and scale per adapter (None: that
//              adapter does not target the projection)
//   -> [T, hidden]                  the final norm's output (the LM head is the caller's)
//
// Granite's multipliers: the attention scale is `scale`, each residual branch is multiplied by
// `residual_multiplier` before its add (1 for the other models).
//
// decoder_layers_ln: the same for the LayerNorm family (GPT-2, GPT-BigCode, GPT-NeoX):
// per layer LayerNorm -> fused q|k|v projection -> rotary embedding of the first `rotary_dims`
// of each head (GPT-NeoX; the others have learned positions, which the caller adds) ->
// attention -> output projection -> residual add -> LayerNorm -> MLP (fc, GELU, projection) ->
// residual add (GPT-NeoX's parallel residual: both branches from the layer's input, added as
// mlp + attention + input), each step the ATen operation transformers' modules run (so each
// rounds where theirs does), the KV writes and attention as above:
//   params     12 per layer, then the final norm's weight and bias: ln_1 (weight, bias), c_attn,
//              attention c_proj, ln_2, c_fc, MLP c_proj (weight, bias each)
//   onednn     4 per layer: c_attn, attention c_proj, c_fc, MLP c_proj
//   interleaved the fused projection's output per head as [q, k, v] (GPT-NeoX, multi-head
//              GPT-BigCode), else [all q | all k | all v]
//   cos, sin   [T, rotary_dims] with rotary_dims > 0 (GPT-NeoX), else None
//   activation "gelu_new" (GPT-2's formula, op by op), "gelu_pytorch_tanh" or "gelu" (one gelu)
//   lora       as above, with 4 projections per layer in the order of `onednn`
// Built by cpu_kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/quantized/PackedParams.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kParamsPerLayer = 16;
constexpr int64_t kLinearsPerLayer = 7;
constexpr int64_t kFusedPerLayer = 4;  // q|k|v panels and bias, gate|up panels and bias

enum Param : int64_t {
  kInputNorm = 0, kQ = 1, kK = 3, kV = 5, kO = 7, kPostNorm = 9, kGate = 10, kUp = 12, kDown = 14
};  // a linear's bias follows its weight

template <typename T>
inline float f(T x) { return static_cast<float>(x); }

// Rows of elementwise work in parallel where a step has many tokens (prompts); a decode step's
// few rows stay on this thread (a parallel region costs more than they do).
template <typename F>
void each_row(int64_t rows, int64_t row_size, const F& body) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, row_size));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

// residual (+)= delta * multiplier, rounded to T as transformers rounds it; then out = RMS norm of
// residual (float statistics, normalized value rounded to T, times the weight, rounded again).
template <typename T>
void add_norm(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t size, float eps,
              float multiplier) {
  each_row(rows, size, [&](int64_t r) {
    T* x = residual + r * size;
    if (delta != nullptr) {
      const T* d = delta + r * size;
      for (int64_t i = 0; i < size; ++i) {
        const T branch = multiplier == 1.f ? d[i] : static_cast<T>(f(d[i]) * multiplier);
        x[i] = static_cast<T>(f(x[i]) + f(branch));
      }
    }
    float squares = 0.f;
    for (int64_t i = 0; i < size; ++i) squares += f(x[i]) * f(x[i]);
    const float inverse = 1.f / std::sqrt(squares / static_cast<float>(size) + eps);
    T* o = out + r * size;
    for (int64_t i = 0; i < size; ++i) o[i] = static_cast<T>(f(weight[i]) * f(static_cast<T>(f(x[i]) * inverse)));
  });
}

// x [rows, heads, dim] rotated in place: x * cos + rotate_half(x) * sin, each product and the sum
// rounded to T. `stride`: elements from one row to the next (0: heads * dim, rows side by side).
template <typename T>
void rotate(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t dim, int64_t stride = 0) {
  const int64_t half = dim / 2, step = stride > 0 ? stride : heads * dim;
  each_row(rows, heads * dim, [&](int64_t r) {
    float row[512];  // a head's values (head dims up to 512: checked by decoder_layers)
    const T* c = cos + r * dim;
    const T* s = sin + r * dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + r * step + h * dim;
      for (int64_t i = 0; i < dim; ++i) row[i] = f(v[i]);
      for (int64_t i = 0; i < dim; ++i) {
        const float other = i < half ? -row[i + half] : row[i - half];
        v[i] = static_cast<T>(f(static_cast<T>(row[i] * f(c[i]))) + f(static_cast<T>(other * f(s[i]))));
      }
    }
  });
}

// The new K [rows, kv_heads, dim] and V into one layer's cache at `slots` (K blocks transposed).
// `stride`: elements from one row of K (and of V) to the next (0: kv_heads * dim).
template <typename T>
void write_kv(T* cache, const T* key, const T* value, const int64_t* slots, int64_t rows, int64_t kv_heads,
              int64_t num_blocks, int64_t block_size, int64_t dim, int64_t stride = 0) {
  const int64_t head_stride = num_blocks * block_size * dim, step = stride > 0 ? stride : kv_heads * dim;
  T* values = cache + kv_heads * head_stride;
  each_row(rows, kv_heads * dim, [&](int64_t r) {
    const int64_t slot = slots[r], block = slot / block_size, offset = slot % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* k = key + r * step + h * dim;
      const T* v = value + r * step + h * dim;
      T* kb = cache + h * head_stride + block * block_size * dim;  // [dim, block_size]
      for (int64_t i = 0; i < dim; ++i) kb[i * block_size + offset] = k[i];
      T* vb = values + h * head_stride + slot * dim;
      for (int64_t i = 0; i < dim; ++i) vb[i] = v[i];
    }
  });
}

using Int8Weights = c10::intrusive_ptr<LinearPackedParamsBase>;

// quantization/int8.py's Int8Linear.forward: the 8-bit way (its `product`): each token scaled to
// max |x| = 1, the range row appended, torch's dynamic int8 linear, rows scaled back, the float
// bias added, one rounding; the exact way: w8a8_cpu.cpp's w8a8_linear.
struct Int8 {
  const c10::List<std::optional<Int8Weights>>& packed;
  const c10::List<std::optional<at::Tensor>>& exact;
};

at::Tensor int8_linear(const at::Tensor& x, const Int8Weights& packed, const at::Tensor& bounds,
                       const std::optional<at::Tensor>& bias) {
  const at::Tensor tokens = x.to(at::kFloat);
  const at::Tensor top = tokens.abs().amax({1}, true).clamp_min_(std::numeric_limits<float>::min());
  at::Tensor y = packed->apply_dynamic(at::cat({tokens / top, bounds}), false).narrow(0, 0, x.size(0)).mul_(top);
  if (bias.has_value()) y.add_(*bias);
  return y.to(x.scalar_type());
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& ints, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tgis_cpu::w8a8_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&)>();
  return op.call(x, ints, scales, bias);
}

struct Grouped {
  const c10::List<std::optional<at::Tensor>>& packed;
  const c10::List<std::optional<at::Tensor>>& order;
  at::IntArrayRef out;
  int64_t max_rows;
};

// quantization/int4.py's Int4Linear.forward: the input's channels in the layer's order, then
// grouped_cpu.cpp's int4_linear; quantization/int8_groups.py's Int8GroupLinear.forward where the
// weights are int8.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offset,
                          const std::optional<at::Tensor>& order, const std::optional<at::Tensor>& bias,
                          int64_t out_features, int64_t max_rows) {
  const at::Tensor rows = order.has_value() ? x.index_select(1, *order) : x;
  if (packed.scalar_type() == at::kChar) {
    static auto int8_groups = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("tgis_cpu::int8_group_linear", "")
                                  .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                    const std::optional<at::Tensor>&, bool)>();
    return int8_groups.call(rows.contiguous(), packed, scale_offset, packed.size(1) / scale_offset.size(0), bias,
                            true);
  }
  static auto int4 = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("tgis_cpu::int4_linear", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                           const std::optional<at::Tensor>&, int64_t, bool)>();
  const int64_t group = packed.size(1) * 2 / scale_offset.size(0);
  return int4.call(rows.contiguous(), packed, scale_offset, group, out_features, bias, max_rows, true);
}

at::Tensor linear(const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                  bool onednn) {
  if (weight->dim() == 3) {  // weights packed in panels of 16 outputs (panel_cpu.cpp)
    static auto panels = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tgis_cpu::panel_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
    return panels.call(x, *weight, bias);
  }
  if (!onednn) return at::linear(x, *weight, bias);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, *weight, bias, "none", c10::List<std::optional<c10::Scalar>>(), c10::string_view(""));
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& cache, const at::Tensor& tables,
                        const at::Tensor& lengths, int64_t block_size, double scale, int64_t window) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tgis_cpu::paged_decode", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         int64_t, double, int64_t)>();
  return op.call(query, cache, tables, lengths, block_size, scale, window);
}

template <typename T>
T* data(const at::Tensor& t) { return t.data_ptr<T>(); }

// The step's LoRA adapters (see the header); slots undefined: none.
struct Lora {
  std::optional<at::Tensor> slots;
  c10::List<std::optional<at::Tensor>> a, bt;
  std::vector<double> scales;
  int64_t adapters = 0;

  // whether an adapter of the step targets one of projections [first, first + count)
  bool targets(int64_t first, int64_t count) const {
    if (!slots.has_value()) return false;
    for (int64_t i = first * adapters; i < (first + count) * adapters; ++i) {
      if (a.get(i).has_value()) return true;
    }
    return false;
  }

  // y += each token's adapter applied to x, for projection `index` (layer * 7 + which)
  void apply(at::Tensor& y, const at::Tensor& x, int64_t index) const {
    if (!slots.has_value()) return;
    c10::List<std::optional<at::Tensor>> as, bts;
    bool any = false;
    for (int64_t s = 0; s < adapters; ++s) {
      as.push_back(a.get(index * adapters + s));
      bts.push_back(bt.get(index * adapters + s));
      any = any || as.get(s).has_value();
    }
    if (!any) return;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("tgis_cpu::lora_apply", "")
                         .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                     const c10::List<std::optional<at::Tensor>>&,
                                     const c10::List<std::optional<at::Tensor>>&, at::ArrayRef<double>)>();
    op.call(y, x, *slots, 1, as, bts, at::ArrayRef<double>(scales).slice(index * adapters, adapters));
  }
};

// How a step's tokens attend (see the header).
struct Attention {
  std::optional<at::Tensor> decode, tables, lengths;
  std::vector<int64_t> bounds;  // start, end, keys of each piece
  c10::List<std::optional<at::Tensor>> blocks, masks;
  int64_t block_size, window;
  double scale;

  int64_t pieces() const { return static_cast<int64_t>(bounds.size()) / 3; }
};

// K and V of `blocks` of one layer's cache, in order: [kv_heads, blocks * block_size, dim] each
// (paged_kv.PagedKVCache.read_blocks).
std::pair<at::Tensor, at::Tensor> read_blocks(const at::Tensor& cache, const at::Tensor& blocks, int64_t block_size,
                                              int64_t dim) {
  const at::Tensor kv = cache.index_select(2, blocks);
  const int64_t kv_heads = kv.size(1);
  at::Tensor keys = kv[0].view({kv_heads, -1, dim, block_size}).transpose(-1, -2).reshape({kv_heads, -1, dim});
  return {keys, kv[1].view({kv_heads, -1, dim})};
}

// q [T, heads, dim] over the layer's cache (this step's K/V written) -> [T, heads, dim].
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
                  const Attention& a) {
  const int64_t heads = q.size(1), dim = q.size(2), groups = heads / k.size(1);
  if (a.pieces() == 0 && !a.decode.has_value()) {
    return paged_decode(q, cache, *a.tables, *a.lengths, a.block_size, a.scale, a.window);
  }
  at::Tensor out = at::empty_like(q);
  if (a.decode.has_value() && a.decode->numel() > 0) {
    at::Tensor rows = paged_decode(q.index_select(0, *a.decode), cache, *a.tables, *a.lengths, a.block_size, a.scale,
                                   a.window);
    out.index_copy_(0, *a.decode, rows);
  }
  for (int64_t p = 0; p < a.pieces(); ++p) {
    const int64_t start = a.bounds[3 * p], end = a.bounds[3 * p + 1], keys = a.bounds[3 * p + 2];
    const at::Tensor query = q.narrow(0, start, end - start).transpose(0, 1).unsqueeze(0);  // [1, heads, n, dim]
    at::Tensor key, value;
    const std::optional<at::Tensor> blocks = a.blocks.get(p);
    if (blocks.has_value()) {
      auto [all_keys, all_values] = read_blocks(cache, *blocks, a.block_size, dim);
      key = all_keys.narrow(1, 0, keys).unsqueeze(0);
      value = all_values.narrow(1, 0, keys).unsqueeze(0);
    } else {
      key = k.narrow(0, start, end - start).transpose(0, 1).unsqueeze(0);
      value = v.narrow(0, start, end - start).transpose(0, 1).unsqueeze(0);
    }
    const std::optional<at::Tensor> mask = a.masks.get(p);
    at::Tensor attended = at::scaled_dot_product_attention(query, key, value, mask, 0.0, !mask.has_value(), a.scale,
                                                           groups > 1);
    out.narrow(0, start, end - start).copy_(attended[0].transpose(0, 1));
  }
  return out;
}

template <typename T>
at::Tensor run(const at::Tensor& embeddings, const at::Tensor& cos_t, const at::Tensor& sin_t,
               const c10::List<std::optional<at::Tensor>>& params, const std::vector<bool>& onednn,
               const Int8& int8, const Grouped& grouped, const c10::List<std::optional<at::Tensor>>& fused,
               const std::vector<at::Tensor>& caches, const at::Tensor& slots, const Attention& attention,
               const Lora& lora, int64_t heads,
               int64_t kv_heads, double eps, double residual_multiplier) {
  const int64_t rows = embeddings.size(0), size = embeddings.size(1), layers = caches.size();
  const int64_t dim = cos_t.size(1), block_size = attention.block_size;
  const float e = static_cast<float>(eps), m = static_cast<float>(residual_multiplier);
  at::Tensor residual = embeddings.clone();
  at::Tensor normed = at::empty_like(residual);
  at::Tensor delta;  // the last branch's output, added to the residual before the next norm
  auto param = [&](int64_t layer, int64_t index) -> std::optional<at::Tensor> {
    return params.get(layer * kParamsPerLayer + index);
  };
  auto project = [&](const at::Tensor& x, int64_t layer, int64_t index, int64_t which) {
    const int64_t projection = layer * kLinearsPerLayer + which;
    const std::optional<Int8Weights> packed = int8.packed.get(projection);
    const std::optional<at::Tensor> exact = int8.exact.get(projection);
    const std::optional<at::Tensor> in_groups = grouped.packed.get(projection);
    at::Tensor y = (packed.has_value()  ? int8_linear(x, *packed, *param(layer, index), param(layer, index + 1))
                    : exact.has_value() ? w8a8_linear(x, *exact, *param(layer, index), param(layer, index + 1))
                    : in_groups.has_value()
                        ? grouped_linear(x, *in_groups, *param(layer, index), grouped.order.get(projection),
                                         param(layer, index + 1), grouped.out[projection], grouped.max_rows)
                                          : linear(x, param(layer, index), param(layer, index + 1), onednn[projection]))
                       .contiguous();
    lora.apply(y, x, projection);
    return y;
  };
  // the layer's q|k|v (part 0) or gate|up (part 1) panels in one product, where they are fused and
  // no adapter of the step targets them: one parallel region instead of 3 or 2
  auto joined = [&](int64_t layer, int64_t part, int64_t first, int64_t count) -> std::optional<at::Tensor> {
    if (fused.empty()) return std::nullopt;
    const std::optional<at::Tensor> weights = fused.get(layer * kFusedPerLayer + 2 * part);
    if (!weights.has_value() || lora.targets(layer * kLinearsPerLayer + first, count)) return std::nullopt;
    return linear(normed, weights, fused.get(layer * kFusedPerLayer + 2 * part + 1), false);
  };
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
  for (int64_t layer = 0; layer < layers; ++layer) {
    add_norm<T>(data<T>(residual), delta.defined() ? data<T>(delta) : nullptr, data<T>(*param(layer, kInputNorm)),
                data<T>(normed), rows, size, e, m);
    at::Tensor q, k, v;
    int64_t kv_stride = 0;  // rows of K and V side by side
    if (const std::optional<at::Tensor> qkv = joined(layer, 0, 0, 3)) {
      // K and V stay rows of the product (rotated and written from there: no copies at several
      // rows); Q is copied out, the decode attention reads its rows side by side
      q = qkv->narrow(1, 0, q_size).contiguous();
      k = qkv->narrow(1, q_size, kv_size);
      v = qkv->narrow(1, q_size + kv_size, kv_size);
      kv_stride = qkv->stride(0);
    } else {
      q = project(normed, layer, kQ, 0);
      k = project(normed, layer, kK, 1);
      v = project(normed, layer, kV, 2);
    }
    rotate<T>(data<T>(q), data<T>(cos_t), data<T>(sin_t), rows, heads, dim);
    rotate<T>(data<T>(k), data<T>(cos_t), data<T>(sin_t), rows, kv_heads, dim, kv_stride);
    const at::Tensor& cache = caches[layer];
    write_kv<T>(data<T>(cache), data<T>(k), data<T>(v), slots.data_ptr<int64_t>(), rows, kv_heads, cache.size(2),
                block_size, dim, kv_stride);
    at::Tensor attended = attend(q.view({rows, heads, dim}), k.view({rows, kv_heads, dim}),
                                 v.view({rows, kv_heads, dim}), cache, attention);
    delta = project(attended.view({rows, heads * dim}), layer, kO, 3);
    add_norm<T>(data<T>(residual), data<T>(delta), data<T>(*param(layer, kPostNorm)), data<T>(normed), rows, size, e,
                m);
    at::Tensor gate, up;
    if (const std::optional<at::Tensor> gate_up = joined(layer, 1, 4, 2)) {
      const int64_t inner = gate_up->size(1) / 2;
      gate = at::silu(gate_up->narrow(1, 0, inner));  // read from the product's rows, no copy first
      up = gate_up->narrow(1, inner, inner);
    } else {
      gate = project(normed, layer, kGate, 4);
      at::silu_(gate);
      up = project(normed, layer, kUp, 5);
    }
    gate.mul_(up);  // transformers' act_fn(gate) * up: the same two roundings
    delta = project(gate, layer, kDown, 6);
  }
  add_norm<T>(data<T>(residual), data<T>(delta), data<T>(*params.get(layers * kParamsPerLayer)), data<T>(normed), rows,
              size, e, m);
  return normed;
}

constexpr int64_t kLnParamsPerLayer = 12;
constexpr int64_t kLnLinearsPerLayer = 4;

// transformers' NewGELUActivation ("gelu_new"), op by op (each rounds to the input's dtype), or
// one gelu ("gelu_pytorch_tanh": the tanh approximation; "gelu": erf).
at::Tensor activate(const at::Tensor& x, c10::string_view activation) {
  if (activation == "gelu") return at::gelu(x);
  if (activation == "gelu_pytorch_tanh") return at::gelu(x, "tanh");
  const at::Tensor inner = at::mul(at::add(x, at::mul(at::pow(x, 3.0), 0.044715)), std::sqrt(2.0 / M_PI));
  return at::mul(at::mul(x, 0.5), at::add(at::tanh(inner), 1.0));
}

// GPT-NeoX's apply_rotary_pos_emb on x [rows, heads, dim]: its first cos.size(-1) values rotated
// (x * cos + rotate_half(x) * sin), the rest passed through.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rotated = cos.size(-1), half = rotated / 2;
  const at::Tensor part = x.narrow(-1, 0, rotated);
  const at::Tensor turned = at::cat({at::neg(part.narrow(-1, half, half)), part.narrow(-1, 0, half)}, -1);
  const at::Tensor embedded = at::add(at::mul(part, cos), at::mul(turned, sin));
  return at::cat({embedded, x.narrow(-1, rotated, x.size(-1) - rotated)}, -1);
}

struct LnShape {
  bool interleaved, parallel;
  c10::string_view activation;
  std::optional<at::Tensor> cos, sin;  // [rows, 1, rotary_dims]
};

template <typename T>
at::Tensor run_ln(const at::Tensor& embeddings, const c10::List<std::optional<at::Tensor>>& params,
                  const std::vector<bool>& onednn, const LnShape& shape, const std::vector<at::Tensor>& caches,
                  const at::Tensor& slots, const Attention& attention, const Lora& lora, int64_t heads,
                  int64_t kv_heads, double eps) {
  const int64_t rows = embeddings.size(0), size = embeddings.size(1), layers = caches.size();
  const int64_t dim = size / heads, kv_size = kv_heads * dim, block_size = attention.block_size;
  auto param = [&](int64_t index) -> at::Tensor { return *params.get(index); };
  auto norm = [&](const at::Tensor& x, int64_t index) {
    return at::layer_norm(x, {size}, param(index), param(index + 1), eps);
  };
  auto project = [&](const at::Tensor& x, int64_t layer, int64_t index, int64_t which) {
    const int64_t first = layer * kLnParamsPerLayer + index, projection = layer * kLnLinearsPerLayer + which;
    at::Tensor y = linear(x, params.get(first), params.get(first + 1), onednn[projection]).contiguous();
    lora.apply(y, x, projection);
    return y;
  };
  auto mlp = [&](const at::Tensor& x, int64_t layer) {  // LayerNorm -> fc -> GELU -> projection
    const at::Tensor up = project(norm(x, layer * kLnParamsPerLayer + 6), layer, 8, 2);
    return project(activate(up, shape.activation), layer, 10, 3);
  };
  at::Tensor hidden = embeddings;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t base = layer * kLnParamsPerLayer;
    const at::Tensor qkv = project(norm(hidden, base), layer, 2, 0);
    at::Tensor q, k, v;
    if (shape.interleaved) {  // [rows, heads, 3 * dim]: each head's q, k, v
      const at::Tensor per_head = qkv.view({rows, heads, 3 * dim});
      q = per_head.narrow(2, 0, dim), k = per_head.narrow(2, dim, dim), v = per_head.narrow(2, 2 * dim, dim);
    } else {
      q = qkv.narrow(1, 0, size).view({rows, heads, dim});
      k = qkv.narrow(1, size, kv_size).view({rows, kv_heads, dim});
      v = qkv.narrow(1, size + kv_size, kv_size).view({rows, kv_heads, dim});
    }
    if (shape.cos.has_value()) {
      q = rotary(q, *shape.cos, *shape.sin);
      k = rotary(k, *shape.cos, *shape.sin);
    }
    q = q.contiguous(), k = k.contiguous(), v = v.contiguous();
    const at::Tensor& cache = caches[layer];
    write_kv<T>(data<T>(cache), data<T>(k), data<T>(v), slots.data_ptr<int64_t>(), rows, kv_heads, cache.size(2),
                block_size, dim);
    const at::Tensor attended = attend(q, k, v, cache, attention);
    const at::Tensor branch = project(attended.view({rows, size}), layer, 4, 1);
    if (shape.parallel) {  // GPT-NeoX: mlp_output + attn_output + hidden_states
      hidden = at::add(at::add(mlp(hidden, layer), branch), hidden);
    } else {
      hidden = at::add(branch, hidden);  // attn_output + residual
      hidden = at::add(hidden, mlp(hidden, layer));  // residual + feed_forward_hidden_states
    }
  }
  return norm(hidden, layers * kLnParamsPerLayer);
}

// The step's LoRA adapters, checked (both ops).
Lora lora_of(int64_t rows, int64_t projections, const std::optional<at::Tensor>& slots,
             const c10::List<std::optional<at::Tensor>>& a, const c10::List<std::optional<at::Tensor>>& bt,
             at::ArrayRef<double> scales) {
  Lora lora{slots, a, bt, scales.vec()};
  if (slots.has_value()) {
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->numel() == rows, "one int64 LoRA slot per token");
    TORCH_CHECK(projections > 0 && static_cast<int64_t>(a.size()) % projections == 0 && bt.size() == a.size() &&
                    scales.size() == a.size(),
                "one LoRA A, Bt and scale per projection and adapter");
    lora.adapters = static_cast<int64_t>(a.size()) / projections;
  }
  return lora;
}

// The checks and the attention plan both ops share.
Attention attention_of(int64_t rows, at::TensorList caches, int64_t kv_heads, int64_t head_dim,
                       const at::Tensor& slots, const std::optional<at::Tensor>& decode,
                       const std::optional<at::Tensor>& tables, const std::optional<at::Tensor>& lengths,
                       at::IntArrayRef piece_bounds, const c10::List<std::optional<at::Tensor>>& piece_blocks,
                       const c10::List<std::optional<at::Tensor>>& piece_masks, int64_t block_size, double scale,
                       int64_t window, at::ScalarType dtype) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == rows, "one int64 slot per token");
  for (const at::Tensor& cache : caches) {
    TORCH_CHECK(cache.dim() == 4 && cache.size(1) == kv_heads && cache.size(3) == block_size * head_dim &&
                    cache.is_contiguous() && cache.scalar_type() == dtype,
                "each cache must be [2, kv_heads, blocks, block_size * head_dim], contiguous, the embeddings' dtype");
  }
  const int64_t pieces = static_cast<int64_t>(piece_bounds.size()) / 3;
  TORCH_CHECK(static_cast<int64_t>(piece_bounds.size()) == 3 * pieces &&
                  static_cast<int64_t>(piece_blocks.size()) == pieces && static_cast<int64_t>(piece_masks.size()) == pieces,
              "three bounds, a block table and a mask per piece");
  for (int64_t p = 0; p < pieces; ++p) {
    const int64_t start = piece_bounds[3 * p], end = piece_bounds[3 * p + 1];
    TORCH_CHECK(0 <= start && start < end && end <= rows, "a piece's tokens must lie in the step");
  }
  const bool any_decode = decode.has_value() ? decode->numel() > 0 : pieces == 0;
  TORCH_CHECK(!any_decode || (tables.has_value() && lengths.has_value()), "decode rows need tables and lengths");
  TORCH_CHECK(decode.has_value() || pieces == 0, "a step with pieces names its decode rows");
  return Attention{decode, tables, lengths, piece_bounds.vec(), piece_blocks, piece_masks, block_size, window, scale};
}

template <typename F>
at::Tensor by_dtype(at::ScalarType dtype, const char* op, const F& typed) {
  switch (dtype) {
    case at::kFloat:
      return typed(static_cast<float*>(nullptr));
    case at::kBFloat16:
      return typed(static_cast<c10::BFloat16*>(nullptr));
    case at::kHalf:
      return typed(static_cast<c10::Half*>(nullptr));
    default:
      TORCH_CHECK(false, op, ": float32, bfloat16 or float16, not ", dtype);
  }
}

at::Tensor decoder_layers_ln(const at::Tensor& embeddings, const c10::List<std::optional<at::Tensor>>& params,
                             c10::List<bool> onednn, bool interleaved, bool parallel_residual,
                             const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                             at::TensorList caches, const at::Tensor& slots,
                             const std::optional<at::Tensor>& decode, const std::optional<at::Tensor>& tables,
                             const std::optional<at::Tensor>& lengths, at::IntArrayRef piece_bounds,
                             const c10::List<std::optional<at::Tensor>>& piece_blocks,
                             const c10::List<std::optional<at::Tensor>>& piece_masks,
                             const std::optional<at::Tensor>& lora_slots,
                             const c10::List<std::optional<at::Tensor>>& lora_a,
                             const c10::List<std::optional<at::Tensor>>& lora_bt, at::ArrayRef<double> lora_scales,
                             int64_t block_size, int64_t heads, int64_t kv_heads, double eps, double scale,
                             int64_t window, c10::string_view activation) {
  const int64_t layers = caches.size();
  TORCH_CHECK(static_cast<int64_t>(params.size()) == layers * kLnParamsPerLayer + 2, "12 parameters per layer + 2");
  TORCH_CHECK(static_cast<int64_t>(onednn.size()) == layers * kLnLinearsPerLayer, "4 layout flags per layer");
  TORCH_CHECK(embeddings.dim() == 2 && embeddings.is_contiguous(), "embeddings must be [tokens, hidden], contiguous");
  TORCH_CHECK(heads > 0 && embeddings.size(1) % heads == 0, "the hidden size must be heads * head_dim");
  TORCH_CHECK(activation == "gelu_new" || activation == "gelu_pytorch_tanh" || activation == "gelu",
              "activation: gelu_new, gelu_pytorch_tanh or gelu");
  for (int64_t i = 0; i < static_cast<int64_t>(params.size()); ++i) TORCH_CHECK(params.get(i).has_value(), "every parameter");
  const int64_t rows = embeddings.size(0);
  const Attention attention = attention_of(rows, caches, kv_heads, embeddings.size(1) / heads, slots, decode, tables,
                                           lengths, piece_bounds, piece_blocks, piece_masks, block_size, scale, window,
                                           embeddings.scalar_type());
  std::vector<bool> flags(onednn.begin(), onednn.end());
  std::vector<at::Tensor> layer_caches(caches.begin(), caches.end());
  const at::Tensor slot_ids = slots.contiguous();
  LnShape shape{interleaved, parallel_residual, activation, std::nullopt, std::nullopt};
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin together");
  if (cos.has_value()) {
    const int64_t dim = embeddings.size(1) / heads;
    TORCH_CHECK(cos->dim() == 2 && cos->size(0) == rows && sin->sizes() == cos->sizes() && cos->size(1) % 2 == 0 &&
                    cos->size(1) <= dim && cos->scalar_type() == embeddings.scalar_type() &&
                    sin->scalar_type() == embeddings.scalar_type(),
                "cos/sin must be [tokens, even rotary dims <= head_dim], the embeddings' dtype");
    shape.cos = cos->unsqueeze(1);
    shape.sin = sin->unsqueeze(1);
  }
  TORCH_CHECK(!interleaved || kv_heads == heads, "q/k/v interleaved per head needs as many KV heads as heads");
  const Lora lora = lora_of(rows, layers * kLnLinearsPerLayer, lora_slots, lora_a, lora_bt, lora_scales);
  return by_dtype(embeddings.scalar_type(), "decoder_layers_ln", [&](auto* dtype) {
    using T = std::remove_pointer_t<decltype(dtype)>;
    return run_ln<T>(embeddings, params, flags, shape, layer_caches, slot_ids, attention, lora, heads, kv_heads, eps);
  });
}

at::Tensor decoder_layers(const at::Tensor& embeddings, const at::Tensor& cos, const at::Tensor& sin,
                          const c10::List<std::optional<at::Tensor>>& params, c10::List<bool> onednn,
                          const c10::List<std::optional<Int8Weights>>& int8,
                          const c10::List<std::optional<at::Tensor>>& w8a8,
                          const c10::List<std::optional<at::Tensor>>& grouped,
                          const c10::List<std::optional<at::Tensor>>& grouped_order, at::IntArrayRef grouped_out,
                          int64_t int4_max_rows, const c10::List<std::optional<at::Tensor>>& fused,
                          at::TensorList caches,
                          const at::Tensor& slots, const std::optional<at::Tensor>& decode,
                          const std::optional<at::Tensor>& tables, const std::optional<at::Tensor>& lengths,
                          at::IntArrayRef piece_bounds, const c10::List<std::optional<at::Tensor>>& piece_blocks,
                          const c10::List<std::optional<at::Tensor>>& piece_masks,
                          const std::optional<at::Tensor>& lora_slots,
                          const c10::List<std::optional<at::Tensor>>& lora_a,
                          const c10::List<std::optional<at::Tensor>>& lora_bt, at::ArrayRef<double> lora_scales,
                          int64_t block_size, int64_t heads, int64_t kv_heads, double eps, double scale,
                          double residual_multiplier, int64_t window) {
  const int64_t layers = caches.size();
  TORCH_CHECK(static_cast<int64_t>(params.size()) == layers * kParamsPerLayer + 1, "16 parameters per layer + 1");
  TORCH_CHECK(static_cast<int64_t>(onednn.size()) == layers * kLinearsPerLayer, "7 layout flags per layer");
  TORCH_CHECK(static_cast<int64_t>(int8.size()) == layers * kLinearsPerLayer && w8a8.size() == int8.size(),
              "7 int8 and w8a8 entries per layer");
  TORCH_CHECK(static_cast<int64_t>(grouped.size()) == layers * kLinearsPerLayer && grouped_order.size() == grouped.size() &&
                  grouped_out.size() == grouped.size(),
              "7 grouped entries, orders and output sizes per layer");
  TORCH_CHECK(fused.empty() || static_cast<int64_t>(fused.size()) == layers * kFusedPerLayer,
              "no fused projections or 4 entries per layer");
  TORCH_CHECK(embeddings.dim() == 2 && embeddings.is_contiguous(), "embeddings must be [tokens, hidden], contiguous");
  const int64_t rows = embeddings.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && sin.sizes() == cos.sizes(), "cos/sin must be [tokens, head_dim]");
  TORCH_CHECK(cos.size(1) % 2 == 0 && cos.size(1) <= 512, "the head dim must be even, at most 512");
  TORCH_CHECK(cos.scalar_type() == embeddings.scalar_type() && sin.scalar_type() == embeddings.scalar_type(),
              "cos/sin must have the embeddings' dtype");
  for (int64_t i = 0; i < static_cast<int64_t>(fused.size()); i += 2) {
    const std::optional<at::Tensor> panels = fused.get(i);
    if (!panels.has_value()) continue;
    const int64_t outputs = panels->dim() == 3 ? panels->size(0) * panels->size(2) : -1;
    const int64_t head_dim = cos.size(1);
    TORCH_CHECK(i % kFusedPerLayer == 0 ? outputs == (heads + 2 * kv_heads) * head_dim : outputs % 2 == 0,
                "fused panels must hold q|k|v or gate|up, outputs side by side");
  }
  const Attention attention = attention_of(rows, caches, kv_heads, cos.size(1), slots, decode, tables, lengths,
                                           piece_bounds, piece_blocks, piece_masks, block_size, scale, window,
                                           embeddings.scalar_type());
  std::vector<bool> flags(onednn.begin(), onednn.end());
  std::vector<at::Tensor> layer_caches(caches.begin(), caches.end());
  const Lora lora = lora_of(rows, layers * kLinearsPerLayer, lora_slots, lora_a, lora_bt, lora_scales);
  const at::Tensor c = cos.contiguous(), s = sin.contiguous(), slot_ids = slots.contiguous();
  return by_dtype(embeddings.scalar_type(), "decoder_layers", [&](auto* dtype) {
    using T = std::remove_pointer_t<decltype(dtype)>;
    return run<T>(embeddings, c, s, params, flags, Int8{int8, w8a8}, Grouped{grouped, grouped_order, grouped_out, int4_max_rows}, fused, layer_caches,
                  slot_ids, attention, lora, heads, kv_heads, eps, residual_multiplier);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgis_cpu, m) {
  m.def(
      "decoder_layers(Tensor embeddings, Tensor cos, Tensor sin, Tensor?[] params, bool[] onednn, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase?[] int8, Tensor?[] w8a8, Tensor?[] grouped, Tensor?[] grouped_order, "
      "int[] grouped_out, int int4_max_rows, Tensor?[] fused, Tensor[] caches, "
      "Tensor slots, Tensor? decode, Tensor? tables, Tensor? lengths, int[] piece_bounds, Tensor?[] piece_blocks, "
      "Tensor?[] piece_masks, Tensor? lora_slots, Tensor?[] lora_a, Tensor?[] lora_bt, float[] lora_scales, "
      "int block_size, int heads, int kv_heads, float eps, float scale, "
      "float residual_multiplier, int window) -> Tensor");
  m.def(
      "decoder_layers_ln(Tensor embeddings, Tensor?[] params, bool[] onednn, bool interleaved, "
      "bool parallel_residual, Tensor? cos, Tensor? sin, Tensor[] caches, "
      "Tensor slots, Tensor? decode, Tensor? tables, Tensor? lengths, int[] piece_bounds, Tensor?[] piece_blocks, "
      "Tensor?[] piece_masks, Tensor? lora_slots, Tensor?[] lora_a, Tensor?[] lora_bt, float[] lora_scales, "
      "int block_size, int heads, int kv_heads, float eps, float scale, int window, str activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) {
  m.impl("decoder_layers", &decoder_layers);
  m.impl("decoder_layers_ln", &decoder_layers_ln);
}
// oneDNN packed weights are MkldnnCPU tensors: a call holding one dispatches here
TORCH_LIBRARY_IMPL(tgis_cpu, MkldnnCPU, m) {
  m.impl("decoder_layers", &decoder_layers);
  m.impl("decoder_layers_ln", &decoder_layers_ln);
}
