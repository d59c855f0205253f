// W8A8's product with exact integer sums (quantization/int8.py's Int8Linear, its exact way: CPUs
// where oneDNN's int8 kernels saturate (AVX2 without VNNI) or are slower than this kernel
// (AVX512-VNNI, with AMX or without)).
//
// w8a8_pack(ints [out, in] int8) -> the same weights in this kernel's layout (below);
// w8a8_linear(x [rows, in], packed, scales [out] float32, bias [out] float32 or None)
//   -> [rows, out] in x's dtype: each token rounded to W8A8's integers a = round(x / s) clamped to
//   [-128, 127] with s = max |x| / 127.5 (compressed-tensors' symmetric per-token rounding, halves
//   to even as torch.round), y = (sum_k a_k w_k) * scales[n] * s + bias, the sums exact in int32.
//
// With AVX512-VNNI, vpdpbusd multiplies 64 weights by a token's integers 4 at a time, summing each
// 4 products into 32 bits: the weights lie in panels of 16 outputs, 4 inputs of each side by side
// (a cache line a step), stored as unsigned bytes w + 128 (the instruction's unsigned operand; a
// row's 128 sum a is taken off once). A row alone reads 8 panels at once (8 streams of weights);
// more rows go 4 at a time through groups of 4 panels, whose weights stay in L2 meanwhile.
// With AMX-INT8, calls of kTileFrom rows or more over inputs in multiples of 64 take the tile unit
// instead (amx.h's tile_products): the panels are its B tiles as they lie, the rows' integers its
// A tiles, and tdpbsud sums the same integers exactly, so a row's outputs are the same on either
// path. bfloat16 outputs are rounded as c10::BFloat16 rounds, 16 at once.
//
// With AVX2 alone the integers are 16-bit and vpmaddwd multiplies 16 of them by 16 weights widened
// from their bytes, summing pairs into 32 bits (no saturation: |a w| <= 2^14): what VNNI computes,
// at a byte read per weight. Output rows go in tasks of kOuts, whose weights are interleaved by 16
// inputs (a cache line a step) and stored one task after the other; the rows of x pass through a
// task's weights up to 4 at a time (R x N sums in registers) while they stay in L1; prompts go in
// blocks of kRowBlock rows, whose 16-bit integers stay in L2 while all tasks read them. A row alone
// (a decode step of one sequence, where the weights' bytes are the cost) reads two tasks from far
// apart in a thread's share at once, each stream prefetched ahead. Elsewhere plain loops (the
// compiler vectorizes them for its target).
//
// Built with the other CPU kernels by text_generation_server/kernels/cpu_kernels.py as
// torch.ops.tgis_cpu.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "loops.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using tgis_cpu::over_groups;

constexpr int64_t kOuts = 4;        // output rows a task
constexpr int64_t kRowBlock = 32;   // rows of x whose integers are read by every task in turn
constexpr int64_t kLanes16 = 16;    // 16-bit integers a vector
constexpr float kSteps = 127.5f;    // W8A8's integer steps in a token's max |x|

// x / s correctly rounded: -ffast-math lets the compiler divide vectors through an approximate
// reciprocal (vrcpps and a Newton step), whose quotients can differ in the last bit, and the
// integers must be round(x / s) exactly (a quotient of 127.49999 is 127, not 128).
inline float divide(float x, float s) {
#if defined(__AVX__)
  asm("vdivss %2, %1, %0" : "=x"(x) : "x"(x), "x"(s));
  return x;
#else
  return x / s;
#endif
}

#if defined(__AVX2__)
inline __m256 divide(__m256 x, __m256 s) {
  asm("vdivps %2, %1, %0" : "=x"(x) : "x"(x), "x"(s));
  return x;
}
#endif

// Row `x` (in values) as W8A8's integers at `a` (padded with zeros to a multiple of kLanes16);
// returns its step s.
float quantize_row(const float* x, int64_t in, int64_t padded, int16_t* a) {
  float top = 0.0f;
  for (int64_t k = 0; k < in; ++k) top = std::max(top, std::fabs(x[k]));
  const float step = divide(std::max(top, std::numeric_limits<float>::min()), kSteps);
  int64_t k = 0;
#if defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(step);
  const __m256 low = _mm256_set1_ps(-128.0f), high = _mm256_set1_ps(127.0f);
  for (; k + 8 <= in; k += 8) {
    const __m256 q = _mm256_round_ps(divide(_mm256_loadu_ps(x + k), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i wide = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, low), high));
    const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + k), packed);
  }
#endif
  for (; k < in; ++k) {
    const float q = divide(x[k], step);
    a[k] = static_cast<int16_t>(std::clamp(std::nearbyint(q), -128.0f, 127.0f));
  }
  for (; k < padded; ++k) a[k] = 0;
  return step;
}

// task_pack(ints [out, in] int8) -> [tasks, padded / 16, kOuts, 16] int8: task t's chunk c holds
// inputs 16c .. 16c + 15 of outputs kOuts t .. kOuts t + kOuts - 1, 64 bytes (a cache line), and a
// task's chunks follow each other, then the next task's: a task is one contiguous stream (with
// the weights in rows it was 4 streams of a row's bytes each), so a row alone can read two tasks
// at once as two streams (dot_pair). Zeros pad the inputs to a multiple of 16 and the outputs to
// a multiple of kOuts.
at::Tensor task_pack(const at::Tensor& ints, int64_t padded) {
  const int64_t out_features = ints.size(0), in = ints.size(1);
  const int64_t tasks = (out_features + kOuts - 1) / kOuts;
  return at::constant_pad_nd(ints, {0, padded - in, 0, tasks * kOuts - out_features})
      .view({tasks, kOuts, padded / kLanes16, kLanes16})
      .permute({0, 2, 1, 3})
      .contiguous();
}

constexpr int64_t kChunk = kOuts * kLanes16;  // bytes of a task's chunk
constexpr int64_t kAhead = 32 * kChunk;       // how far ahead in its stream a task prefetches

#if defined(__AVX2__)
inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// sums[r][first + j] = a_r . w_j for R rows of integers at `a` (stride `padded`) and outputs
// first .. first + N - 1 of the task whose chunks start at `w`.
template <int R, int N>
void dot_rows(const int16_t* a, int64_t padded, const int8_t* w, int first, int32_t sums[4][kOuts]) {
  __m256i total[R][N];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < N; ++j) total[r][j] = _mm256_setzero_si256();
  }
  const int8_t* chunk = w + first * kLanes16;
  for (int64_t k = 0; k < padded; k += kLanes16, chunk += kChunk) {
    _mm_prefetch(reinterpret_cast<const char*>(chunk + kAhead), _MM_HINT_T0);
    __m256i weights[N];
    for (int j = 0; j < N; ++j) {
      weights[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + j * kLanes16)));
    }
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * padded + k));
      for (int j = 0; j < N; ++j) total[r][j] = _mm256_add_epi32(total[r][j], _mm256_madd_epi16(x, weights[j]));
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < N; ++j) sums[r][first + j] = sum8(total[r][j]);
  }
}

// R rows of integers times a task's kOuts outputs: all 4 in one pass for up to 2 rows, 2 a pass
// for 3-4 (sums, weights and x in 11-14 of AVX2's 16 registers).
template <int R>
void dot_task(const int16_t* a, int64_t padded, const int8_t* w, int32_t sums[4][kOuts]) {
  constexpr int N = R <= 2 ? 4 : 2;
  for (int first = 0; first < kOuts; first += N) dot_rows<R, N>(a, padded, w, first, sums);
}

// One row of integers times two tasks' outputs, their chunks at `w0` and `w1` far apart in the
// weights: two streams from memory at once (one stream at a time read 21-25 GB/s of weights on
// two cores of an AVX2 EPYC, two 30-38).
void dot_pair(const int16_t* a, int64_t padded, const int8_t* w0, const int8_t* w1, int32_t sums0[4][kOuts],
              int32_t sums1[4][kOuts]) {
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, u0 = s0, u1 = s0, u2 = s0, u3 = s0;
  auto product = [](__m256i x, const int8_t* w) {
    return _mm256_madd_epi16(x, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  };
  for (int64_t k = 0; k < padded; k += kLanes16, w0 += kChunk, w1 += kChunk) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + kAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + kAhead), _MM_HINT_T0);
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + k));
    s0 = _mm256_add_epi32(s0, product(x, w0));
    s1 = _mm256_add_epi32(s1, product(x, w0 + kLanes16));
    s2 = _mm256_add_epi32(s2, product(x, w0 + 2 * kLanes16));
    s3 = _mm256_add_epi32(s3, product(x, w0 + 3 * kLanes16));
    u0 = _mm256_add_epi32(u0, product(x, w1));
    u1 = _mm256_add_epi32(u1, product(x, w1 + kLanes16));
    u2 = _mm256_add_epi32(u2, product(x, w1 + 2 * kLanes16));
    u3 = _mm256_add_epi32(u3, product(x, w1 + 3 * kLanes16));
  }
  sums0[0][0] = sum8(s0), sums0[0][1] = sum8(s1), sums0[0][2] = sum8(s2), sums0[0][3] = sum8(s3);
  sums1[0][0] = sum8(u0), sums1[0][1] = sum8(u1), sums1[0][2] = sum8(u2), sums1[0][3] = sum8(u3);
}
#endif

// sums[r][j] for up to 4 rows and a task's kOuts outputs, its chunks at `w`.
void dot(int64_t rows, const int16_t* a, int64_t padded, const int8_t* w, int32_t sums[4][kOuts]) {
#if defined(__AVX2__)
  switch (rows) {
    case 1: dot_task<1>(a, padded, w, sums); return;
    case 2: dot_task<2>(a, padded, w, sums); return;
    case 3: dot_task<3>(a, padded, w, sums); return;
    default: dot_task<4>(a, padded, w, sums); return;
  }
#else
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < kOuts; ++j) {
      const int16_t* x = a + r * padded;
      int32_t s = 0;
      for (int64_t k = 0; k < padded; ++k) {
        s += static_cast<int32_t>(x[k]) * w[k / kLanes16 * kChunk + j * kLanes16 + k % kLanes16];
      }
      sums[r][j] = s;
    }
  }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define W8A8_VNNI 1
// AVX512-VNNI's panels (top of the file). |a (w + 128)| <= 128 * 255, 4 a lane a step: 2^16 inputs
// cannot overflow the 32-bit sums.
constexpr int64_t kPanel = 16;             // outputs a panel
constexpr int64_t kQuad = 4;               // inputs a lane sums
constexpr int64_t kStep = kPanel * kQuad;  // bytes of a panel per 4 inputs
constexpr int64_t kVnniAhead = 8 * kStep;  // how far ahead in its stream a panel prefetches

// ints [out, in] int8 -> [panels, padded / 4, kPanel, 4] uint8 (w + 128; padding 128: weight 0)
at::Tensor vnni_pack(const at::Tensor& ints, int64_t padded) {
  const int64_t out_features = ints.size(0), in = ints.size(1);
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  const at::Tensor shifted = (ints.to(at::kShort) + 128).to(at::kByte);
  return at::constant_pad_nd(shifted, {0, padded - in, 0, panels * kPanel - out_features}, 128)
      .view({panels, kPanel, padded / kQuad, kQuad})
      .permute({0, 2, 1, 3})
      .contiguous();
}

// Panels [p, p + G) times R rows of integers (int8 at `a`, stride `padded`) into `sums`
// [R][G * kPanel]: G streams of weights at once, R x G sums in registers.
template <int R, int G>
void vnni_tile(const int8_t* a, int64_t padded, const uint8_t* w, int32_t* sums) {
  const int64_t panel_bytes = padded * kPanel;
  __m512i total[R][G];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) total[r][g] = _mm512_setzero_si512();
  }
  for (int64_t k = 0; k < padded; k += kQuad, w += kStep) {
    __m512i x[R];
    for (int r = 0; r < R; ++r) x[r] = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + r * padded + k));
    for (int g = 0; g < G; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(w + g * panel_bytes + kVnniAhead), _MM_HINT_T0);
      const __m512i weights = _mm512_loadu_si512(w + g * panel_bytes);
      for (int r = 0; r < R; ++r) total[r][g] = _mm512_dpbusd_epi32(total[r][g], weights, x[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) _mm512_storeu_si512(sums + (r * G + g) * kPanel, total[r][g]);
  }
}

#if defined(TGIS_CPU_AMX) && defined(__AMX_INT8__)
#define W8A8_AMX 1
// The panels are AMX's B tiles as they lie (16 rows of 4 inputs a lane, 64 inputs a tile) and the
// rows' integers its A tiles: tdpbsud sums the same integers exactly, so calls of kTileFrom rows
// or more take the tile unit and a row's outputs are the same on either path.
constexpr int64_t kTileInputs = tgis_cpu::kTileBytes;  // int8 inputs of a B tile
constexpr int64_t kTileFrom = 4;
#endif

#endif

// Rows of y from their integer sums. A row's outputs must not depend on the path that summed
// them (a row alone or among others): with AVX2 the sums of a task's outputs are scaled in one
// 4-lane expression, whose rounding is the same wherever it runs (compiled loops were vectorized
// differently for one row and for several, and -ffast-math let their products round differently).
// y is written in x's dtype as it is stored (a float32 value rounded once, as at::Tensor::to
// rounds it), with no float32 copy of y to convert afterwards.
struct Epilogue {
  void* y;
  at::ScalarType dtype;  // y's: float32, bfloat16 or float16
  const float* scale;    // [out]: the weights' scales
  const float* steps;    // [rows]: the tokens' steps
  const float* offset;   // [out]: the bias, or nullptr
  int64_t out_features;

  // rows r0 .. r0 + pass - 1 of y for a task's outputs
  void store(int64_t task, int64_t r0, int64_t pass, const int32_t sums[4][kOuts]) const {
    const int64_t n = task * kOuts, count = std::min(kOuts, out_features - n);
#if defined(__AVX2__)
    alignas(16) float scales[kOuts] = {}, bias[kOuts] = {}, values[kOuts];
    for (int64_t j = 0; j < count; ++j) {
      scales[j] = scale[n + j];
      bias[j] = offset == nullptr ? 0.0f : offset[n + j];
    }
    const __m128 by = _mm_load_ps(scales), plus = _mm_load_ps(bias);
    for (int64_t r = 0; r < pass; ++r) {
      const __m128 sum = _mm_cvtepi32_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sums[r])));
      _mm_store_ps(values, _mm_add_ps(_mm_mul_ps(_mm_mul_ps(sum, by), _mm_set1_ps(steps[r0 + r])), plus));
      put(values, (r0 + r) * out_features + n, count);
    }
#else
    float values[kOuts];
    for (int64_t r = 0; r < pass; ++r) {
      for (int64_t j = 0; j < count; ++j) {
        const float value = static_cast<float>(sums[r][j]) * scale[n + j] * steps[r0 + r];
        values[j] = offset == nullptr ? value : value + offset[n + j];
      }
      put(values, (r0 + r) * out_features + n, count);
    }
#endif
  }

#if defined(W8A8_VNNI)
  // row r of y for panel p's outputs from their sums (vnni_tile's, the row's sum of integers not
  // yet taken off): one function, not inlined, so that a row's outputs are the same whichever
  // path summed them (-ffast-math may reorder a product inlined into different loops)
  __attribute__((noinline)) void store_panel(int64_t p, int64_t r, const int32_t* sums, int32_t row_sum) const {
    const int64_t n = p * kPanel, count = std::min(kPanel, out_features - n);
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1u);
    const __m512 by = _mm512_maskz_loadu_ps(valid, scale + n);
    const __m512 plus = offset == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(valid, offset + n);
    const __m512i total = _mm512_sub_epi32(_mm512_loadu_si512(sums), _mm512_set1_epi32(128 * row_sum));
    alignas(64) float values[kPanel];
    _mm512_store_ps(values, _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(total), by),
                                                        _mm512_set1_ps(steps[r])),
                                          plus));
    put(values, r * out_features + n, count);
  }
#endif

  // y[at, at + count) = values, in y's dtype
  void put(const float* values, int64_t at, int64_t count) const {
#if defined(W8A8_VNNI)
    // bfloat16: c10::BFloat16's rounding, 16 lanes at once. Not float_vectors.h's `store`, which
    // rounds finite values alike but has no NaN case (a NaN such as 0x7F800001 or 0x7FFFFFFF
    // comes out there as an infinity or -0; c10 writes 0x7FC0 for every NaN).
    if (dtype == at::kBFloat16) {
      const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1u);
      const __m512 v = _mm512_maskz_loadu_ps(valid, values);
      const __m512i u = _mm512_castps_si512(v);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i bits = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
      bits = _mm512_mask_set1_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), 0x7FC0);
      alignas(32) uint16_t halves[kPanel];
      _mm256_store_si256(reinterpret_cast<__m256i*>(halves), _mm512_cvtepi32_epi16(bits));
      std::memcpy(static_cast<c10::BFloat16*>(y) + at, halves, count * sizeof(uint16_t));
      return;
    }
#endif
    switch (dtype) {
      case at::kBFloat16: std::copy(values, values + count, static_cast<c10::BFloat16*>(y) + at); return;
      case at::kHalf: std::copy(values, values + count, static_cast<c10::Half*>(y) + at); return;
      default: std::copy(values, values + count, static_cast<float*>(y) + at); return;
    }
  }
};

// Rows [begin, end) of x as W8A8's integers and their steps; a bfloat16 or float16 row is widened
// here first (exact), one row at a time.
template <typename T>
void quantize_rows(const T* x, int64_t begin, int64_t end, int64_t in, int64_t padded, int16_t* a, float* steps) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t r = begin; r < end; ++r) steps[r] = quantize_row(x + r * in, in, padded, a + r * padded);
  } else {
    std::vector<float> row(in);
    for (int64_t r = begin; r < end; ++r) {
      std::copy(x + r * in, x + (r + 1) * in, row.begin());
      steps[r] = quantize_row(row.data(), in, padded, a + r * padded);
    }
  }
}

#if defined(W8A8_VNNI)
// y from the rows' integers (int16 at `ap`, stride `padded`) through VNNI's panels: a row alone
// reads 8 panels at once (8 streams of weights); more rows go 4 at a time through groups of 4
// panels, whose weights stay in L2 while every row passes.
void vnni_products(const int16_t* ap, int64_t rows, int64_t padded, const uint8_t* wp, int64_t panels,
                   const Epilogue& finish) {
  std::vector<int8_t> a(rows * padded);  // integers in [-128, 127]: exact in a byte
  std::vector<int32_t> row_sums(rows, 0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int16_t* from = ap + r * padded;
      int8_t* to = a.data() + r * padded;
      int32_t sum = 0;
      for (int64_t k = 0; k < padded; ++k) {
        to[k] = static_cast<int8_t>(from[k]);
        sum += from[k];
      }
      row_sums[r] = sum;
    }
  });
#if defined(W8A8_AMX)
  if (rows >= kTileFrom && padded % kTileInputs == 0 && tgis_cpu::amx_ready()) {
    const auto finish_row = [&](int64_t p, int64_t r, const int32_t* sums) {
      finish.store_panel(p, r, sums, row_sums[r]);
    };
    tgis_cpu::tile_products<tgis_cpu::Int8Products, int32_t>(reinterpret_cast<const char*>(a.data()), padded, rows,
                                                              padded / kTileInputs,
                                                              reinterpret_cast<const char*>(wp), panels, finish_row);
    return;
  }
#endif
  const int64_t panel_bytes = padded * kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t sums[4 * 8 * kPanel];
    const auto pass = [&](auto height, auto group, int64_t p, int64_t r0) {
      constexpr int R = decltype(height)::value, G = decltype(group)::value;
      vnni_tile<R, G>(a.data() + r0 * padded, padded, wp + p * panel_bytes, sums);
      for (int r = 0; r < R; ++r) {
        for (int g = 0; g < G; ++g) finish.store_panel(p + g, r0 + r, sums + (r * G + g) * kPanel, row_sums[r0 + r]);
      }
    };
    if (rows == 1) {
      over_groups<8>(begin, end, [&](auto group, int64_t p) { pass(std::integral_constant<int, 1>{}, group, p, 0); });
      return;
    }
    over_groups<4>(begin, end, [&](auto group, int64_t p) {
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        switch (std::min<int64_t>(4, rows - r0)) {
          case 1: pass(std::integral_constant<int, 1>{}, group, p, r0); break;
          case 2: pass(std::integral_constant<int, 2>{}, group, p, r0); break;
          case 3: pass(std::integral_constant<int, 3>{}, group, p, r0); break;
          default: pass(std::integral_constant<int, 4>{}, group, p, r0); break;
        }
      }
    });
  });
}
#else
// y from the rows' integers (int16 at `ap`, stride `padded`) through task_pack's tasks
void task_products(const int16_t* ap, int64_t rows, int64_t padded, const int8_t* wp, int64_t tasks,
                   const Epilogue& finish) {
  const int64_t task_bytes = padded * kOuts;
  for (int64_t block = 0; block < rows; block += kRowBlock) {
    const int64_t block_rows = std::min(kRowBlock, rows - block);
    at::parallel_for(0, tasks, 4, [&](int64_t begin, int64_t end) {
      int32_t sums[4][kOuts];
#if defined(__AVX2__)
      if (block_rows == 1) {  // a thread's tasks from the two halves of its share at once
        int32_t more[4][kOuts];
        const int64_t half = (end - begin) / 2;
        for (int64_t task = begin; task < begin + half; ++task) {
          dot_pair(ap + block * padded, padded, wp + task * task_bytes, wp + (task + half) * task_bytes, sums, more);
          finish.store(task, block, 1, sums);
          finish.store(task + half, block, 1, more);
        }
        begin += 2 * half;
      }
#endif
      for (int64_t task = begin; task < end; ++task) {
        for (int64_t r0 = block; r0 < block + block_rows; r0 += 4) {
          const int64_t pass = std::min<int64_t>(4, block + block_rows - r0);
          dot(pass, ap + r0 * padded, padded, wp + task * task_bytes, sums);
          finish.store(task, r0, pass, sums);
        }
      }
    });
  }
}
#endif

// w8a8_pack: our layout of the weights, VNNI's panels where the CPU has them, else tasks
at::Tensor w8a8_pack(const at::Tensor& ints) {
  TORCH_CHECK(ints.dim() == 2 && ints.scalar_type() == at::kChar, "ints: [out, in] int8");
  const int64_t padded = (ints.size(1) + kLanes16 - 1) / kLanes16 * kLanes16;
#if defined(W8A8_VNNI)
  TORCH_CHECK(padded <= 65536, "w8a8_pack: at most 65536 inputs (32-bit sums)");
  return vnni_pack(ints, padded);
#else
  return task_pack(ints, padded);
#endif
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 1,
              "scales: contiguous float32 [out]");
  TORCH_CHECK(x.dim() == 2, "x: [rows, in]");
  const int64_t out_features = scales.numel(), in = x.size(1);
  const int64_t rows = x.size(0), padded = (in + kLanes16 - 1) / kLanes16 * kLanes16;
#if defined(W8A8_VNNI)
  const bool laid_out = packed.dim() == 4 && packed.scalar_type() == at::kByte &&
                        packed.size(0) == (out_features + kPanel - 1) / kPanel && packed.size(1) == padded / kQuad &&
                        packed.size(2) == kPanel && packed.size(3) == kQuad;
#else
  const int64_t tasks = (out_features + kOuts - 1) / kOuts;
  const bool laid_out = packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.size(0) == tasks &&
                        packed.size(1) == padded / kLanes16 && packed.size(2) == kOuts && packed.size(3) == kLanes16;
#endif
  TORCH_CHECK(laid_out && packed.is_contiguous(),
              "packed: w8a8_pack's weights for ", out_features, " outputs of ", in, " inputs");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == out_features),
              "bias: contiguous float32 [out]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x: float32, bfloat16 or float16");
  const at::Tensor xc = x.contiguous();
  at::Tensor a = at::empty({rows, padded}, x.options().dtype(at::kShort));
  at::Tensor steps = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor y = at::empty({rows, out_features}, x.options());
  int16_t* ap = a.data_ptr<int16_t>();
  float* sp = steps.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    switch (x.scalar_type()) {
      case at::kBFloat16: quantize_rows(xc.data_ptr<c10::BFloat16>(), begin, end, in, padded, ap, sp); return;
      case at::kHalf: quantize_rows(xc.data_ptr<c10::Half>(), begin, end, in, padded, ap, sp); return;
      default: quantize_rows(xc.data_ptr<float>(), begin, end, in, padded, ap, sp); return;
    }
  });
  const float* scale = scales.data_ptr<float>();
  const float* offset = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const Epilogue finish{y.data_ptr(), y.scalar_type(), scale, sp, offset, out_features};
#if defined(W8A8_VNNI)
  vnni_products(ap, rows, padded, packed.data_ptr<uint8_t>(), packed.size(0), finish);
#else
  task_products(ap, rows, padded, packed.data_ptr<int8_t>(), tasks, finish);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgis_cpu, m) {
  m.def("w8a8_pack(Tensor ints) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) {
  m.impl("w8a8_pack", &w8a8_pack);
  m.impl("w8a8_linear", &w8a8_linear);
}
