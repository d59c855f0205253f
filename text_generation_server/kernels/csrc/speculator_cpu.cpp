// IBM's MLP speculator's top-1 chain on CPU (speculation/mlp.py MlpSpeculatorModel.chain) in one
// call: for each head i, with s the state (the target's final hidden state, then each head's)
// and t the token before the one head i guesses (the target's last token, then each guess),
//
//   s = gelu(ln_i(proj_i s * state_weight + emb_i[t] * emb_weight))      t = argmax_v head_i[v] . s
//
// For few rows the vocabulary projection never leaves the registers: each weight row's dot
// products with the rows' states go straight into a running maximum per row and thread, so a head
// costs one pass over its weights (the tensor form writes the logits, reads them back for the
// argmax, and pays a parallel region for each of its ~10 small operations); from kMatmulRows rows
// on AMX CPUs, one matrix product and the argmax of its logits. States are float between the
// operations (bfloat16, rounded, where the dot products take bfloat16); sums in another order
// than a matmul's: a near-tie may resolve to another token than the tensor form's, which only
// changes a guess (the target checks every one).
//
//   state        [rows, emb] the target's final hidden states (the weights' dtype)
//   last         [rows] int64
//   proj         per head [inner, emb or inner];  emb, head: per head [vocab, inner]; a head may
//                instead be panels [vocab / 16, inner, 16] (panel_cpu.cpp's panel_pack): the
//                target's own LM head where the head's weights are its values (a self-distilled
//                speculator's frozen copy). Its logits are then the LM head's product, rounded to
//                the weights' dtype as the target's are, from memory the step before just read
//                (the panel product, then the first maximum; 3 tied heads of 8,192 x 512,
//                bfloat16, one state, 2-core Zen 4, each chain after a 48 MB sweep and the LM
//                head's 4-row product: 286-292 us against 427-467 us over a copy of their own)
//   ln_weight, ln_bias   per head [inner]
//   scale_input  normalise the input state first (fms-extras' ln0, no affine) and divide by sqrt 2
//   -> [rows, steps] int64 (steps <= heads)
//
// Built with the other CPU kernels by text_generation_server/kernels/cpu_kernels.py as
// torch.ops.tgis_cpu.mlp_speculator_chain.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "float_vectors.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace tgis_cpu;

constexpr int64_t kRowBlock = 4;  // states whose dot products share one load of a weight chunk
constexpr int64_t kCols = 4;      // weight rows in flight (independent sums: the FMAs pipeline)
// ... for one state (a decode row's chain): 8 sums hide the dot product's latency (3 heads of
// 8,192 x 512, bfloat16, 2-core Zen 4, against 3 panel products as a control timed beside it:
// 0.83x -> 0.73x of it warm, 1.22x -> 0.95-0.97x with the caches swept first)
constexpr int64_t kColsAlone = 8;
constexpr float kEps = 1e-6f;

// From this many rows the vocabulary projection is one matrix product (at::linear: on AMX's tile
// unit for bf16, oneMKL for float32) and an argmax over its logits: the vector dot products become
// bound by arithmetic there (measured for bf16, 8,192 x 512 head, 2-core AMX Xeon: 8 rows 0.61 vs
// 0.56 ms, 16 rows 1.16 vs 0.70 ms per head). Without AMX the vector path serves every row count.
#if defined(__AMX_BF16__)
constexpr int64_t kMatmulRows = 8;
#else
constexpr int64_t kMatmulRows = std::numeric_limits<int64_t>::max();
#endif

// bfloat16 weights and states on AVX512-BF16: 32 products per instruction from the stored
// halves, no conversion (the generic path widens each 16 values to float first)
#if defined(__AVX512BF16__)
constexpr bool kBf16Dots = true;
#else
constexpr bool kBf16Dots = false;
#endif

// dot[c * kRowBlock + r] = weight[c] . states[r] for kColumns weight rows (in apart) and kCount
// states (in: a multiple of kLanes, of 2 * kLanes for bfloat16 states); the sums stay in
// registers as both counts are known at compile time. S: float, or bfloat16 (kBf16Dots only).
// Float states go in vectors of the native width: with 16-lane ones AVX2 code moved the sums
// through the stack (3 heads of 8,192 x 512, float32, 2-core AVX2 EPYC: 1 / 4 / 16 rows 4.8 /
// 14.1 / 53.8 ms, now 2.9 / 3.7 / 14.9 ms).
template <int64_t kColumns, int64_t kCount, typename T, typename S>
void dots_of(const T* weight, const S* states, int64_t in, float* dot) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    __m512 acc[kColumns][kCount];
    for (int64_t c = 0; c < kColumns; ++c) {
      for (int64_t r = 0; r < kCount; ++r) acc[c][r] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < in; k += 2 * kLanes) {
      __m512bh x[kCount];
      for (int64_t r = 0; r < kCount; ++r) x[r] = (__m512bh)_mm512_loadu_si512(states + r * in + k);
      for (int64_t c = 0; c < kColumns; ++c) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(weight + c * in + k);
        for (int64_t r = 0; r < kCount; ++r) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], w, x[r]);
      }
    }
    for (int64_t c = 0; c < kColumns; ++c) {
      for (int64_t r = 0; r < kCount; ++r) dot[c * kRowBlock + r] = _mm512_reduce_add_ps(acc[c][r]);
    }
    return;
  }
#endif
  if constexpr (std::is_same_v<S, float>) {  // vectors of the native width (float_vectors.h)
    vn acc[kColumns][kCount] = {};
    for (int64_t k = 0; k < in; k += kNative) {
      vn x[kCount];
      for (int64_t r = 0; r < kCount; ++r) x[r] = load_native(states + r * in + k);
      for (int64_t c = 0; c < kColumns; ++c) {
        const vn w = load_native(weight + c * in + k);
        for (int64_t r = 0; r < kCount; ++r) acc[c][r] += w * x[r];
      }
    }
    for (int64_t c = 0; c < kColumns; ++c) {
      for (int64_t r = 0; r < kCount; ++r) dot[c * kRowBlock + r] = sum_native(acc[c][r]);
    }
  }
}

template <int64_t kColumns, typename T, typename S>
void dots(const T* weight, const S* states, int64_t count, int64_t in, float* dot) {
  switch (count) {
    case 1: return dots_of<kColumns, 1>(weight, states, in, dot);
    case 2: return dots_of<kColumns, 2>(weight, states, in, dot);
    case 3: return dots_of<kColumns, 3>(weight, states, in, dot);
    default: return dots_of<kColumns, kRowBlock>(weight, states, in, dot);
  }
}

// fn(o, r0, count, dot) for weight rows o from `o`, kColumns at a time while they fill kColumns
// before `end`, with dot[c * kRowBlock + r] = weight[o + c] . states[r0 + r]; returns the first
// row left
template <int64_t kColumns, typename T, typename S, typename Fn>
int64_t dots_by(const T* weight, int64_t o, int64_t end, int64_t in, const S* states, int64_t r0, int64_t count,
                float* dot, Fn& fn) {
  for (; o + kColumns <= end; o += kColumns) {
    dots<kColumns>(weight + o * in, states + r0 * in, count, in, dot);
    for (int64_t c = 0; c < kColumns; ++c) fn(o + c, r0, count, dot + c * kRowBlock);
  }
  return o;
}

// fn(o, r0, count, dot) for every weight row o of [begin, end) and each block of up to kRowBlock
// states from r0: dot[r] = weight[o] . states[r0 + r]; kCols weight rows at a time (kColsAlone
// for a single state), the rows left one by one
template <typename T, typename S, typename Fn>
void for_dots(const T* weight, int64_t begin, int64_t end, int64_t in, const S* states, int64_t rows, Fn fn) {
  float dot[kColsAlone * kRowBlock];
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int64_t count = std::min(kRowBlock, rows - r0);
    int64_t o = begin;
    if (count == 1) o = dots_by<kColsAlone>(weight, o, end, in, states, r0, count, dot, fn);
    o = dots_by<kCols>(weight, o, end, in, states, r0, count, dot, fn);
    dots_by<1>(weight, o, end, in, states, r0, count, dot, fn);
  }
}

// out [rows, out_size] = states [rows, in] . weight [out_size, in]^T
template <typename T, typename S>
void project(const T* weight, int64_t out_size, int64_t in, const S* states, int64_t rows, float* out) {
  at::parallel_for(0, out_size, 64, [&](int64_t begin, int64_t end) {
    for_dots(weight, begin, end, in, states, rows, [&](int64_t o, int64_t r0, int64_t count, const float* dot) {
      for (int64_t r = 0; r < count; ++r) out[(r0 + r) * out_size + o] = dot[r];
    });
  });
}

// best[r] = argmax_v head[v] . states[r] (the first of equal maxima)
template <typename T, typename S>
void argmax_rows(const T* head, int64_t vocab, int64_t in, const S* states, int64_t rows, int64_t* best) {
  const int64_t threads = at::get_num_threads();
  std::vector<float> top(threads * rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> where(threads * rows, vocab);
  at::parallel_for(0, vocab, 256, [&](int64_t begin, int64_t end) {
    float* my_top = top.data() + at::get_thread_num() * rows;
    int64_t* my_where = where.data() + at::get_thread_num() * rows;
    for_dots(head, begin, end, in, states, rows, [&](int64_t v, int64_t r0, int64_t count, const float* dot) {
      for (int64_t r = 0; r < count; ++r) {
        if (dot[r] > my_top[r0 + r] || (dot[r] == my_top[r0 + r] && v < my_where[r0 + r])) {
          my_top[r0 + r] = dot[r];
          my_where[r0 + r] = v;
        }
      }
    });
  });
  for (int64_t r = 0; r < rows; ++r) {
    float value = -std::numeric_limits<float>::infinity();
    int64_t index = vocab;
    for (int64_t t = 0; t < threads; ++t) {
      const float v = top[t * rows + r];
      const int64_t i = where[t * rows + r];
      if (v > value || (v == value && i < index)) value = v, index = i;
    }
    best[r] = index < vocab ? index : 0;  // every score NaN: any guess is as good
  }
}

// best[r] = the first maximum of logits [rows, vocab] (T: the panel product's dtype, float32 or
// bfloat16)
template <typename T>
void argmax_logits(const at::Tensor& logits, int64_t rows, int64_t* best) {
  const int64_t vocab = logits.size(1);
  const T* values = logits.data_ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    float top = -std::numeric_limits<float>::infinity();
    int64_t where = 0;  // every score NaN: any guess is as good
    for (int64_t v = 0; v < vocab; ++v) {
      const float x = static_cast<float>(values[r * vocab + v]);
      if (x > top) top = x, where = v;
    }
    best[r] = where;
  }
}

// logits = x [rows, inner] . the panels of one head (tgis_cpu::panel_linear)
at::Tensor panel_logits(const at::Tensor& x, const at::Tensor& panels) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tgis_cpu::panel_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(x, panels, std::nullopt);
}

void rms_norm(float* x, int64_t size, const float* weight, const float* bias) {
  float squares = 0.f;
  for (int64_t k = 0; k < size; ++k) squares += x[k] * x[k];
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(size) + kEps);
  for (int64_t k = 0; k < size; ++k) {
    x[k] *= scale;
    if (weight != nullptr) x[k] = x[k] * weight[k] + bias[k];
  }
}

// s (S: float or bfloat16, rounded to nearest even) = x (float), `count` values
template <typename S>
void keep(const float* x, int64_t count, S* s) {
  for (int64_t k = 0; k < count; ++k) s[k] = static_cast<S>(x[k]);
}

template <typename T, typename S>
at::Tensor chain(const at::Tensor& state, const at::Tensor& last, at::TensorList proj, at::TensorList emb,
                 at::TensorList ln_weight, at::TensorList ln_bias, at::TensorList head, float state_weight,
                 float emb_weight, bool scale_input, int64_t steps) {
  const int64_t rows = state.size(0), emb_dim = state.size(1), inner = proj[0].size(0);
  const int64_t vocab = head[0].dim() == 3 ? head[0].size(0) * head[0].size(2) : head[0].size(0);
  const at::Tensor input = state.to(at::kFloat).contiguous();
  std::vector<float> u(rows * std::max(emb_dim, inner));
  std::copy_n(input.data_ptr<float>(), rows * emb_dim, u.data());
  if (scale_input) {
    for (int64_t r = 0; r < rows; ++r) {
      float* x = u.data() + r * emb_dim;
      rms_norm(x, emb_dim, nullptr, nullptr);
      for (int64_t k = 0; k < emb_dim; ++k) x[k] /= std::sqrt(2.f);
    }
  }
  std::vector<S> s(u.size());
  keep(u.data(), rows * emb_dim, s.data());
  at::Tensor out = at::empty({rows, steps}, last.options().dtype(at::kLong));
  int64_t* chains = out.data_ptr<int64_t>();
  const at::Tensor first = last.contiguous();
  std::vector<int64_t> tokens(first.data_ptr<int64_t>(), first.data_ptr<int64_t>() + rows), guess(rows);
  for (const int64_t t : tokens) {
    TORCH_CHECK(t >= 0 && t < vocab, "mlp_speculator_chain: token ", t, " is not in the vocabulary");
  }
  int64_t width = emb_dim;
  for (int64_t i = 0; i < steps; ++i) {
    const at::Tensor w = ln_weight[i].to(at::kFloat).contiguous(), b = ln_bias[i].to(at::kFloat).contiguous();
    project(proj[i].data_ptr<T>(), inner, width, s.data(), rows, u.data());
    const T* table = emb[i].data_ptr<T>();
    for (int64_t r = 0; r < rows; ++r) {
      float* x = u.data() + r * inner;
      const T* z = table + tokens[r] * inner;
      for (int64_t k = 0; k < inner; ++k) x[k] = x[k] * state_weight + scalar(z[k]) * emb_weight;
      rms_norm(x, inner, w.data_ptr<float>(), b.data_ptr<float>());
      for (int64_t k = 0; k < inner; ++k) x[k] = 0.5f * x[k] * (1.f + std::erf(x[k] * static_cast<float>(M_SQRT1_2)));
    }
    keep(u.data(), rows * inner, s.data());
    width = inner;
    // the states as a tensor of the head's dtype, for the products below that take tensors
    const auto states = [&] {
      return at::from_blob(s.data(), {rows, inner}, at::CPU(c10::CppTypeToScalarType<S>::value))
          .to(head[i].scalar_type());
    };
    if (head[i].dim() == 3) {  // the target's LM head, in panels
      const at::Tensor logits = panel_logits(states(), head[i]);
      if (logits.scalar_type() == at::kFloat) {
        argmax_logits<float>(logits, rows, guess.data());
      } else {
        argmax_logits<c10::BFloat16>(logits, rows, guess.data());
      }
    } else if (rows >= kMatmulRows) {  // the tile unit's product, then the argmax of its logits
      const at::Tensor best = at::linear(states(), head[i]).argmax(1).contiguous();
      std::copy_n(best.data_ptr<int64_t>(), rows, guess.data());
    } else {
      argmax_rows(head[i].data_ptr<T>(), vocab, inner, s.data(), rows, guess.data());
    }
    for (int64_t r = 0; r < rows; ++r) chains[r * steps + i] = guess[r];
    tokens = guess;
  }
  return out;
}

at::Tensor mlp_speculator_chain(const at::Tensor& state, const at::Tensor& last, at::TensorList proj,
                                at::TensorList emb, at::TensorList ln_weight, at::TensorList ln_bias,
                                at::TensorList head, double state_weight, double emb_weight, bool scale_input,
                                int64_t steps) {
  TORCH_CHECK(steps >= 1 && steps <= static_cast<int64_t>(proj.size()), "mlp_speculator_chain: steps must be 1..",
              proj.size());
  for (const auto* list : {&proj, &emb, &head}) {
    for (const at::Tensor& t : *list) {
      TORCH_CHECK(t.is_contiguous() && t.scalar_type() == state.scalar_type(),
                  "mlp_speculator_chain: weights must be contiguous and of the state's dtype");
    }
  }
  const int64_t emb_dim = state.size(1), inner = proj[0].size(0);
  for (const at::Tensor& t : head) {
    TORCH_CHECK(t.dim() == 2 ? t.size(1) == inner : t.dim() == 3 && t.size(1) == inner && t.size(2) == 16,
                "mlp_speculator_chain: a head is [vocab, inner] or panels [vocab / 16, inner, 16]");
  }
  TORCH_CHECK(emb_dim % kLanes == 0 && inner % kLanes == 0, "mlp_speculator_chain: sizes must be multiples of ",
              kLanes);
  const auto sw = static_cast<float>(state_weight), ew = static_cast<float>(emb_weight);
  switch (state.scalar_type()) {
    case at::kFloat:
      return chain<float, float>(state, last, proj, emb, ln_weight, ln_bias, head, sw, ew, scale_input, steps);
    case at::kBFloat16:
      if (kBf16Dots && emb_dim % (2 * kLanes) == 0 && inner % (2 * kLanes) == 0) {
        return chain<c10::BFloat16, c10::BFloat16>(state, last, proj, emb, ln_weight, ln_bias, head, sw, ew,
                                                   scale_input, steps);
      }
      return chain<c10::BFloat16, float>(state, last, proj, emb, ln_weight, ln_bias, head, sw, ew, scale_input,
                                         steps);
    case at::kHalf:
      return chain<c10::Half, float>(state, last, proj, emb, ln_weight, ln_bias, head, sw, ew, scale_input, steps);
    default:
      TORCH_CHECK(false, "mlp_speculator_chain: unsupported dtype ", state.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgis_cpu, m) {
  m.def(
      "mlp_speculator_chain(Tensor state, Tensor last, Tensor[] proj, Tensor[] emb, Tensor[] ln_weight, "
      "Tensor[] ln_bias, Tensor[] head, float state_weight, float emb_weight, bool scale_input, int steps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) { m.impl("mlp_speculator_chain", &mlp_speculator_chain); }
