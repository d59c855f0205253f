// Float vectors for the CPU kernels: 16 lanes (one AVX-512 register, or two AVX2 halves: GCC
// vector extensions compile to whatever -march=native gives) or the CPU's native width, loads of
// float, bfloat16 and float16 data as float, and stores back.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // the loads spelled out below
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
#define TGIS_VECTORS_AVX2 1  // native vectors are AVX2 registers: some operations spelled out
#endif

namespace tgis_cpu {

constexpr int64_t kLanes = 16;
using vf = float __attribute__((vector_size(kLanes * sizeof(float))));

inline float scalar(float x) { return x; }
inline float scalar(c10::BFloat16 x) { return static_cast<float>(x); }
inline float scalar(c10::Half x) { return static_cast<float>(x); }

// Vectors of the CPU's native width: kNative floats, one AVX-512 register or one AVX2 register.
// GCC keeps a 16-lane vf in two AVX2 registers in straight-line code, but moves arrays of them
// (a kernel's accumulators) through the stack and general registers: paged_decode_cpu.cpp's
// attention ran 3x slower that way on an AVX2 CPU. Kernels with such arrays use these.
#if defined(__AVX512F__)
constexpr int64_t kNative = 16;
#else
constexpr int64_t kNative = 8;
#endif
using vn = float __attribute__((vector_size(kNative * sizeof(float))));

// Loads of float, bfloat16 or float16 data into a float vector V; H (uint16_t), U (uint32_t) and
// F (_Float16) are the vectors of as many lanes (GCC drops a vector_size that depends on a
// template parameter, so each width names its own).
template <typename V, typename H, typename U, typename F>
struct Loads {
  static V of(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }

  static V of(const c10::BFloat16* p) {  // bfloat16 is the upper half of a float
    H h;
    std::memcpy(&h, p, sizeof h);
    const U bits = __builtin_convertvector(h, U) << 16;
    V v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }

  static V of(const c10::Half* p) {
    F h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, V);
  }
};

template <int64_t N>
struct Lanes;  // the vectors of N lanes

template <>
struct Lanes<8> {
  using H = uint16_t __attribute__((vector_size(8 * sizeof(uint16_t))));
  using U = uint32_t __attribute__((vector_size(8 * sizeof(uint32_t))));
  using F = _Float16 __attribute__((vector_size(8 * sizeof(_Float16))));
};

template <>
struct Lanes<16> {
  using H = uint16_t __attribute__((vector_size(16 * sizeof(uint16_t))));
  using U = uint32_t __attribute__((vector_size(16 * sizeof(uint32_t))));
  using F = _Float16 __attribute__((vector_size(16 * sizeof(_Float16))));
};

// Overloads, not templates: a template would tie with c10's `load` (found through the
// argument's namespace).
using Loads16 = Loads<vf, Lanes<kLanes>::H, Lanes<kLanes>::U, Lanes<kLanes>::F>;
using LoadsNative = Loads<vn, Lanes<kNative>::H, Lanes<kNative>::U, Lanes<kNative>::F>;
inline vf load(const float* p) { return Loads16::of(p); }
inline vf load(const c10::BFloat16* p) { return Loads16::of(p); }
inline vf load(const c10::Half* p) { return Loads16::of(p); }
inline vn load_native(const float* p) { return LoadsNative::of(p); }
// On AVX2 two spelled-out instructions each: GCC built the bfloat16 widening and the lane sum of
// the generic vectors from per-lane moves (3 bf16 heads of 8,192 x 512 on speculator_cpu.cpp's dot
// products, 1 row, 2-core AVX2 EPYC: 1.1-1.5 ms per chain before, 0.5-0.8 ms after, alternated).
// On AVX-512 the widening is spelled out too: GCC widened each half apart and joined them
// (vpmovzxwd twice, vinserti64x4), the most of paged_decode_cpu.cpp's inner loop.
inline vn load_native(const c10::BFloat16* p) {
#if defined(TGIS_VECTORS_AVX2)
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
  vn v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#elif defined(__AVX512F__)
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16);
  vn v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#else
  return LoadsNative::of(p);
#endif
}
inline vn load_native(const c10::Half* p) { return LoadsNative::of(p); }

// Stores of 16 floats as float, bfloat16 (rounded to nearest even) or float16.
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline void store(c10::BFloat16* p, vf v) {
  using vh = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  using vu = uint32_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  vu bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vh h = __builtin_convertvector(bits, vh);
  std::memcpy(p, &h, sizeof h);
}

inline void store(c10::Half* p, vf v) {
  using vh = _Float16 __attribute__((vector_size(kLanes * sizeof(_Float16))));
  const vh h = __builtin_convertvector(v, vh);
  std::memcpy(p, &h, sizeof h);
}

inline float sum(vf v) {
  float total = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

inline float sum_native(vn v) {
#if defined(TGIS_VECTORS_AVX2)
  __m256 x;
  std::memcpy(&x, &v, sizeof x);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
#else
  float total = 0.f;
  for (int64_t i = 0; i < kNative; ++i) total += v[i];
  return total;
#endif
}

}  // namespace tgis_cpu
