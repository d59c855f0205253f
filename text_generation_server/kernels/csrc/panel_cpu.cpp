// float32 and bfloat16 linears over weights packed in panels of 16 output channels, for AVX2 +
// FMA CPUs (weight_layout.py's `panels` layout, chosen where it measures fastest).
//
// panel_pack(weight [out, in] float32 or bfloat16, out a multiple of 16) -> panels
//   [out / 16, in, 16] of its dtype: panel p holds output channels 16p .. 16p + 15, input channel
//   k's 16 weights side by side.
// panel_linear(x [..., in] of the panels' dtype, panels, bias [out] or None) -> [..., out]:
//   x @ W.T + b. bfloat16 weights are widened to float32 in registers (exact) and every product
//   summed in float32, rounded to bfloat16 once at the end: what a bfloat16 matrix product with
//   float32 accumulation computes, on CPUs without bfloat16 instructions, at half the bytes of
//   float32 weights.
//
// With AVX2 and FMA each task (a run of panels) multiplies blocks of up to 6 rows of x by one
// panel: 6 x 16 sums in 12 registers, one panel row of 16 weights (two vectors) loaded per input
// channel and each row's x broadcast against it (the register tile of BLIS's Haswell kernel).
// A panel (64 bytes per input channel in float32) streams through L1 once per block of 6 rows; prompts go in
// blocks of kRowBlock rows so that those rows of x stay in L2 while every panel passes, and where
// a panel outgrows L1 (more than 512 inputs) in slices of kSlice inputs whose part of the panel
// stays in L1 while the block's rows pass (the sums so far kept in y between slices). The sums
// live in named registers: an array of vectors indexed in a loop goes through the stack with GCC.
// Elsewhere plain loops (the layout is only offered where AVX2 and FMA are).
//
// Built with the other CPU kernels by text_generation_server/kernels/cpu_kernels.py as
// torch.ops.tgis_cpu.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TGIS_PANELS_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;     // output channels a panel
constexpr int64_t kTile = 6;       // rows of x a register tile
constexpr int64_t kRowBlock = 96;  // rows of x every panel passes through before the next block
constexpr int64_t kSlice = 256;    // input channels of a panel (16 KiB) kept in L1 while a block's rows pass

#if defined(TGIS_PANELS_AVX2)

// input channel k's 16 weights of a panel as two float32 vectors
inline void load_weights(const float* panel, int64_t k, __m256& b0, __m256& b1) {
  b0 = _mm256_loadu_ps(panel + k * kPanel);
  b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
}

inline void load_weights(const c10::BFloat16* panel, int64_t k, __m256& b0, __m256& b1) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kPanel));
  b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(halves)), 16));
  b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(halves, 1)), 16));
}

// y[r][0..15] = x[r] . panel[k0, k1) for R <= 6 rows of x (row stride ldx), y row stride ldy:
// the first slice of the inputs (k0 = 0) adds the bias, later ones add to the sums stored before.
template <int R, typename W>
inline void tile(const float* x, int64_t ldx, const W* panel, int64_t k0, int64_t k1, const float* bias, float* y,
                 int64_t ldy) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(),
         c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps(),
         c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps(), c40 = _mm256_setzero_ps(),
         c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m256 b0, b1, a;
    load_weights(panel, k, b0, b1);
#define TGIS_ROW(r)                                  \
  if constexpr (R > r) {                             \
    a = _mm256_broadcast_ss(x + r * ldx + k);        \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);       \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);       \
  }
    TGIS_ROW(0) TGIS_ROW(1) TGIS_ROW(2) TGIS_ROW(3) TGIS_ROW(4) TGIS_ROW(5)
#undef TGIS_ROW
  }
  const bool first = k0 == 0;
  const bool biased = first && bias != nullptr;
  const __m256 d0 = biased ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 d1 = biased ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#define TGIS_STORE(r)                                                                                  \
  if constexpr (R > r) {                                                                               \
    float* yr = y + r * ldy;                                                                           \
    _mm256_storeu_ps(yr, _mm256_add_ps(c##r##0, first ? d0 : _mm256_loadu_ps(yr)));                    \
    _mm256_storeu_ps(yr + 8, _mm256_add_ps(c##r##1, first ? d1 : _mm256_loadu_ps(yr + 8)));            \
  }
  TGIS_STORE(0) TGIS_STORE(1) TGIS_STORE(2) TGIS_STORE(3) TGIS_STORE(4) TGIS_STORE(5)
#undef TGIS_STORE
}

// Rows [first, last) of x through input channels [k0, k1) of one panel.
template <typename W>
void rows_through_panel(const float* x, int64_t in, const W* panel, int64_t k0, int64_t k1, const float* bias,
                        float* y, int64_t out, int64_t first, int64_t last) {
  int64_t r = first;
  for (; r + kTile <= last; r += kTile) tile<6>(x + r * in, in, panel, k0, k1, bias, y + r * out, out);
  const float* xr = x + r * in;
  float* yr = y + r * out;
  switch (last - r) {
    case 5: tile<5>(xr, in, panel, k0, k1, bias, yr, out); break;
    case 4: tile<4>(xr, in, panel, k0, k1, bias, yr, out); break;
    case 3: tile<3>(xr, in, panel, k0, k1, bias, yr, out); break;
    case 2: tile<2>(xr, in, panel, k0, k1, bias, yr, out); break;
    case 1: tile<1>(xr, in, panel, k0, k1, bias, yr, out); break;
    default: break;
  }
}

#else

template <typename W>
void rows_through_panel(const float* x, int64_t in, const W* panel, int64_t k0, int64_t k1, const float* bias,
                        float* y, int64_t out, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r) {
    float sums[kPanel] = {};
    for (int64_t k = k0; k < k1; ++k) {
      const float a = x[r * in + k];
      for (int64_t j = 0; j < kPanel; ++j) sums[j] += a * static_cast<float>(panel[k * kPanel + j]);
    }
    for (int64_t j = 0; j < kPanel; ++j) {
      const float before = k0 > 0 ? y[r * out + j] : (bias != nullptr ? bias[j] : 0.f);
      y[r * out + j] = sums[j] + before;
    }
  }
}

#endif

at::Tensor panel_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "panel_pack: a float32 or bfloat16 [out, in] weight");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(out % kPanel == 0, "panel_pack: out_features (", out, ") must be a multiple of ", kPanel);
  // [out, in] -> [out / 16, 16, in] -> [out / 16, in, 16]
  return weight.reshape({out / kPanel, kPanel, in}).transpose(1, 2).contiguous();
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias) {
  const bool halves = panels.scalar_type() == at::kBFloat16;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  (halves || panels.scalar_type() == at::kFloat),
              "panel_linear: panels [out / 16, in, 16] from panel_pack");
  TORCH_CHECK(x.scalar_type() == panels.scalar_type(), "panel_linear: inputs in the weights' dtype (",
              panels.scalar_type(), "), not ", x.scalar_type());
  const int64_t count = panels.size(0), in = panels.size(1), out = count * kPanel;
  TORCH_CHECK(x.size(-1) == in, "panel_linear: input has ", x.size(-1), " features, the weight ", in);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == out, "panel_linear: bias of ", b.numel(), " values for ", out, " outputs");
  }
  const at::Tensor rows = x.reshape({-1, in}).to(at::kFloat).contiguous();  // bfloat16: widened once
  const int64_t m = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  at::Tensor y = at::empty({m, out}, rows.options());
  const float* xp = rows.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const float* wp = halves ? nullptr : panels.data_ptr<float>();
  const c10::BFloat16* hp = halves ? panels.data_ptr<c10::BFloat16>() : nullptr;
  // decode steps (up to one tile of rows) read each panel once, whole, and so do all steps where
  // a panel fits in L1; otherwise the inputs go in slices whose part of a panel stays in L1 while
  // all the block's rows pass
  const int64_t slice = m > kTile && in > 2 * kSlice ? kSlice : in;
  for (int64_t first = 0; first < m; first += kRowBlock) {
    const int64_t last = std::min(m, first + kRowBlock);
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t k0 = 0; k0 < in; k0 += slice) {
          const int64_t k1 = std::min(in, k0 + slice);
          const float* bias_p = bp != nullptr ? bp + p * kPanel : nullptr;
          if (halves) {
            rows_through_panel(xp, in, hp + p * in * kPanel, k0, k1, bias_p, yp + p * kPanel, out, first, last);
          } else {
            rows_through_panel(xp, in, wp + p * in * kPanel, k0, k1, bias_p, yp + p * kPanel, out, first, last);
          }
        }
      }
    });
  }
  return y.to(x.scalar_type()).view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgis_cpu, m) {
  m.def("panel_pack(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_linear", &panel_linear);
}
