// Products of linears whose weights are integers with a scale and an offset per group of input
// channels (quantization/int4.py's Int4Linear, quantization/int8_groups.py's Int8GroupLinear), on
// CPU. A weight is value * scale + offset of its group, computed in float.
//
// int4_linear            4-bit weights (Int4Linear's product): on AMX, tiles of the integers for
//                        any number of rows (amx_int4 below); elsewhere torch's int4 kernel for few
//                        rows and int4_linear_unpacked beyond.
// int4_linear_unpacked   4-bit weights for calls with more rows than torch's int4 kernel serves
//                        well (prompts): unpacked to the model's dtype a slice of output rows at a
//                        time, in one pass that reads each packed byte once and writes each weight
//                        once (Int4Linear.unpacked's tensor form takes five passes), each slice
//                        multiplied in turn.
//   packed        [padded, in / 2] uint8 in quantization/int4.py's `pack` layout (torch's CPU
//                 int4 kernel's on AVX-512; on AVX2 torch packs blocks of 32, and int4.py passes
//                 max_rows 0 there so that its kernel never gets ours): per block of 64 output
//                 rows, input channel k's 32 bytes hold row i's value in the low nibble of byte i
//                 and row 32 + i's in the high nibble (i < 32); value = nibble - 8
//   scale_offset  [groups, padded, 2] (scale, offset) of each group and output row, model dtype
//
// int8_group_linear      8-bit weights (GPTQ's 8-bit checkpoints): on AMX, bf16 calls of 3 to 64
//                        rows take AMX's integer products (amx_int8 below: the int8 values are
//                        the tiles as stored, x in 16-bit fixed point); other calls of up to
//                        kDirectRows rows (kAvx2DirectRows on CPUs with AVX2 but not AVX-512)
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
#include <utility>
#include <vector>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "amx.h"
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


#if defined(TGIS_CPU_AMX) && defined(__AVX512VBMI__)
#define TGIS_AMX 1
using tgis_cpu::amx_ready;
using tgis_cpu::configure_tiles;
using tgis_cpu::load_tiles;
using tgis_cpu::TileConfig;
// 4-bit weights on AMX (Intel's tile matrix unit, bf16). Each 32 input channels x 16 output rows
// of the packed weights become one B tile holding 128 + q per weight (exact in bf16, made by bit
// operations: no arithmetic per weight), laid out as the tile product wants (an output row's pairs
// of input channels side by side); up to 16 rows of x are an A tile; tdpbf16ps sums x times those
// values in float32 over each group, and each group's sums are scaled by the group's scale, the
// offset (and the 128 + 8 the tiles add to each integer) coming in through the group's sum of x:
//   y[r, n] = sum_g scale[g, n] * T[r, n, g] + (offset[g, n] - 136 scale[g, n]) * X[r, g]
//   T[r, n, g] = sum_{k in g} x[r, k] (128 + q[n, k]),  X[r, g] = sum_{k in g} x[r, k]
// which is the weights' definition, w = (q - 8) * scale + offset, without rounding them to bf16.
// A task is a block of 64 output rows (the packed layout's block): its B tiles are built 128
// channels at a time and serve every 16 rows of x. Needs bf16 x, groups and input channels in
// multiples of 32. On a 2-core Xeon with AMX, the 112 projections of a 1.0 B Llama in GPTQ 4-bit
// (groups of 128, 0.45 GiB): 41 / 49 / 66 / 195 / 342 ms at 1 / 8 / 16 / 64 / 128 rows, against
// 45 / 108 / 207 / 361 / 512 ms through torch's int4 kernel (up to 16 rows) and the unpacked
// weights (beyond); reading the packed bytes alone takes about 26 ms.
constexpr int64_t kAmxChunk = 32;         // input channels per tile product (16 pairs)
constexpr int64_t kAmxRows = 16;          // rows of x per A tile
constexpr int64_t kAmxBuilt = 128;        // input channels whose B tiles are built at a time
constexpr float kTileBias = 136.f;        // a tile holds 128 + q where the weight's integer is q - 8
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of its reads the tile building prefetches

// B tiles of channels [k0, k0 + count) of one packed block: tiles[(c * 4 + j) * 512 ...] is chunk
// c's tile of output rows 16j..16j+15, row p holding (128 + q[n, 2p], 128 + q[n, 2p + 1]) for its
// 16 n: a nibble q under the bits 0x4300 is bf16's 128 + q, so no arithmetic or table per value
// (the product's 128 + 8 per value is taken off through the group's sum of x). Two channels' 64
// bytes (32 rows a byte, two nibbles each) are spread by one byte permutation per 16 rows into
// 32-bit lanes (channel 2p's byte, channel 2p + 1's byte), whose low and high nibbles are the
// rows' values in the low and high 32 rows.
struct Spread {  // lane i of half h: byte 4i <- byte 16h + i, byte 4i + 2 <- byte 32 + 16h + i
  __m512i halves[2];
  Spread() {
    alignas(64) uint8_t spread[2][64] = {};
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 16; ++i) {
        spread[h][4 * i] = static_cast<uint8_t>(16 * h + i);
        spread[h][4 * i + 2] = static_cast<uint8_t>(32 + 16 * h + i);
      }
      halves[h] = _mm512_load_si512(spread[h]);
    }
  }
};

void build_int4_tiles(const uint8_t* block_bytes, int64_t last_byte, int64_t k0, int64_t count, const Spread& spread,
                      uint16_t* tiles) {
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F), exponent = _mm512_set1_epi32(0x43004300);
  constexpr __mmask64 kBytes = 0x5555555555555555ull;  // bytes 0 and 2 of each lane
  for (int64_t c = 0; c < count / kAmxChunk; ++c) {
    for (int64_t p = 0; p < kAmxChunk / 2; ++p) {
      // channels 2p and 2p + 1: 32 bytes each, rows i and 32 + i in byte i's low and high nibble
      const int64_t at = (k0 + c * kAmxChunk + 2 * p) * (kBlock / 2);
      _mm_prefetch(reinterpret_cast<const char*>(block_bytes) + std::min(at + kPrefetchBytes, last_byte), _MM_HINT_T0);
      const __m512i pair = _mm512_loadu_si512(block_bytes + at);
      for (int h = 0; h < 2; ++h) {  // rows 16h..16h+15 in the low nibbles, 32 rows on in the high
        const __m512i both = _mm512_maskz_permutexvar_epi8(kBytes, spread.halves[h], pair);
        const __m512i low = _mm512_ternarylogic_epi32(both, nibbles, exponent, 0xEA);  // (a & b) | c
        const __m512i high = _mm512_ternarylogic_epi32(_mm512_srli_epi32(both, 4), nibbles, exponent, 0xEA);
        _mm512_store_si512(tiles + ((c * 4 + h) * 16 + p) * 32, low);
        _mm512_store_si512(tiles + ((c * 4 + 2 + h) * 16 + p) * 32, high);
      }
    }
  }
}

// y [rows, out_features] bf16 = x times the 4-bit weights; xp: x, beyond 16 rows padded to whole
// tiles of 16; sums [rows, groups]: x's sum over each group.
void amx_int4(const c10::BFloat16* xp, const float* sums, int64_t rows, int64_t in, const uint8_t* packed,
              const c10::BFloat16* scale_offset, int64_t padded, int64_t out_features, int64_t group,
              c10::BFloat16* y) {
  const int64_t row_tiles = (rows + kAmxRows - 1) / kAmxRows, groups = in / group;
  const int tile_rows = static_cast<int>(std::min(rows, kAmxRows));  // more rows come padded to whole tiles
  const int64_t built = std::min(group, kAmxBuilt);
  at::parallel_for(0, padded / kBlock, 1, [&](int64_t begin, int64_t end) {
    configure_tiles(tile_rows);
    const Spread spread;
    alignas(64) uint16_t tiles[kAmxBuilt / kAmxChunk * 4 * 512];
    std::vector<float> acc(row_tiles * kAmxRows * kBlock), part(row_tiles * kAmxRows * kBlock);
    for (int64_t block = begin; block < end; ++block) {
      const uint8_t* bytes = packed + block * in * (kBlock / 2);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += built) {
          const int64_t count = std::min(built, (g + 1) * group - k0);
          build_int4_tiles(bytes, in * (kBlock / 2) - 64, k0, count, spread, tiles);
          for (int64_t rt = 0; rt < row_tiles; ++rt) {
            float* c = part.data() + rt * kAmxRows * kBlock;  // [16 rows][64 outputs]: the group's sums so far
            if (k0 == g * group) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
            } else {
              _tile_loadd(0, c, kBlock * 4);
              _tile_loadd(1, c + 16, kBlock * 4);
              _tile_loadd(2, c + 32, kBlock * 4);
              _tile_loadd(3, c + 48, kBlock * 4);
            }
            for (int64_t ch = 0; ch < count / kAmxChunk; ++ch) {
              _tile_loadd(4, xp + rt * kAmxRows * in + k0 + ch * kAmxChunk, in * 2);
              const uint16_t* t = tiles + ch * 4 * 512;
              // tiles 0-3 += tile 4 (x) times the four output row sets' tiles (through tiles 5, 6)
              _tile_loadd(5, t, 64);
              _tile_dpbf16ps(0, 4, 5);
              _tile_loadd(6, t + 512, 64);
              _tile_dpbf16ps(1, 4, 6);
              _tile_loadd(5, t + 1024, 64);
              _tile_dpbf16ps(2, 4, 5);
              _tile_loadd(6, t + 1536, 64);
              _tile_dpbf16ps(3, 4, 6);
            }
            _tile_stored(0, c, kBlock * 4);
            _tile_stored(1, c + 16, kBlock * 4);
            _tile_stored(2, c + 32, kBlock * 4);
            _tile_stored(3, c + 48, kBlock * 4);
          }
        }
        const c10::BFloat16* so = scale_offset + (g * padded + block * kBlock) * 2;
        float scale[kBlock], offset[kBlock];
        for (int64_t n = 0; n < kBlock; ++n) {  // the tiles hold 128 + q: take (128 + 8) x's sum off
          scale[n] = static_cast<float>(so[2 * n]);
          offset[n] = static_cast<float>(so[2 * n + 1]) - kTileBias * scale[n];
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float s = sums[r * groups + g];
          float* out = acc.data() + r * kBlock;
          const float* in_part = part.data() + r * kBlock;
          for (int64_t n = 0; n < kBlock; ++n) out[n] += scale[n] * in_part[n] + offset[n] * s;
        }
      }
      const int64_t width = std::min(kBlock, out_features - block * kBlock);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t n = 0; n < width; ++n) y[r * out_features + block * kBlock + n] = c10::BFloat16(acc[r * kBlock + n]);
      }
    }
    _tile_release();
  });
}

#if defined(__AMX_INT8__)
#define TGIS_AMX_INT8 1
// 8-bit weights on AMX's integer products. The weights are the A operand as they are stored (16
// output rows x 64 input channels of int8 per tile, read straight from the layer's values: no
// conversion); x is the B operand in 16-bit fixed point per row of x, xi = round(x / s) with
// s = max |x| / 32767, split into a signed high byte and an unsigned low byte (xi = 256 hi + lo),
// each transposed once per call into groups of four channels (B row p holds x's channels
// 4p..4p+3 for each row of x), 16 rows of x per tile. tdpbssd / tdpbsud sum v times hi and v times
// lo in int32, exactly, over up to 128 channels at a time; each group's sums T are then scaled by
// the group's scale and s, its offset coming in through the group's sum of x:
//   y[r, n] = sum_g scale[g, n] * s[r] * T[r, n, g] + offset[g, n] * X[r, g]
//   T[r, n, g] = sum_{k in g} xi[r, k] v[n, k] = 256 T_hi + T_lo,  X[r, g] = sum_{k in g} x[r, k]
// the weights' definition, w = v * scale + offset, over x rounded to 16 bits per row (within
// max |x| / 65534 of x: finer than x's own bf16 for all but its smallest values). A task is 16
// output rows; every 64 channels' A tile serves every tile of x rows, two at a time. Needs bf16 x,
// groups and input channels in multiples of 64. On a 2-core Xeon with AMX, eight distinct 2048 x
// 2048 layers in turn, groups of 128: 0.29 / 0.30 / 0.38 / 0.45 / 0.77 ms at 4 / 8 / 16 / 32 / 64
// rows against 0.31 / 0.47 / 0.92 / 1.01 / 1.38 ms through the vector kernel and unpacked slices
// and 0.35 / 0.34 / 0.35 / 0.41 / 0.49 ms for bf16 weights; at 1-2 rows the vector kernel is as
// fast, beyond 64 the slices (1.55 against 1.61 ms at 128). Converting the values to bf16 tiles
// instead (two widenings and three conversions per 32) took 1.26x bf16's time at 8 rows.
constexpr int64_t kInt8Rows = 16;   // output rows per task: one A tile
constexpr int64_t kInt8Chunk = 64;  // input channels per tile product
constexpr int64_t kInt8Span = 128;  // most channels summed in int32 before they are added in float
constexpr int64_t kInt8Ahead = 512; // how far ahead of its reads a row of weights is prefetched
// the calls this product serves (by measurement, int8_group_linear below): fewer rows read the
// weights directly faster, more multiply unpacked slices faster
constexpr std::pair<int64_t, int64_t> kInt8TileRows{3, 64};
using vi = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

// tiles 0-3: T_hi, T_lo of up to two tiles of x rows (int32, 16 output rows x `columns` rows of x);
// tiles 4, 6: x's high and low bytes (64 channels x `columns`); tile 5: 16 output rows' 64 channels
void configure_int8_tiles(int columns) {
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = t == 5 ? 64 : columns * 4;
  }
  load_tiles(config);
}

// y [rows, out_features] bf16 = x times the 8-bit weights. hi, lo [in / 4, columns] int32: x's
// bytes (four channels each), transposed (columns: rows, beyond 16 padded to whole tiles of 16);
// scales [padded]: each row's s; sums_t [groups, padded]: x's sum over each group.
void amx_int8(const int32_t* hi, const int32_t* lo, int64_t columns, const float* scales, const float* sums_t,
              int64_t rows, int64_t in, const int8_t* values, const float* scale_offset, int64_t out_features,
              int64_t group, c10::BFloat16* y) {
  const int64_t row_tiles = (rows + kAmxRows - 1) / kAmxRows, groups = in / group;
  const int tile_columns = static_cast<int>(std::min(rows, kAmxRows));
  const int64_t span = std::min(group, kInt8Span), stride = columns * 4;
  at::parallel_for(0, (out_features + kInt8Rows - 1) / kInt8Rows, 1, [&](int64_t begin, int64_t end) {
    configure_int8_tiles(tile_columns);
    alignas(64) int8_t tail[kInt8Rows * kInt8Chunk];  // the last task's rows past the weights: zeros
    alignas(64) int32_t sums[4][kInt8Rows * kAmxRows] = {};  // lanes past x's rows: never stored
    // [row tile][16 output rows][16 rows of x]: the output so far, the group's T so far
    std::vector<float> acc(row_tiles * kInt8Rows * kAmxRows), part(row_tiles * kInt8Rows * kAmxRows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task * kInt8Rows, width = std::min(kInt8Rows, out_features - n0);
      const int8_t* block = values + n0 * in;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < groups; ++g) {
        std::fill(part.begin(), part.end(), 0.f);
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += span) {
          const int64_t count = std::min(span, (g + 1) * group - k0);
          for (int64_t m = 0; m < width; ++m) {
            for (int64_t ahead = kInt8Ahead; ahead < kInt8Ahead + count && k0 + ahead < in; ahead += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(block + m * in + k0 + ahead), _MM_HINT_T0);
            }
          }
          for (int64_t set = 0; set < row_tiles; set += 2) {
            const bool two = set + 1 < row_tiles;
            _tile_zero(0);
            _tile_zero(1);
            if (two) {
              _tile_zero(2);
              _tile_zero(3);
            }
            for (int64_t k = k0; k < k0 + count; k += kInt8Chunk) {
              if (width == kInt8Rows) {
                _tile_loadd(5, block + k, in);
              } else {
                std::memset(tail, 0, sizeof tail);
                for (int64_t m = 0; m < width; ++m) std::memcpy(tail + m * kInt8Chunk, block + m * in + k, kInt8Chunk);
                _tile_loadd(5, tail, kInt8Chunk);
              }
              const int64_t at = k / 4 * columns + set * kAmxRows;
              _tile_loadd(4, hi + at, stride);
              _tile_dpbssd(0, 5, 4);
              _tile_loadd(6, lo + at, stride);
              _tile_dpbsud(1, 5, 6);
              if (two) {
                _tile_loadd(4, hi + at + kAmxRows, stride);
                _tile_dpbssd(2, 5, 4);
                _tile_loadd(6, lo + at + kAmxRows, stride);
                _tile_dpbsud(3, 5, 6);
              }
            }
            _tile_stored(0, sums[0], kAmxRows * 4);
            _tile_stored(1, sums[1], kAmxRows * 4);
            if (two) {
              _tile_stored(2, sums[2], kAmxRows * 4);
              _tile_stored(3, sums[3], kAmxRows * 4);
            }
            for (int64_t t = 0; t < (two ? 2 : 1); ++t) {  // T += 256 T_hi + T_lo, in float
              float* into = part.data() + (set + t) * kInt8Rows * kAmxRows;
              for (int64_t i = 0; i < kInt8Rows * kAmxRows; i += kLanes) {
                const vf high = __builtin_convertvector(*reinterpret_cast<const vi*>(sums[2 * t] + i), vf);
                const vf low = __builtin_convertvector(*reinterpret_cast<const vi*>(sums[2 * t + 1] + i), vf);
                tgis_cpu::store(into + i, tgis_cpu::load(into + i) + high * 256.f + low);
              }
            }
          }
        }
        for (int64_t rt = 0; rt < row_tiles; ++rt) {  // acc += scale * s * T + offset * x's sum
          const vf x_sum = tgis_cpu::load(sums_t + (g * row_tiles + rt) * kAmxRows);
          const vf s = tgis_cpu::load(scales + rt * kAmxRows);
          for (int64_t n = 0; n < width; ++n) {
            const float scale = scale_offset[(g * out_features + n0 + n) * 2];
            const float offset = scale_offset[(g * out_features + n0 + n) * 2 + 1];
            float* out = acc.data() + (rt * kInt8Rows + n) * kAmxRows;
            const vf t = tgis_cpu::load(part.data() + (rt * kInt8Rows + n) * kAmxRows);
            tgis_cpu::store(out, tgis_cpu::load(out) + t * s * scale + x_sum * offset);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* from = acc.data() + (r / kAmxRows) * kInt8Rows * kAmxRows + r % kAmxRows;
        for (int64_t n = 0; n < width; ++n) y[r * out_features + n0 + n] = c10::BFloat16(from[n * kAmxRows]);
      }
    }
    _tile_release();
  });
}

// x [rows, in] bf16 times the 8-bit weights through amx_int8: x's 16-bit fixed point per row (high
// and low bytes, transposed), each row's scale and x's sums over each group, rows in parallel.
// None where x holds an infinity or NaN, which fixed point cannot carry (the float products do).
std::optional<at::Tensor> amx_int8_linear(const at::Tensor& x, const at::Tensor& values,
                                          const at::Tensor& scale_offset, int64_t group) {
  const int64_t rows = x.size(0), in = x.size(1), out_features = values.size(0);
  const int64_t padded = (rows + kAmxRows - 1) / kAmxRows * kAmxRows, columns = rows <= kAmxRows ? rows : padded;
  const auto options = x.options().dtype(at::kFloat);
  at::Tensor hi = at::zeros({in / 4, columns}, options.dtype(at::kInt)), lo = at::zeros_like(hi);
  at::Tensor scales = at::zeros({padded}, options), sums_t = at::zeros({in / group, padded}, options);
  uint32_t* high = reinterpret_cast<uint32_t*>(hi.data_ptr<int32_t>());
  uint32_t* low = reinterpret_cast<uint32_t*>(lo.data_ptr<int32_t>());
  float* sums = sums_t.data_ptr<float>();
  float* row_scales = scales.data_ptr<float>();
  std::vector<uint8_t> finite(rows, 1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row_x(in);
    std::vector<int32_t> fixed(in);
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* row = x.data_ptr<c10::BFloat16>() + r * in;
      float top = std::numeric_limits<float>::min();
      uint16_t special = 0;  // all exponent bits set: an infinity or NaN (in bits: -ffast-math assumes none)
      for (int64_t k = 0; k < in; ++k) {
        row_x[k] = static_cast<float>(row[k]);
        top = std::max(top, std::abs(row_x[k]));
        special |= static_cast<uint16_t>((row[k].x & 0x7F80) == 0x7F80);
      }
      if (special) {
        finite[r] = 0;
        continue;
      }
      row_scales[r] = top / 32767.f;
      const float to_fixed = 32767.f / top;
      for (int64_t g = 0; g < in / group; ++g) {
        float sum = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += row_x[k];
        sums[g * padded + r] = sum;
      }
      for (int64_t k = 0; k < in; ++k) fixed[k] = static_cast<int32_t>(std::nearbyint(row_x[k] * to_fixed));
      for (int64_t p = 0; p < in / 4; ++p) {  // |fixed| <= 32767: a signed high byte, an unsigned low one
        uint32_t h = 0, l = 0;
        for (int j = 0; j < 4; ++j) {
          h |= static_cast<uint32_t>(static_cast<uint8_t>(fixed[4 * p + j] >> 8)) << (8 * j);
          l |= static_cast<uint32_t>(fixed[4 * p + j] & 255) << (8 * j);
        }
        high[p * columns + r] = h;
        low[p * columns + r] = l;
      }
    }
  });
  if (std::find(finite.begin(), finite.end(), 0) != finite.end()) return std::nullopt;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  amx_int8(hi.data_ptr<int32_t>(), lo.data_ptr<int32_t>(), columns, row_scales, sums, rows, in,
           values.data_ptr<int8_t>(), scale_offset.data_ptr<float>(), out_features, group,
           y.data_ptr<c10::BFloat16>());
  return y;
}
#endif
#endif

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

// quantization/int4.py's Int4Linear product (x's channels already in the layer's order): on AMX,
// where `amx` allows (bf16 x, groups and input channels in multiples of 32), the tile product above
// for any number of rows; else torch's int4 kernel up to `max_rows` rows of bf16 / fp16 x (groups of
// 32, 64, 128 or 256: the ones it takes), and the product over unpacked weights beyond (and for
// float32 x, other groups).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offset,
                       int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias,
                       int64_t max_rows, bool amx) {
  const int64_t rows = x.size(0), in = x.size(1);
#ifdef TGIS_AMX
  if (amx && x.scalar_type() == at::kBFloat16 && group_size % kAmxChunk == 0 && in % kAmxChunk == 0 && rows > 0 &&
      amx_ready()) {
    TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    packed.size(1) * 2 == in && packed.size(0) % kBlock == 0 && out_features <= packed.size(0),
                "packed: contiguous [padded, in / 2] uint8");
    TORCH_CHECK(scale_offset.is_contiguous() && scale_offset.scalar_type() == at::kBFloat16 &&
                    scale_offset.dim() == 3 && scale_offset.size(0) == in / group_size &&
                    scale_offset.size(1) == packed.size(0) && scale_offset.size(2) == 2,
                "scale_offset: contiguous bf16 [groups, padded, 2]");
    at::Tensor xp = x.contiguous();  // up to 16 rows: tiles of that many rows; beyond: whole tiles of 16
    if (rows > kAmxRows && rows % kAmxRows) {
      xp = at::zeros({(rows + kAmxRows - 1) / kAmxRows * kAmxRows, in}, x.options());
      xp.narrow(0, 0, rows).copy_(x);
    }
    const at::Tensor sums = x.to(at::kFloat).view({rows, in / group_size, group_size}).sum(-1).contiguous();
    at::Tensor y = at::empty({rows, out_features}, x.options());
    amx_int4(xp.data_ptr<c10::BFloat16>(), sums.data_ptr<float>(), rows, in, packed.data_ptr<uint8_t>(),
             scale_offset.data_ptr<c10::BFloat16>(), packed.size(0), out_features, group_size,
             y.data_ptr<c10::BFloat16>());
    if (bias.has_value()) y.add_(*bias);
    return y;
  }
#endif
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  const bool kernel_group = group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256;
  if (half && kernel_group && rows <= max_rows) {
    at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.contiguous(), packed, group_size, scale_offset)
                       .narrow(1, 0, out_features);
    return bias.has_value() ? y + *bias : y;
  }
  return int4_linear_unpacked(x.contiguous(), packed, scale_offset, group_size, out_features, bias);
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

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TGIS_AVX2_INT8 1
// The direct product on CPUs with AVX2 and FMA but not AVX-512 (16 vector registers of 8 floats; the
// 16-lane kernel above spills there: 4.6 ms for one row of a 4096 x 4096 layer against 1.0 ms
// here). A task is kOuts output rows; their weights stay in L1 / L2 while the rows of x go
// through them up to 4 at a time: each 8 weights widened to float and scaled once per pass, R x N
// sums in registers (the offsets as above, through each group's sum of x), the next task's
// weights prefetched. On a 2-core AMD EPYC (Zen 3, AVX2 only), float32 x, eight distinct 8192 x
// 2048 layers in turn, one group per output row: 0.85 / 1.44 / 5.57 /
// 11.3 / 21.3 ms at 1 / 4 / 16 / 32 / 64 rows, against 3.69 / 4.79 / 7.90 / 13.7 / 27.0 ms over
// unpacked slices and 2.85 / 3.72 / 6.69 / 10.5 / 19.3 ms for float32 weights in oneDNN's
// layout (2048 x 2048 alike): up to 64 rows read the weights directly.
constexpr int kOuts = 4;
constexpr int64_t kAvx2DirectRows = 64;

inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// y[r, n + j] for rows r of x at xf (R of them) and output rows n + j (j < N).
template <int R, int N>
void avx2_int8_rows(const float* xf, const float* sums, const int8_t* values, const float* scale_offset, float* y,
                    int64_t n, int64_t out_features, int64_t in, int64_t group) {
  const int64_t groups = in / group;
  __m256 total[R][N];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < N; ++j) total[r][j] = _mm256_setzero_ps();
  }
  float offsets[R][N] = {};
  const int8_t* ahead = values + std::min(n + kOuts, std::max<int64_t>(out_features - N, 0)) * in;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 scale[N];
    for (int j = 0; j < N; ++j) {
      const float* so = scale_offset + (g * out_features + n + j) * 2;
      scale[j] = _mm256_set1_ps(so[0]);
      for (int r = 0; r < R; ++r) offsets[r][j] += so[1] * sums[r * groups + g];
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
      __m256 w[N];
      if ((k & 63) == 0) {
        for (int j = 0; j < N; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * in + k), _MM_HINT_T0);
      }
      for (int j = 0; j < N; ++j) w[j] = _mm256_mul_ps(widen8(values + (n + j) * in + k), scale[j]);
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_loadu_ps(xf + r * in + k);
        for (int j = 0; j < N; ++j) total[r][j] = _mm256_fmadd_ps(x, w[j], total[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < N; ++j) y[r * out_features + n + j] = sum8(total[r][j]) + offsets[r][j];
  }
}

// R rows of x (at xf) times output rows [n, n + count), count <= kOuts: N = 4 outputs a pass for
// up to 2 rows of x, 2 for 3-4 (sums, weights, x and the scales' broadcasts in 11-17 registers; at
// 2 rows, 4 outputs a pass measured 1.08 against 1.35 ms for 2, 4096 x 4096 as above).
template <int R>
void avx2_int8_chunk(const float* xf, const float* sums, const int8_t* values, const float* scale_offset, float* y,
                     int64_t n, int64_t count, int64_t out_features, int64_t in, int64_t group) {
  constexpr int N = R <= 2 ? 4 : 2;
  int64_t j = 0;
  for (; j + N <= count; j += N) {
    avx2_int8_rows<R, N>(xf, sums, values, scale_offset, y, n + j, out_features, in, group);
  }
  for (; j < count; ++j) avx2_int8_rows<R, 1>(xf, sums, values, scale_offset, y, n + j, out_features, in, group);
}

void avx2_int8(int64_t rows, const float* xf, const float* sums, const int8_t* values, const float* scale_offset,
               float* y, int64_t out_features, int64_t in, int64_t group) {
  const int64_t groups = in / group;
  at::parallel_for(0, (out_features + kOuts - 1) / kOuts, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task * kOuts, count = std::min<int64_t>(kOuts, out_features - n);
      for (int64_t r = 0; r < rows; r += 4) {
        const float* x = xf + r * in;
        const float* s = sums + r * groups;
        float* out = y + r * out_features;
        switch (std::min<int64_t>(4, rows - r)) {
          case 1: avx2_int8_chunk<1>(x, s, values, scale_offset, out, n, count, out_features, in, group); break;
          case 2: avx2_int8_chunk<2>(x, s, values, scale_offset, out, n, count, out_features, in, group); break;
          case 3: avx2_int8_chunk<3>(x, s, values, scale_offset, out, n, count, out_features, in, group); break;
          default: avx2_int8_chunk<4>(x, s, values, scale_offset, out, n, count, out_features, in, group);
        }
      }
    }
  });
}
#endif

at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scale_offset,
                             int64_t group_size, const std::optional<at::Tensor>& bias, bool amx) {
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
#ifdef TGIS_AMX_INT8
  if (amx && x.scalar_type() == at::kBFloat16 && group_size % kInt8Chunk == 0 && rows >= kInt8TileRows.first &&
      rows <= kInt8TileRows.second && amx_ready()) {
    std::optional<at::Tensor> y = amx_int8_linear(x.contiguous(), values, scale_offset, group_size);
    if (y.has_value()) {
      if (bias.has_value()) y->add_(*bias);
      return *y;
    }
  }
#endif
#ifdef TGIS_AVX2_INT8
  const bool direct = rows <= kAvx2DirectRows && group_size % 8 == 0;
#else
  const bool direct = rows <= kDirectRows && group_size % kLanes == 0;
#endif
  if (direct) {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    const at::Tensor sums = xf.view({rows, in / group_size, group_size}).sum(-1).contiguous();
    at::Tensor y = at::empty({rows, out_features}, xf.options());
    const float* so = scale_offset.data_ptr<float>();
    if (rows > 0) {
#ifdef TGIS_AVX2_INT8
      avx2_int8(rows, xf.data_ptr<float>(), sums.data_ptr<float>(), values.data_ptr<int8_t>(), so, y.data_ptr<float>(),
                out_features, in, group_size);
#else
      direct_int8_up_to<kDirectRows>(rows, xf.data_ptr<float>(), sums.data_ptr<float>(), values.data_ptr<int8_t>(), so,
                                     y.data_ptr<float>(), out_features, in, group_size);
#endif
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
  m.def(
      "int8_group_linear(Tensor x, Tensor values, Tensor scale_offset, int group_size, Tensor? bias, bool amx) -> "
      "Tensor");
  m.def(
      "int4_linear(Tensor x, Tensor packed, Tensor scale_offset, int group_size, int out_features, Tensor? bias, "
      "int max_rows, bool amx) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) {
  m.impl("int4_linear_unpacked", &int4_linear_unpacked);
  m.impl("int8_group_linear", &int8_group_linear);
  m.impl("int4_linear", &int4_linear);
}
