// W8A8's product with exact integer sums on CPUs whose int8 instructions cannot give them
// (quantization/int8.py's Int8Linear where oneDNN's 8-bit products saturate: AVX2 without VNNI).
//
// w8a8_linear(x [rows, in], ints [out, in] int8, scales [out] float32, bias [out] float32 or None)
//   -> [rows, out] in x's dtype: each token rounded to W8A8's integers a = round(x / s) clamped to
//   [-128, 127] with s = max |x| / 127.5 (compressed-tensors' symmetric per-token rounding, halves
//   to even as torch.round), y = (sum_k a_k w_k) * scales[n] * s + bias, the sums exact in int32.
//
// With AVX2 the integers are 16-bit and vpmaddwd multiplies 16 of them by 16 weights widened from
// their bytes, summing pairs into 32 bits (no saturation: |a w| <= 2^14): what VNNI computes, at a
// byte read per weight. Output rows go in tasks of kOuts whose weights stay in L1 while the rows of
// x pass through them up to 4 at a time (R x N sums in registers), the next task's weights
// prefetched; prompts go in blocks of kRowBlock rows, whose 16-bit integers stay in L2 while all
// tasks read them. Elsewhere plain loops (the compiler vectorizes them for its target).
//
// Built with the other CPU kernels by text_generation_server/kernels/cpu_kernels.py as
// torch.ops.tgis_cpu.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

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

#if defined(__AVX2__)
inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// sums[r][j] = a_r . w_{n + j} for R rows of integers at `a` (stride `padded`) and N output rows
// from n.
template <int R, int N>
void dot_rows(const int16_t* a, int64_t padded, const int8_t* ints, int64_t n, int64_t out_features, int64_t in,
              int32_t sums[4][kOuts]) {
  __m256i total[R][N];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < N; ++j) total[r][j] = _mm256_setzero_si256();
  }
  const int8_t* ahead = ints + std::min(n + kOuts, std::max<int64_t>(out_features - N, 0)) * in;
  const int64_t whole = in - in % kLanes16;
  for (int64_t k = 0; k < whole; k += kLanes16) {
    if ((k & 63) == 0) {
      for (int j = 0; j < N; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * in + k), _MM_HINT_T0);
    }
    __m256i w[N];
    for (int j = 0; j < N; ++j) {
      w[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ints + (n + j) * in + k)));
    }
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * padded + k));
      for (int j = 0; j < N; ++j) total[r][j] = _mm256_add_epi32(total[r][j], _mm256_madd_epi16(x, w[j]));
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < N; ++j) {
      int32_t s = sum8(total[r][j]);
      const int8_t* w = ints + (n + j) * in;
      for (int64_t k = whole; k < in; ++k) s += static_cast<int32_t>(a[r * padded + k]) * w[k];
      sums[r][j] = s;
    }
  }
}

// R rows of integers times output rows [n, n + count), count <= kOuts: N = 4 outputs a pass for up
// to 2 rows, 2 for 3-4 (sums, weights and x in 11-13 of AVX2's 16 registers).
template <int R>
void dot_task(const int16_t* a, int64_t padded, const int8_t* ints, int64_t n, int64_t count, int64_t out_features,
              int64_t in, int32_t sums[4][kOuts]) {
  constexpr int N = R <= 2 ? 4 : 2;
  int32_t part[4][kOuts];
  int64_t j = 0;
  for (; j + N <= count; j += N) {
    dot_rows<R, N>(a, padded, ints, n + j, out_features, in, part);
    for (int r = 0; r < R; ++r) std::copy(part[r], part[r] + N, sums[r] + j);
  }
  for (; j < count; ++j) {
    dot_rows<R, 1>(a, padded, ints, n + j, out_features, in, part);
    for (int r = 0; r < R; ++r) sums[r][j] = part[r][0];
  }
}
#endif

// sums[r][j] for up to 4 rows and kOuts outputs.
void dot(int64_t rows, const int16_t* a, int64_t padded, const int8_t* ints, int64_t n, int64_t count,
         int64_t out_features, int64_t in, int32_t sums[4][kOuts]) {
#if defined(__AVX2__)
  switch (rows) {
    case 1: dot_task<1>(a, padded, ints, n, count, out_features, in, sums); return;
    case 2: dot_task<2>(a, padded, ints, n, count, out_features, in, sums); return;
    case 3: dot_task<3>(a, padded, ints, n, count, out_features, in, sums); return;
    default: dot_task<4>(a, padded, ints, n, count, out_features, in, sums); return;
  }
#else
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < count; ++j) {
      const int8_t* w = ints + (n + j) * in;
      const int16_t* x = a + r * padded;
      int32_t s = 0;
      for (int64_t k = 0; k < in; ++k) s += static_cast<int32_t>(x[k]) * w[k];
      sums[r][j] = s;
    }
  }
#endif
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& ints, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(ints.dim() == 2 && ints.scalar_type() == at::kChar && ints.is_contiguous(),
              "ints: contiguous [out, in] int8");
  const int64_t out_features = ints.size(0), in = ints.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == out_features,
              "scales: contiguous float32 [out]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == out_features),
              "bias: contiguous float32 [out]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in, "x: [rows, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x: float32, bfloat16 or float16");
  const int64_t rows = x.size(0), padded = (in + kLanes16 - 1) / kLanes16 * kLanes16;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor a = at::empty({rows, padded}, x.options().dtype(at::kShort));
  at::Tensor steps = at::empty({rows}, xf.options());
  at::Tensor y = at::empty({rows, out_features}, xf.options());
  const float* xp = xf.data_ptr<float>();
  int16_t* ap = a.data_ptr<int16_t>();
  float* sp = steps.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) sp[r] = quantize_row(xp + r * in, in, padded, ap + r * padded);
  });
  const int8_t* wp = ints.data_ptr<int8_t>();
  const float* scale = scales.data_ptr<float>();
  const float* offset = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tasks = (out_features + kOuts - 1) / kOuts;
  for (int64_t block = 0; block < rows; block += kRowBlock) {
    const int64_t block_rows = std::min(kRowBlock, rows - block);
    at::parallel_for(0, tasks, 4, [&](int64_t begin, int64_t end) {
      int32_t sums[4][kOuts];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task * kOuts, count = std::min(kOuts, out_features - n);
        for (int64_t r0 = block; r0 < block + block_rows; r0 += 4) {
          const int64_t pass = std::min<int64_t>(4, block + block_rows - r0);
          dot(pass, ap + r0 * padded, padded, wp, n, count, out_features, in, sums);
          for (int64_t r = 0; r < pass; ++r) {
            float* out = yp + (r0 + r) * out_features + n;
            for (int64_t j = 0; j < count; ++j) {
              const float value = static_cast<float>(sums[r][j]) * scale[n + j] * sp[r0 + r];
              out[j] = offset == nullptr ? value : value + offset[n + j];
            }
          }
        }
      }
    });
  }
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgis_cpu, m) {
  m.def("w8a8_linear(Tensor x, Tensor ints, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
