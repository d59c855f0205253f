// Products of linears whose weights are integers with a scale and an offset per group of input
// channels (quantization/int4.py's Int4Linear, quantization/int8_groups.py's Int8GroupLinear), on
// CPU. A weight is value * scale + offset of its group, computed in float.
//
// int4_linear_unpacked   4-bit weights for calls with more rows than torch's int4 kernel serves
//                        well (prompts): unpacked to the model's dtype a slice of output rows at a
//                        time, in one pass that reads each packed byte once and writes each weight
//                        once (Int4Linear.unpacked's tensor form takes five passes), each slice
//                        multiplied in turn.
//   packed        [padded, in / 2] uint8 in the layout of torch's CPU int4 kernel
//                 (_convert_weight_to_int4pack_for_cpu): per block of 64 output rows, input
//                 channel k's 32 bytes hold row i's value in the low nibble of byte i and row
//                 32 + i's in the high nibble (i < 32); value = nibble - 8
//   scale_offset  [groups, padded, 2] (scale, offset) of each group and output row, model dtype
//
// int8_group_linear      8-bit weights (GPTQ's 8-bit checkpoints): calls of up to kDirectRows rows
//                        read the int8 values straight into vector registers (one pass over the
//                        weights: decode is bound by reading them, a byte each), larger calls
//                        multiply slices of unpacked weights as above.
//   values        [out, in] int8, row-major
//   scale_offset  [groups, out, 2] float32
//
// Built with the other CPU kernels by text_generation_server/kernels/cpu_kernels.py as
// torch.ops.tgis_cpu.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "float_vectors.h"

namespace {

using tgis_cpu::kLanes;
using tgis_cpu::vf;

constexpr int64_t kBlock = 64;  // output rows per block of the int4 packed layout
constexpr int64_t kTile = 64;   // input channels per tile of the int4 unpacking
// int8_group_linear reads the weights directly up to this many rows. On a 2-core Xeon with AMX, bf16
// activations, groups of 128, 2048 x 2048 weights in cache: 0.15 / 0.39 / 0.58 ms at 1 / 8 / 12 rows
// directly, 0.55 ms at 13 over unpacked slices, 0.31 ms for bf16 weights; one row through 0.93 GB
// of a 1 B Llama's projections (beyond the caches): 0.65x bf16's time.
constexpr int64_t kDirectRows = 12;

#if defined(__AVX2__) || defined(__AVX512F__)
// 16 signed or unsigned bytes as floats (GCC's vector conversions scalarize int8 -> int32 / float,
// so the widening is spelled out).
template <bool Signed>
inline vf widen(__m128i bytes) {
  vf v;
#if defined(__AVX512F__)
  const __m512i ints = Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  const __m512 f = _mm512_cvtepi32_ps(ints);
  std::memcpy(&v, &f, sizeof v);
#else
  const __m128i upper = _mm_srli_si128(bytes, 8);
  const __m256 low = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
  const __m256 high = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper));
  std::memcpy(&v, &low, sizeof low);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof low, &high, sizeof high);
#endif
  return v;
}

inline vf load_int8(const int8_t* p) { return widen<true>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// in[r] (16 rows of 16 bytes) transposed: out[c] holds byte c of every row, in row order.
inline void transpose_bytes(const __m128i in[16], __m128i out[16]) {
  __m128i a[16], b[16], c[16];
  for (int i = 0; i < 8; ++i) {  // a[h * 8 + i]: columns 8h..8h+7, rows 2i, 2i + 1
    a[i] = _mm_unpacklo_epi8(in[2 * i], in[2 * i + 1]);
    a[i + 8] = _mm_unpackhi_epi8(in[2 * i], in[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // b[q * 4 + i]: columns 4q..4q+3, rows 4i..4i+3
    for (int i = 0; i < 4; ++i) {
      b[h * 8 + i] = _mm_unpacklo_epi16(a[h * 8 + 2 * i], a[h * 8 + 2 * i + 1]);
      b[h * 8 + 4 + i] = _mm_unpackhi_epi16(a[h * 8 + 2 * i], a[h * 8 + 2 * i + 1]);
    }
  }
  for (int q = 0; q < 4; ++q) {  // c[q * 4 + p * 2 + i]: columns 4q + 2p, 4q + 2p + 1, rows 8i..8i+7
    for (int i = 0; i < 2; ++i) {
      c[q * 4 + i] = _mm_unpacklo_epi32(b[q * 4 + 2 * i], b[q * 4 + 2 * i + 1]);
      c[q * 4 + 2 + i] = _mm_unpackhi_epi32(b[q * 4 + 2 * i], b[q * 4 + 2 * i + 1]);
    }
  }
  for (int q = 0; q < 4; ++q) {
    for (int p = 0; p < 2; ++p) {
      out[4 * q + 2 * p] = _mm_unpacklo_epi64(c[q * 4 + p * 2], c[q * 4 + p * 2 + 1]);
      out[4 * q + 2 * p + 1] = _mm_unpackhi_epi64(c[q * 4 + p * 2], c[q * 4 + p * 2 + 1]);
    }
  }
}

// Input channels [k, k + 16) of one block of 64 rows of 4-bit weights (`bytes`: the block's packed
// bytes), all in one group (`scale`, `bias`: each row's scale and offset - 8 * scale), into `rows`
// (row i of the block at rows + i * stride, up to `count` rows): for each half of the 32 bytes of
// a channel, 16 channels' bytes transposed so that each row's 16 values lie in one register.
template <typename T>
void unpack_int4_16(const uint8_t* bytes, int64_t k, const float* scale, const float* bias, T* rows, int64_t stride,
                    int64_t count) {
  const __m128i nibble = _mm_set1_epi8(15);
  for (int half = 0; half < 2; ++half) {
    __m128i in[16], out[16];
    for (int c = 0; c < 16; ++c) {
      in[c] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + (k + c) * (kBlock / 2) + half * 16));
    }
    transpose_bytes(in, out);
    for (int i = 0; i < 16; ++i) {  // out[i]: row half * 16 + i in the low nibbles, 32 rows on in the high
      const int64_t low = half * 16 + i, high = low + kBlock / 2;
      if (low < count) {
        tgis_cpu::store(rows + low * stride, widen<false>(_mm_and_si128(out[i], nibble)) * scale[low] + bias[low]);
      }
      if (high < count) {
        const __m128i upper = _mm_and_si128(_mm_srli_epi16(out[i], 4), nibble);
        tgis_cpu::store(rows + high * stride, widen<false>(upper) * scale[high] + bias[high]);
      }
    }
  }
}
#else
inline vf load_int8(const int8_t* p) {
  vf v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
#endif

// Rows [first, last) of 4-bit weights into `out` (row `first` at out[0]); `first` is a multiple of 64.
// Blocks and tiles of 64 input channels run in parallel. Where groups and the input channels come
// in sixteens (and the CPU has AVX2), 16 channels at a time are transposed in registers and
// written out a row vector at a time (2048 x 2048 in 2 MB slices: about twice as fast as the
// tiles); otherwise a tile is built in float in a buffer that stays in L1 and written out row by
// row.
template <typename T>
void unpack_int4(const uint8_t* packed, const T* scale_offset, T* out, int64_t first, int64_t last, int64_t padded,
                 int64_t in, int64_t group) {
  const int64_t blocks = (last - first + kBlock - 1) / kBlock, tiles = (in + kTile - 1) / kTile;
#if defined(__AVX2__) || defined(__AVX512F__)
  const bool vectors = group % 16 == 0 && in % 16 == 0;
#else
  const bool vectors = false;
#endif
  at::parallel_for(0, blocks * tiles, 1, [&](int64_t begin, int64_t end) {
    float tile[kBlock][kTile];
    float scale[kBlock], offset[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = first / kBlock + task / tiles, k0 = (task % tiles) * kTile, k1 = std::min(in, k0 + kTile);
      const uint8_t* bytes = packed + block * in * (kBlock / 2);
      const int64_t rows = std::min(kBlock, last - block * kBlock);
      int64_t loaded = -1;  // the group whose scales are in `scale` / `offset`
      const auto load_group = [&](int64_t k) {
        if (k / group == loaded) return;
        loaded = k / group;
        const T* so = scale_offset + (loaded * padded + block * kBlock) * 2;
        for (int64_t i = 0; i < kBlock; ++i) {
          scale[i] = static_cast<float>(so[2 * i]);
          offset[i] = static_cast<float>(so[2 * i + 1]);
        }
      };
#if defined(__AVX2__) || defined(__AVX512F__)
      if (vectors) {
        float bias[kBlock];  // offset - 8 * scale: the values' - 8 folded in
        for (int64_t k = k0; k < k1; k += 16) {
          if (k / group != loaded) {
            load_group(k);
            for (int64_t i = 0; i < kBlock; ++i) bias[i] = offset[i] - 8.f * scale[i];
          }
          unpack_int4_16(bytes, k, scale, bias, out + (block * kBlock - first) * in + k, in, rows);
        }
        continue;
      }
#endif
      for (int64_t k = k0; k < k1; ++k) {
        load_group(k);
        const uint8_t* b = bytes + k * (kBlock / 2);
        const int64_t column = k - k0;
        for (int64_t i = 0; i < kBlock / 2; ++i) {
          tile[i][column] = static_cast<float>((b[i] & 15) - 8) * scale[i] + offset[i];
          const int64_t j = i + kBlock / 2;
          tile[j][column] = static_cast<float>((b[i] >> 4) - 8) * scale[j] + offset[j];
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        T* row = out + (block * kBlock + i - first) * in;
        for (int64_t k = k0; k < k1; ++k) row[k] = static_cast<T>(tile[i][k - k0]);
      }
    }
  });
}

// Rows [first, last) of 8-bit weights into `out` (row `first` at out[0]), a row per task.
template <typename T>
void unpack_int8(const int8_t* values, const float* scale_offset, T* out, int64_t first, int64_t last,
                 int64_t out_features, int64_t in, int64_t group) {
  at::parallel_for(first, last, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* v = values + n * in;
      T* row = out + (n - first) * in;
      for (int64_t g = 0; g < in / group; ++g) {
        const float scale = scale_offset[(g * out_features + n) * 2], offset = scale_offset[(g * out_features + n) * 2 + 1];
        int64_t k = g * group;
        for (; k + kLanes <= (g + 1) * group; k += kLanes) tgis_cpu::store(row + k, load_int8(v + k) * scale + offset);
        for (; k < (g + 1) * group; ++k) row[k] = static_cast<T>(v[k] * scale + offset);
      }
    }
  });
}

// x [rows, in] times weights that `unpack(first, last, buffer)` writes a slice of output rows at a
// time into `buffer`, plus bias: each slice's product written to its rows of the transposed
// output. A large layer's whole unpacked matrix is a fresh allocation each call, paid in page
// faults and memory traffic, and a slice that stays in the caches is cheap to write and read back,
// but each slice's product packs x anew: on a 2-core Xeon with AMX, bf16, 2048 x 2048 4-bit
// weights took 0.73 / 1.00 / 1.84 ms at 21 / 64 / 128 rows in 2 MB slices against 0.96 / 1.09 /
// 1.37 ms in 8 MB slices (8192 x 2048: 2.70 / 4.09 / 7.26 against 3.68 / 4.40 / 5.24 ms).
constexpr int64_t kSliceBytes = 8 << 20;
constexpr int64_t kSmallSliceBytes = 2 << 20;  // for calls of up to kSmallSliceRows rows
constexpr int64_t kSmallSliceRows = 64;

// fn(buffer's data) with the element type of its dtype: float32, bfloat16 or float16.
template <typename Fn>
void with_model_dtype(at::Tensor& buffer, Fn fn) {
  switch (buffer.scalar_type()) {
    case at::kBFloat16:
      return fn(buffer.data_ptr<c10::BFloat16>());
    case at::kHalf:
      return fn(buffer.data_ptr<c10::Half>());
    case at::kFloat:
      return fn(buffer.data_ptr<float>());
    default:
      TORCH_CHECK(false, "x: float32, bfloat16 or float16");
  }
}

template <typename Unpack>
at::Tensor sliced_product(const at::Tensor& x, int64_t out_features, const std::optional<at::Tensor>& bias,
                          Unpack unpack) {
  const int64_t in = x.size(1);
  const int64_t bytes = x.size(0) <= kSmallSliceRows ? kSmallSliceBytes : kSliceBytes;
  const int64_t slice = std::max<int64_t>(kBlock, bytes / (in * x.element_size()) / kBlock * kBlock);
  at::Tensor buffer = at::empty({std::min(slice, out_features), in}, x.options());
  at::Tensor transposed = at::empty({out_features, x.size(0)}, x.options());  // slices are its rows
  const at::Tensor xt = x.t();
  for (int64_t first = 0; first < out_features; first += slice) {
    const int64_t last = std::min(out_features, first + slice);
    unpack(first, last, buffer);
    at::Tensor rows = transposed.narrow(0, first, last - first);
    at::mm_out(rows, buffer.narrow(0, 0, last - first), xt);
  }
  at::Tensor y = transposed.t().contiguous();
  if (bias.has_value()) y.add_(*bias);
  return y;
}

at::Tensor int4_linear_unpacked(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offset,
                                int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed: contiguous [padded, in / 2] uint8");
  const int64_t padded = packed.size(0), in = packed.size(1) * 2;
  TORCH_CHECK(padded % kBlock == 0 && out_features <= padded, "packed rows come in blocks of 64");
  TORCH_CHECK(group_size > 0 && in % group_size == 0, "groups must tile the input channels");
  TORCH_CHECK(scale_offset.is_contiguous() && scale_offset.dim() == 3 && scale_offset.size(0) == in / group_size &&
                  scale_offset.size(1) == padded && scale_offset.size(2) == 2,
              "scale_offset: contiguous [groups, padded, 2]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == scale_offset.scalar_type() && x.size(1) == in && x.is_contiguous(),
              "x: contiguous [rows, in] in the scales' dtype");
  return sliced_product(x, out_features, bias, [&](int64_t first, int64_t last, at::Tensor& buffer) {
    with_model_dtype(buffer, [&](auto* out) {
      using T = std::remove_pointer_t<decltype(out)>;
      unpack_int4(packed.data_ptr<uint8_t>(), scale_offset.data_ptr<T>(), out, first, last, padded, in, group_size);
    });
  });
}

// y [R, out] = xf [R, in] times the 8-bit weights, output rows [n, n + N): each vector of weights
// scaled by its group's scale and multiplied into R x N vector sums (N output rows share each load
// of x), plus each group's offset times the group's sum of x (`sums` [R, groups]); one horizontal
// sum per row and output. The next N rows' weights are prefetched as these are read (without it
// the kernel reached about two thirds of the memory bandwidth bf16 products reach). Needs
// group % 16 == 0.
template <int R, int N>
void direct_int8_rows(const float* xf, const float* sums, const int8_t* values, const float* scale_offset, float* y,
                      int64_t n, int64_t out_features, int64_t in, int64_t group) {
  vf total[R][N];
  float offsets[R][N];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < N; ++j) {
      total[r][j] = vf{};
      offsets[r][j] = 0.f;
    }
  }
  // the next N rows (the last ones again at the end: a prefetch past the weights is never formed)
  const int8_t* ahead = values + std::min(n + N, std::max<int64_t>(out_features - N, 0)) * in;
  for (int64_t g = 0; g < in / group; ++g) {
    float scale[N], offset[N];
    for (int j = 0; j < N; ++j) {
      scale[j] = scale_offset[(g * out_features + n + j) * 2];
      offset[j] = scale_offset[(g * out_features + n + j) * 2 + 1];
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += kLanes) {
      vf w[N];
      for (int j = 0; j < N; ++j) {
        __builtin_prefetch(ahead + j * in + k);
        w[j] = load_int8(values + (n + j) * in + k) * scale[j];
      }
      for (int r = 0; r < R; ++r) {
        const vf x = tgis_cpu::load(xf + r * in + k);
        for (int j = 0; j < N; ++j) total[r][j] += x * w[j];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < N; ++j) offsets[r][j] += offset[j] * sums[r * (in / group) + g];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < N; ++j) y[r * out_features + n + j] = tgis_cpu::sum(total[r][j]) + offsets[r][j];
  }
}

template <int R>
void direct_int8(const float* xf, const float* sums, const int8_t* values, const float* scale_offset, float* y,
                 int64_t out_features, int64_t in, int64_t group) {
  constexpr int kPair = 2;  // output rows per pass: 2 x R sums stay in the 32 vector registers
  at::parallel_for(0, (out_features + kPair - 1) / kPair, 8, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t n = pair * kPair;
      if (n + kPair <= out_features) {
        direct_int8_rows<R, kPair>(xf, sums, values, scale_offset, y, n, out_features, in, group);
      } else {
        direct_int8_rows<R, 1>(xf, sums, values, scale_offset, y, n, out_features, in, group);
      }
    }
  });
}

template <int R>
void direct_int8_up_to(int64_t rows, const float* xf, const float* sums, const int8_t* values,
                       const float* scale_offset, float* y, int64_t out_features, int64_t in, int64_t group) {
  if constexpr (R > 1) {
    if (rows < R) return direct_int8_up_to<R - 1>(rows, xf, sums, values, scale_offset, y, out_features, in, group);
  }
  direct_int8<R>(xf, sums, values, scale_offset, y, out_features, in, group);
}

at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scale_offset,
                             int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kChar && values.is_contiguous(),
              "values: contiguous [out, in] int8");
  const int64_t out_features = values.size(0), in = values.size(1);
  TORCH_CHECK(group_size > 0 && in % group_size == 0, "groups must tile the input channels");
  TORCH_CHECK(scale_offset.scalar_type() == at::kFloat && scale_offset.is_contiguous() && scale_offset.dim() == 3 &&
                  scale_offset.size(0) == in / group_size && scale_offset.size(1) == out_features &&
                  scale_offset.size(2) == 2,
              "scale_offset: contiguous float32 [groups, out, 2]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in && x.is_contiguous(), "x: contiguous [rows, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x: float32, bfloat16 or float16");
  const int64_t rows = x.size(0);
  if (rows <= kDirectRows && group_size % kLanes == 0) {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    const at::Tensor sums = xf.view({rows, in / group_size, group_size}).sum(-1).contiguous();
    at::Tensor y = at::empty({rows, out_features}, xf.options());
    if (rows > 0) {
      direct_int8_up_to<kDirectRows>(rows, xf.data_ptr<float>(), sums.data_ptr<float>(), values.data_ptr<int8_t>(),
                                     scale_offset.data_ptr<float>(), y.data_ptr<float>(), out_features, in,
                                     group_size);
    }
    if (bias.has_value()) y.add_(*bias);
    return y.to(x.scalar_type());
  }
  return sliced_product(x, out_features, bias, [&](int64_t first, int64_t last, at::Tensor& buffer) {
    with_model_dtype(buffer, [&](auto* out) {
      unpack_int8(values.data_ptr<int8_t>(), scale_offset.data_ptr<float>(), out, first, last, out_features, in,
                  group_size);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgis_cpu, m) {
  m.def(
      "int4_linear_unpacked(Tensor x, Tensor packed, Tensor scale_offset, int group_size, int out_features, "
      "Tensor? bias) -> Tensor");
  m.def("int8_group_linear(Tensor x, Tensor values, Tensor scale_offset, int group_size, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) {
  m.impl("int4_linear_unpacked", &int4_linear_unpacked);
  m.impl("int8_group_linear", &int8_group_linear);
}
