// Float vectors for the CPU kernels: 16 lanes (one AVX-512 register, or two AVX2 halves: GCC
// vector extensions compile to whatever -march=native gives) and loads of float, bfloat16 and
// float16 data as float, and stores back.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace tgis_cpu {

constexpr int64_t kLanes = 16;
using vf = float __attribute__((vector_size(kLanes * sizeof(float))));

inline float scalar(float x) { return x; }
inline float scalar(c10::BFloat16 x) { return static_cast<float>(x); }
inline float scalar(c10::Half x) { return static_cast<float>(x); }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load(const c10::BFloat16* p) {  // bfloat16 is the upper half of a float
  using vh = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  using vu = uint32_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu bits = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline vf load(const c10::Half* p) {
  using vh = _Float16 __attribute__((vector_size(kLanes * sizeof(_Float16))));
  vh h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vf);
}

// Vectors of the CPU's native width: kNative floats, one AVX-512 register or one AVX2 register.
// GCC keeps a 16-lane vf in two AVX2 registers in straight-line code, but moves arrays of them
// (a kernel's accumulators) through the stack and general registers: paged_decode_cpu.cpp's
// attention ran 10x slower that way on an AVX2 CPU. Kernels with such arrays use these.
#if defined(__AVX512F__)
constexpr int64_t kNative = 16;
#else
constexpr int64_t kNative = 8;
#endif
using vn = float __attribute__((vector_size(kNative * sizeof(float))));

inline vn load_native(const float* p) {
  vn v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vn load_native(const c10::BFloat16* p) {
  using vh = uint16_t __attribute__((vector_size(kNative * sizeof(uint16_t))));
  using vu = uint32_t __attribute__((vector_size(kNative * sizeof(uint32_t))));
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu bits = __builtin_convertvector(h, vu) << 16;
  vn v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline vn load_native(const c10::Half* p) {
  using vh = _Float16 __attribute__((vector_size(kNative * sizeof(_Float16))));
  vh h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vn);
}

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

}  // namespace tgis_cpu
