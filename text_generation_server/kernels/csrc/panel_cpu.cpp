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
// stays in L1 while the block's rows pass (the sums so far kept in y between slices, each slice
// going on from them: every output is one chain of FMAs over its inputs in order, the bias last,
// whatever the rows, slices or tiles, so a row's outputs never depend on the rows beside it).
// Steps of 1-3 rows take 2-4 panels at a time (tile_group): one panel's 2-6 sums are too few
// independent FMA chains to hide the instruction's latency. The sums live in named registers: an
// array of vectors indexed in a loop goes through the stack with GCC.
// In bfloat16 the tiles round their sums as they store them wherever the inputs go in one slice,
// and a decode step's few rows of x are widened on the calling thread: no float32 copy of x or y
// passes through at::Tensor::to (two dispatches that cost a decode step's linear 10-15 us).
// Elsewhere plain loops (the layout is only offered where AVX2 and FMA are).
//
// With AVX512-BF16, bfloat16 weights of an even input width are packed in pairs instead (panel p,
// pair q: output channel j's weights for inputs 2q and 2q + 1 side by side, 64 bytes a pair), and
// every product takes vdpbf16ps: 16 outputs x 2 inputs an instruction from the stored halves, x's
// two bfloat16 values broadcast as one 32-bit lane (no widening of x or of the weights). Each sum
// then runs pair by pair, in the instruction's own order within a pair, the bias last, on every
// path (1-3 rows through groups of panels, tiles of up to 6 rows, prompt slices, whose widths are
// even): a row's outputs still do not depend on the rows beside it.
//
// With AMX (AMX-BF16), pairs of an input width in multiples of 32 multiply on the tile unit
// instead, whatever the number of rows: 32 inputs of a panel as stored are a B tile (16 pairs x 64
// bytes), up to 16 rows of x an A tile, tdpbf16ps sums them in float32 over all inputs in order,
// and each sum gets the bias and is rounded once. Up to 16 rows take 4 panels (C tiles 0-3 against
// one A tile), more go as pairs of A tiles against pairs of panels (half the tile loads per
// product), the rows left over in a tile of their own; prompts go in row blocks whose x stays in
// L2 (amx.h's tile_products) while the panels stream by once. The tile unit's sums are not vdpbf16ps's
// bit for bit (it rounds differently inside a product), so which unit multiplies depends only on
// the weight's width and the CPU, never on the rows: a row's outputs stay the same whatever rows
// go with it. On a 2-core Xeon with AMX, one weight timed warm, µs at 1 / 32 / 160 / 1,024 rows:
// 512 x 512 10 / 10 / 38 / 238 on tiles against 10 / 74 / 356 / 2,341 on vdpbf16ps and 22 / 28 /
// 48 / 182 on oneDNN; 8,192 x 512 (an LM head) 164 / 197 / 638 / 4,662 against 150 / 1,160 /
// 5,744 / 37,188 and 210 / 255 / 574 / 2,882.
//
// Built with the other CPU kernels by text_generation_server/kernels/cpu_kernels.py as
// torch.ops.tgis_cpu.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "loops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TGIS_PANELS_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TGIS_PANELS_PAIRS 1
#if defined(TGIS_CPU_AMX)
#define TGIS_PANELS_AMX 1
#endif
#endif

namespace {

using tgis_cpu::over_groups;

constexpr int64_t kPanel = 16;     // output channels a panel
constexpr int kTile = 6;           // rows of x a register tile
constexpr int64_t kRowBlock = 96;  // rows of x every panel passes through before the next block
constexpr int64_t kSlice = 256;    // input channels of a panel (16 KiB) kept in L1 while a block's rows pass

// tile(std::integral_constant<int, R>{}, r) for rows [first, last): tiles of kTile rows from r = first,
// then one of the rows left (R < kTile)
template <typename Tile>
inline void over_tiles(int64_t first, int64_t last, Tile tile) {
  int64_t r = first;
  for (; r + kTile <= last; r += kTile) tile(std::integral_constant<int, kTile>{}, r);
  switch (last - r) {
    case 5: tile(std::integral_constant<int, 5>{}, r); break;
    case 4: tile(std::integral_constant<int, 4>{}, r); break;
    case 3: tile(std::integral_constant<int, 3>{}, r); break;
    case 2: tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

#if defined(TGIS_PANELS_AVX2)

// input channel k's 16 weights of a panel as two float32 vectors
inline void load_weights(const float* panel, int64_t k, __m256& b0, __m256& b1) {
  b0 = _mm256_loadu_ps(panel + k * kPanel);
  b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
}

inline void load_weights(const c10::BFloat16* panel, int64_t k, __m256& b0, __m256& b1) {
  // each half loaded by the widening instruction itself (no 256-bit load and lane extract)
  const __m128i* halves = reinterpret_cast<const __m128i*>(panel + k * kPanel);
  b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(halves)), 16));
  b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(halves + 1)), 16));
}

// 16 sums (two vectors) to y: float32 as they are; bfloat16 rounded to nearest even, NaN as
// 0xFFFF (what at::Tensor::to(kBFloat16) stores on AVX2)
inline void store16(float* y, __m256 lo, __m256 hi) {
  _mm256_storeu_ps(y, lo);
  _mm256_storeu_ps(y + 8, hi);
}

inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
  return _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), rounded, ordered);
}

inline void store16(c10::BFloat16* y, __m256 lo, __m256 hi) {
  // packus interleaves the 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7): put them back in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(lo), bf16_bits(hi)), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), packed);
}

// y[r][0..15] = x[r] . panel[k0, k1) (+ bias after input channel in - 1) for R <= 6 rows of x
// (row stride ldx), y row stride ldy. A slice after the first goes on from the sums the slices
// before stored (float32 y: a bfloat16 y is written by tasks whose one slice is all the inputs),
// so every sum runs input channel by input channel, the bias last, however the inputs are sliced:
// a row's outputs do not depend on how many rows go with it.
template <int R, typename W, typename Y>
inline void tile(const float* x, int64_t ldx, const W* panel, int64_t k0, int64_t k1, int64_t in, const float* bias,
                 Y* y, int64_t ldy) {
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  if constexpr (std::is_same_v<Y, float>) {
    if (k0 > 0) {
#define TGIS_LOAD(r)                                \
  if constexpr (R > r) {                            \
    c##r##0 = _mm256_loadu_ps(y + r * ldy);         \
    c##r##1 = _mm256_loadu_ps(y + r * ldy + 8);     \
  }
      TGIS_LOAD(0) TGIS_LOAD(1) TGIS_LOAD(2) TGIS_LOAD(3) TGIS_LOAD(4) TGIS_LOAD(5)
#undef TGIS_LOAD
    }
  }
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
  const bool biased = k1 == in && bias != nullptr;
  const __m256 d0 = biased ? _mm256_loadu_ps(bias) : z;
  const __m256 d1 = biased ? _mm256_loadu_ps(bias + 8) : z;
#define TGIS_STORE(r)                                                                       \
  if constexpr (R > r) {                                                                    \
    store16(y + r * ldy, _mm256_add_ps(c##r##0, d0), _mm256_add_ps(c##r##1, d1));           \
  }
  TGIS_STORE(0) TGIS_STORE(1) TGIS_STORE(2) TGIS_STORE(3) TGIS_STORE(4) TGIS_STORE(5)
#undef TGIS_STORE
}

// R <= 3 rows of x (row stride ldx) through G panels side by side, all `in` input channels: one
// panel holds 2R sums, too few to hide the FMA's latency (4 cycles on Zen 3: a decode step of one
// row ran at a quarter of the FMA units' rate); G panels give 2GR independent sums. Every sum is
// taken in the order tile<R> takes it (input channel by input channel, the bias last), so a row's
// outputs do not depend on how many rows or panels go with it.
template <int R, int G, typename W, typename Y>
inline void tile_group(const float* x, int64_t ldx, const W* panel, int64_t in, const float* bias, Y* y,
                       int64_t ldy) {
  static_assert(R >= 1 && R <= 3 && G >= 1 && G <= 4 && 2 * G * R <= 12, "tile_group: up to 12 sums");
  const __m256 z = _mm256_setzero_ps();
  // c<panel><row><half>: the ones a <R, G> does not use are never live
  __m256 c000 = z, c001 = z, c010 = z, c011 = z, c020 = z, c021 = z, c100 = z, c101 = z, c110 = z, c111 = z,
         c120 = z, c121 = z, c200 = z, c201 = z, c210 = z, c211 = z, c220 = z, c221 = z, c300 = z, c301 = z,
         c310 = z, c311 = z, c320 = z, c321 = z;
  for (int64_t k = 0; k < in; ++k) {
    __m256 a0 = _mm256_broadcast_ss(x + k), a1 = z, a2 = z;
    if constexpr (R > 1) a1 = _mm256_broadcast_ss(x + ldx + k);
    if constexpr (R > 2) a2 = _mm256_broadcast_ss(x + 2 * ldx + k);
#define TGIS_PANEL(g)                                    \
  if constexpr (G > g) {                                 \
    __m256 w0, w1;                                       \
    load_weights(panel + g * in * kPanel, k, w0, w1);    \
    c##g##00 = _mm256_fmadd_ps(a0, w0, c##g##00);        \
    c##g##01 = _mm256_fmadd_ps(a0, w1, c##g##01);        \
    if constexpr (R > 1) {                               \
      c##g##10 = _mm256_fmadd_ps(a1, w0, c##g##10);      \
      c##g##11 = _mm256_fmadd_ps(a1, w1, c##g##11);      \
    }                                                    \
    if constexpr (R > 2) {                               \
      c##g##20 = _mm256_fmadd_ps(a2, w0, c##g##20);      \
      c##g##21 = _mm256_fmadd_ps(a2, w1, c##g##21);      \
    }                                                    \
  }
    TGIS_PANEL(0) TGIS_PANEL(1) TGIS_PANEL(2) TGIS_PANEL(3)
#undef TGIS_PANEL
  }
#define TGIS_STORE(g, r)                                                                           \
  if constexpr (G > g && R > r) {                                                                  \
    const float* b = bias != nullptr ? bias + g * kPanel : nullptr;                                \
    const __m256 d0 = b != nullptr ? _mm256_loadu_ps(b) : z, d1 = b != nullptr ? _mm256_loadu_ps(b + 8) : z; \
    store16(y + r * ldy + g * kPanel, _mm256_add_ps(c##g##r##0, d0), _mm256_add_ps(c##g##r##1, d1)); \
  }
  TGIS_STORE(0, 0) TGIS_STORE(0, 1) TGIS_STORE(0, 2) TGIS_STORE(1, 0) TGIS_STORE(1, 1) TGIS_STORE(1, 2)
  TGIS_STORE(2, 0) TGIS_STORE(2, 1) TGIS_STORE(2, 2) TGIS_STORE(3, 0) TGIS_STORE(3, 1) TGIS_STORE(3, 2)
#undef TGIS_STORE
}

// R <= 3 rows of x through panels [begin, end), all input channels: 4 panels at a time for one
// row, 2 for two or three, the rest one by one.
template <int R, typename W, typename Y>
void few_rows_through(const float* x, int64_t in, const W* panels, int64_t begin, int64_t end, const float* bias,
                      Y* y, int64_t out) {
  over_groups<R == 1 ? 4 : 2>(begin, end, [&](auto group, int64_t p) {
    tile_group<R, decltype(group)::value>(x, in, panels + p * in * kPanel, in,
                                          bias != nullptr ? bias + p * kPanel : nullptr, y + p * kPanel, out);
  });
}

// Rows [first, last) of x through input channels [k0, k1) of one panel.
template <typename W, typename Y>
void rows_through_panel(const float* x, int64_t in, const W* panel, int64_t k0, int64_t k1, const float* bias,
                        Y* y, int64_t out, int64_t first, int64_t last) {
  over_tiles(first, last, [&](auto rows, int64_t r) {
    tile<decltype(rows)::value>(x + r * in, in, panel, k0, k1, in, bias, y + r * out, out);
  });
}

#else

template <typename W, typename Y>
void rows_through_panel(const float* x, int64_t in, const W* panel, int64_t k0, int64_t k1, const float* bias,
                        Y* y, int64_t out, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r) {
    float sums[kPanel] = {};
    for (int64_t j = 0; j < kPanel && k0 > 0; ++j) sums[j] = static_cast<float>(y[r * out + j]);
    for (int64_t k = k0; k < k1; ++k) {
      const float a = x[r * in + k];
      for (int64_t j = 0; j < kPanel; ++j) sums[j] += a * static_cast<float>(panel[k * kPanel + j]);
    }
    for (int64_t j = 0; j < kPanel; ++j) {
      y[r * out + j] = static_cast<Y>(sums[j] + (k1 == in && bias != nullptr ? bias[j] : 0.f));
    }
  }
}

template <int R, typename W, typename Y>
void few_rows_through(const float* x, int64_t in, const W* panels, int64_t begin, int64_t end, const float* bias,
                      Y* y, int64_t out) {
  for (int64_t p = begin; p < end; ++p) {
    rows_through_panel(x, in, panels + p * in * kPanel, 0, in, bias != nullptr ? bias + p * kPanel : nullptr,
                       y + p * kPanel, out, 0, R);
  }
}

#endif

// Whether bfloat16 weights of `in` input channels are packed in pairs (AVX512-BF16, even widths).
bool in_pairs(at::ScalarType dtype, int64_t in) {
#if defined(TGIS_PANELS_PAIRS)
  return dtype == at::kBFloat16 && in % 2 == 0;
#else
  (void)dtype, (void)in;
  return false;
#endif
}

#if defined(TGIS_PANELS_PAIRS)

using Half = c10::BFloat16;
constexpr int kTileGroup = 4;  // panels a tile of up to 6 rows takes side by side: 24 independent sums

// x[k] and x[k + 1] (k even) in every 32-bit lane
inline __m512bh x_pair(const Half* x, int64_t k) {
  int32_t bits;
  std::memcpy(&bits, x + k, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}

// a panel's pair of inputs k, k + 1 (k even): 16 outputs x 2 weights
inline __m512bh w_pair(const Half* panel, int64_t k) {
  return (__m512bh)_mm512_loadu_si512(panel + k * kPanel);
}

inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }

inline void store16(Half* y, __m512 v) {  // rounded to nearest even
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}

// y[r][16g .. 16g + 15] = x[r] . panel g over inputs [k0, k1) for R <= 6 rows and G <= 8 panels
// side by side, going on from the sums the slices before stored (float32 y); the bias (or zero)
// added as tile<R> adds it. Every path of pair_linear takes its sums here.
template <int R, int G, typename Y>
inline void pair_tile(const Half* x, int64_t ldx, const Half* panel, int64_t k0, int64_t k1, int64_t in,
                      const float* bias, Y* y, int64_t ldy) {
  __m512 acc[G][R];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      if constexpr (std::is_same_v<Y, float>) {
        acc[g][r] = k0 > 0 ? _mm512_loadu_ps(y + r * ldy + g * kPanel) : _mm512_setzero_ps();
      } else {
        acc[g][r] = _mm512_setzero_ps();
      }
    }
  }
  for (int64_t k = k0; k < k1; k += 2) {
    __m512bh w[G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) w[g] = w_pair(panel + g * in * kPanel, k);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh a = x_pair(x + r * ldx, k);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[g][r] = _mm512_dpbf16_ps(acc[g][r], a, w[g]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const __m512 d = k1 == in && bias != nullptr ? _mm512_loadu_ps(bias + g * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) store16(y + r * ldy + g * kPanel, _mm512_add_ps(acc[g][r], d));
  }
}

// R <= 3 rows (a decode step) through panels [begin, end), all inputs, 8 panels at a time: 8
// weight streams in flight (measured against 4 for two or three rows, 2-core Zen 4, bfloat16: an
// 8,192 x 512 head 0.87-0.93x / 0.88-0.95x the time, 2,752 x 512 0.93-1.01x / 0.92-1.08x)
template <int R, typename Y>
void few_rows_in_pairs(const Half* x, int64_t in, const Half* panels, int64_t begin, int64_t end, const float* bias,
                       Y* y, int64_t out) {
  over_groups<8>(begin, end, [&](auto group, int64_t p) {
    pair_tile<R, decltype(group)::value>(x, in, panels + p * in * kPanel, 0, in, in,
                                         bias != nullptr ? bias + p * kPanel : nullptr, y + p * kPanel, out);
  });
}

// rows [first, last) of x through inputs [k0, k1) of G panels side by side
template <int G, typename Y>
void rows_through_pairs(const Half* x, int64_t in, const Half* panel, int64_t k0, int64_t k1, const float* bias,
                        Y* y, int64_t out, int64_t first, int64_t last) {
  over_tiles(first, last, [&](auto rows, int64_t r) {
    pair_tile<decltype(rows)::value, G>(x + r * in, in, panel, k0, k1, in, bias, y + r * out, out);
  });
}

#if defined(TGIS_PANELS_AMX)

constexpr int64_t kAmxInputs = tgis_cpu::kTileBytes / sizeof(Half);  // inputs of a B tile: 16 pairs

// Whether a product over `in` inputs of bfloat16 pairs runs on the tile unit: a property of the
// weight and the CPU, never of the call's rows, so a row's outputs stay the same however many
// rows go with it (the tile unit's sums are not the vector instruction's, bit for bit).
bool on_tiles(int64_t in) { return in % kAmxInputs == 0 && tgis_cpu::amx_ready(); }

// pair_linear on the tile unit (amx.h's tile_products): x [m, in] bfloat16 (contiguous, in a
// multiple of 32) -> [m, out]; each float32 sum gets the bias and is rounded once
at::Tensor amx_linear(const at::Tensor& rows, const Half* panels, int64_t count, int64_t in, const float* bias) {
  const int64_t m = rows.size(0), out = count * kPanel;
  at::Tensor result = at::empty({m, out}, rows.options().dtype(at::kBFloat16));
  Half* y = result.data_ptr<Half>();
  const auto finish = [&](int64_t p, int64_t r, const float* sums) {
    const __m512 d = bias != nullptr ? _mm512_loadu_ps(bias + p * kPanel) : _mm512_setzero_ps();
    store16(y + r * out + p * kPanel, _mm512_add_ps(_mm512_load_ps(sums), d));
  };
  tgis_cpu::tile_products<tgis_cpu::Bf16Products, float>(reinterpret_cast<const char*>(rows.data_ptr<Half>()),
                                                         in * sizeof(Half), m, in / kAmxInputs,
                                                         reinterpret_cast<const char*>(panels), count, finish);
  return result;
}

#endif

// panel_linear over weights packed in pairs: x [m, in] bfloat16 (contiguous) -> [m, out] bfloat16
at::Tensor pair_linear(const at::Tensor& rows, const Half* panels, int64_t count, int64_t in, const float* bias) {
#if defined(TGIS_PANELS_AMX)
  if (on_tiles(in)) return amx_linear(rows, panels, count, in, bias);
#endif
  const int64_t m = rows.size(0), out = count * kPanel;
  const Half* x = rows.data_ptr<Half>();
  const int64_t slice = m > kTile && in > 2 * kSlice ? kSlice : in;  // kSlice is even: slices hold whole pairs
  const bool round_in_tiles = slice == in;
  at::Tensor y = at::empty({m, out}, rows.options().dtype(round_in_tiles ? at::kBFloat16 : at::kFloat));
  Half* yh = round_in_tiles ? y.data_ptr<Half>() : nullptr;
  float* yf = round_in_tiles ? nullptr : y.data_ptr<float>();
  if (m <= 3) {
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      if (m == 1) few_rows_in_pairs<1>(x, in, panels, begin, end, bias, yh, out);
      if (m == 2) few_rows_in_pairs<2>(x, in, panels, begin, end, bias, yh, out);
      if (m == 3) few_rows_in_pairs<3>(x, in, panels, begin, end, bias, yh, out);
    });
    return y;
  }
  for (int64_t first = 0; first < m; first += kRowBlock) {
    const int64_t last = std::min(m, first + kRowBlock);
    // panels [p, p + G) through every slice of the inputs
    const auto through = [&](auto group, int64_t p) {
      constexpr int G = decltype(group)::value;
      const float* bias_p = bias != nullptr ? bias + p * kPanel : nullptr;
      for (int64_t k0 = 0; k0 < in; k0 += slice) {
        const int64_t k1 = std::min(in, k0 + slice);
        if (yh != nullptr) {
          rows_through_pairs<G>(x, in, panels + p * in * kPanel, k0, k1, bias_p, yh + p * kPanel, out, first, last);
        } else {
          rows_through_pairs<G>(x, in, panels + p * in * kPanel, k0, k1, bias_p, yf + p * kPanel, out, first, last);
        }
      }
    };
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) { over_groups<kTileGroup>(begin, end, through); });
  }
  return round_in_tiles ? y : y.to(at::kBFloat16);
}

#endif

// dst[0, n) = src[0, n) widened to float32 (exact)
void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(TGIS_PANELS_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Rows of a bfloat16 x up to this many values are widened here, on the calling thread (one pass
// over a few KiB); more go through at::Tensor::to, whose passes run on all threads.
constexpr int64_t kWidenHere = int64_t{1} << 16;

at::Tensor panel_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "panel_pack: a float32 or bfloat16 [out, in] weight");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(out % kPanel == 0, "panel_pack: out_features (", out, ") must be a multiple of ", kPanel);
  if (in_pairs(weight.scalar_type(), in)) {  // [out, in] -> [out / 16, 16, in / 2, 2] -> [out / 16, in / 2, 16, 2]
    return weight.reshape({out / kPanel, kPanel, in / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({out / kPanel, in, kPanel});
  }
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
  const at::Tensor rows = x.reshape({-1, in}).contiguous();
  const int64_t m = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
#if defined(TGIS_PANELS_PAIRS)
  if (in_pairs(panels.scalar_type(), in)) {
    return pair_linear(rows, panels.data_ptr<c10::BFloat16>(), count, in, b.defined() ? b.data_ptr<float>() : nullptr)
        .view(shape);
  }
#endif
  // bfloat16 rows in float32: a decode step's few rows widened here, a prompt's by at::Tensor::to
  std::vector<float> widened;
  at::Tensor wide;
  const float* xp = nullptr;
  if (!halves) {
    xp = rows.data_ptr<float>();
  } else if (m * in <= kWidenHere) {
    widened.resize(m * in);
    widen(rows.data_ptr<c10::BFloat16>(), widened.data(), m * in);
    xp = widened.data();
  } else {
    wide = rows.to(at::kFloat);
    xp = wide.data_ptr<float>();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* wp = halves ? nullptr : panels.data_ptr<float>();
  const c10::BFloat16* hp = halves ? panels.data_ptr<c10::BFloat16>() : nullptr;
  // decode steps (up to one tile of rows) read each panel once, whole, and so do all steps where
  // a panel fits in L1; otherwise the inputs go in slices whose part of a panel stays in L1 while
  // all the block's rows pass
  const int64_t slice = m > kTile && in > 2 * kSlice ? kSlice : in;
  // With one slice a bfloat16 product rounds its sums as the tiles store them; with several the
  // sums between slices stay in float32 and are rounded once at the end.
  const bool round_in_tiles = halves && slice == in;
  at::Tensor y = at::empty({m, out}, rows.options().dtype(round_in_tiles || !halves ? x.scalar_type() : at::kFloat));
  float* yf = round_in_tiles ? nullptr : y.data_ptr<float>();
  c10::BFloat16* yh = round_in_tiles ? y.data_ptr<c10::BFloat16>() : nullptr;
  // a decode step of a few rows: several panels at a time (in bfloat16 always rounded in tiles)
  const auto few_rows = [&](const auto* w, auto* y_p) {
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      if (m == 1) few_rows_through<1>(xp, in, w, begin, end, bp, y_p, out);
      if (m == 2) few_rows_through<2>(xp, in, w, begin, end, bp, y_p, out);
      if (m == 3) few_rows_through<3>(xp, in, w, begin, end, bp, y_p, out);
    });
  };
  if (m <= 3) {
    if (yh != nullptr) {
      few_rows(hp, yh);
    } else {
      few_rows(wp, yf);  // float32
    }
    return y.view(shape);
  }
  // (measured: for a block of 96 rows widening each slice once pays, 16 tiles read it; for 8 or
  // 32 rows, 2 or 6 tiles, widening in every tile stays faster)
  const bool widen_once = halves && m >= kRowBlock;
  for (int64_t first = 0; first < m; first += kRowBlock) {
    const int64_t last = std::min(m, first + kRowBlock);
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      // bfloat16 prompts: each slice of a panel widened once into float32 (L1-sized) for all the
      // block's tiles, instead of in every tile; the values, and so the sums, are the same
      std::vector<float> wide_panel(widen_once ? in * kPanel : 0);  // written and read a slice at a time
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t k0 = 0; k0 < in; k0 += slice) {
          const int64_t k1 = std::min(in, k0 + slice);
          const float* bias_p = bp != nullptr ? bp + p * kPanel : nullptr;
          if (widen_once) {
            widen(hp + (p * in + k0) * kPanel, wide_panel.data() + k0 * kPanel, (k1 - k0) * kPanel);
          }
          const auto through = [&](const auto* panel) {
            if (yh != nullptr) {
              rows_through_panel(xp, in, panel, k0, k1, bias_p, yh + p * kPanel, out, first, last);
            } else {
              rows_through_panel(xp, in, panel, k0, k1, bias_p, yf + p * kPanel, out, first, last);
            }
          };
          if (widen_once) {
            through(static_cast<const float*>(wide_panel.data()));
          } else if (halves) {
            through(hp + p * in * kPanel);  // each tile widens the panel as it goes
          } else {
            through(wp + p * in * kPanel);
          }
        }
      }
    });
  }
  return (y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type())).view(shape);
}

// Whether bfloat16 panels of `in` inputs multiply on AMX's tiles here (weight_layout.py logs it).
bool panel_tiles(int64_t in) {
#if defined(TGIS_PANELS_AMX)
  return in_pairs(at::kBFloat16, in) && on_tiles(in);
#else
  (void)in;
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgis_cpu, m) {
  m.def("panel_pack(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
  m.def("panel_tiles(int inputs) -> bool", &panel_tiles);
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_linear", &panel_linear);
}
