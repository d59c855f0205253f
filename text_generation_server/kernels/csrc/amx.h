// AMX (Intel's tile matrix unit) for the CPU kernels: the permission to use it, the tile
// configuration the kernels share, and their one loop over weights in panels laid out as B tiles
// (tile_products: panel_cpu.cpp's bf16 pairs, w8a8_cpu.cpp's int8 quads). Included where the
// compiler targets AMX-TILE and AMX-BF16 (-march=native on a CPU that has them); TGIS_CPU_AMX says so.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TGIS_CPU_AMX 1

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace tgis_cpu {

// Linux hands out AMX's tile state to processes that ask for it (once per process)
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg with the configuration as a memory operand: GCC 12 does not count _tile_loadconfig as
// reading its argument, and dropped the stores that fill it (the tiles then faulted).
inline void load_tiles(const TileConfig& config) { asm volatile("ldtilecfg %0" : : "m"(config)); }

// tiles 0-3: sums of `rows` (<= 16) rows against four sets of 16 outputs (float32); tile 4:
// those rows over 32 bf16 inputs (or 64 int8); tiles 5-7: 16 rows of 64 bytes, the inputs' pairs
// (or quads) of 16 outputs side by side, as the tile products read them (with 16 rows, every tile
// is 16 x 64 bytes: tile 5 can then hold a second A tile)
inline void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 5 ? rows : 16;
    config.colsb[t] = 64;
  }
  load_tiles(config);
}

// ---- products over weights in panels of 16 outputs, laid out as B tiles ----------------------
// A panel's weights lie as the tile products read a B tile: 64 bytes per row, a row holding the
// 16 outputs' pairs of bf16 inputs (or quads of int8 inputs) side by side, so 16 rows (1 KiB) of a
// panel are one B tile of 32 bf16 (or 64 int8) inputs. Up to 16 rows of x (64 bytes of each a
// chunk, row stride lda bytes) are an A tile. tile_products runs x through every panel, summing
// each output over all chunks in order, and hands each row's 16 sums of a panel to `finish`.

constexpr int kTileRows = 16;        // rows of an A tile, and of a B tile
constexpr int64_t kTileBytes = 64;   // bytes of a tile row
constexpr int64_t kChunkBytes = kTileRows * kTileBytes;  // one B tile of a panel
constexpr int kTileGroup = 4;        // panels one A tile goes through at a time (C tiles 0-3)
// rows of x every panel passes through before the next block: as many as keep the block's x
// within this many bytes (in L2 while the panels stream by once), in pairs of A tiles
constexpr int64_t kTileBlockBytes = int64_t{512} << 10;

// Products::dot<C, A, B>(): tile C += tile A times tile B. GCC's tile intrinsics are macros that
// paste their arguments' spelling into the instruction, so each (C, A, B) the loops below use is
// spelled out.
#define TGIS_TILE_DOT(Products, op, c, a, b) \
  template <>                                \
  inline void Products::dot<c, a, b>() {     \
    op(c, a, b);                             \
  }
#define TGIS_TILE_DOTS(Products, op) /* one_tile_through's four, then two_tiles_through's */ \
  TGIS_TILE_DOT(Products, op, 0, 4, 5)                                                      \
  TGIS_TILE_DOT(Products, op, 1, 4, 6)                                                      \
  TGIS_TILE_DOT(Products, op, 2, 4, 5)                                                      \
  TGIS_TILE_DOT(Products, op, 3, 4, 6)                                                      \
  TGIS_TILE_DOT(Products, op, 0, 4, 6)                                                      \
  TGIS_TILE_DOT(Products, op, 2, 5, 6)                                                      \
  TGIS_TILE_DOT(Products, op, 1, 4, 7)                                                      \
  TGIS_TILE_DOT(Products, op, 3, 5, 7)

struct Bf16Products {  // float32 sums of bf16 pairs
  template <int C, int A, int B>
  static void dot();
};
TGIS_TILE_DOTS(Bf16Products, _tile_dpbf16ps)

#if defined(__AMX_INT8__)
struct Int8Products {  // int32 sums of signed bytes of x times unsigned bytes of the panels
  template <int C, int A, int B>
  static void dot();
};
TGIS_TILE_DOTS(Int8Products, _tile_dpbsud)
#endif

#undef TGIS_TILE_DOTS
#undef TGIS_TILE_DOT

// tiles 0..G-1 = one A tile's rows (tile 4, as configured) times G panels (B tiles 5, 6 in turn)
template <typename P, int G>
inline void one_tile_through(const char* a, int64_t lda, const char* panel, int64_t panel_bytes, int64_t chunks) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    const char* b = panel + c * kChunkBytes;
    _tile_loadd(4, a + c * kTileBytes, lda);
    _tile_loadd(5, b, kTileBytes);
    P::template dot<0, 4, 5>();
    if constexpr (G > 1) {
      _tile_loadd(6, b + panel_bytes, kTileBytes);
      P::template dot<1, 4, 6>();
    }
    if constexpr (G > 2) {
      _tile_loadd(5, b + 2 * panel_bytes, kTileBytes);
      P::template dot<2, 4, 5>();
    }
    if constexpr (G > 3) {
      _tile_loadd(6, b + 3 * panel_bytes, kTileBytes);
      P::template dot<3, 4, 6>();
    }
  }
}

// tiles 0, 1 / 2, 3 = two A tiles of 16 rows (tiles 4, 5) times G <= 2 panels (tiles 6, 7): four
// products from two A and two B loads, where one_tile_through loads four B tiles for as many
template <typename P, int G>
inline void two_tiles_through(const char* a, int64_t lda, const char* panel, int64_t panel_bytes, int64_t chunks) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (G > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const char* b = panel + c * kChunkBytes;
    _tile_loadd(4, a + c * kTileBytes, lda);
    _tile_loadd(6, b, kTileBytes);
    P::template dot<0, 4, 6>();
    _tile_loadd(5, a + kTileRows * lda + c * kTileBytes, lda);
    P::template dot<2, 5, 6>();
    if constexpr (G > 1) {
      _tile_loadd(7, b + panel_bytes, kTileBytes);
      P::template dot<1, 4, 7>();
      P::template dot<3, 5, 7>();
    }
  }
}

// x's `rows` rows (at `a`, stride lda bytes, `chunks` chunks of 64 bytes each) through `count`
// panels of panel_bytes each (at `panels`): finish(p, r, sums) with the 16 sums (S: float or
// int32_t) of row r against panel p. Tasks of up to 4 panels run on torch's threads; up to 16
// rows take one A tile through a task's panels, more go as pairs of A tiles through pairs of
// panels, the rows left over in a tile of their own. Every sum runs over the chunks in order, however the rows and
// panels are grouped: a row's sums do not depend on the rows beside it.
template <typename P, typename S, typename Finish>
void tile_products(const char* a, int64_t lda, int64_t rows, int64_t chunks, const char* panels, int64_t count,
                   const Finish& finish) {
  static_assert(sizeof(S) == 4, "tile sums are 32-bit");
  // tasks of 4 panels, or of 2 or 1 where that many would leave some of torch's threads without
  // one (a narrow weight on a many-core CPU; on 2 cores, one row of a 64 x 8,192 weight: 12.4 ->
  // 8.3 us)
  int64_t group = kTileGroup;
  while (group > 1 && (count + group - 1) / group < at::get_num_threads()) group /= 2;
  const int64_t panel_bytes = chunks * kChunkBytes, tasks = (count + group - 1) / group;
  const int64_t block = std::max<int64_t>(1, kTileBlockBytes / (lda * 2 * kTileRows)) * 2 * kTileRows;
  for (int64_t first = 0; first < rows; first += block) {
    const int64_t last = std::min(rows, first + block);
    const int64_t whole = first + (last - first) / kTileRows * kTileRows;  // rows in whole A tiles
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      alignas(64) S sums[2 * kTileRows][kTileGroup * kTileRows];
      constexpr int64_t kStride = sizeof sums[0];
      const auto hand_over = [&](int64_t p, int64_t r, int height, int64_t width) {
        for (int i = 0; i < height; ++i) {
          for (int64_t g = 0; g < width; ++g) finish(p + g, r + i, sums[i] + g * kTileRows);
        }
      };
      // the block's whole tiles of 16 rows, then the rows left, each with its own configuration
      for (const auto& [from, to] : {std::pair{first, whole}, std::pair{whole, last}}) {
        if (from == to) continue;
        const int height = static_cast<int>(std::min<int64_t>(kTileRows, to - from));
        configure_tiles(height);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t p = task * group, width = std::min<int64_t>(group, count - p);
          const char* panel = panels + p * panel_bytes;
          int64_t r = from;
          for (; height == kTileRows && r + 2 * kTileRows <= to; r += 2 * kTileRows) {  // pairs of A tiles
            for (int64_t q = 0; q < width; q += 2) {
              const char* at = a + r * lda;
              if (width - q > 1) {
                two_tiles_through<P, 2>(at, lda, panel + q * panel_bytes, panel_bytes, chunks);
                _tile_stored(1, sums[0] + kTileRows, kStride);
                _tile_stored(3, sums[kTileRows] + kTileRows, kStride);
              } else {
                two_tiles_through<P, 1>(at, lda, panel + q * panel_bytes, panel_bytes, chunks);
              }
              _tile_stored(0, sums[0], kStride);
              _tile_stored(2, sums[kTileRows], kStride);
              hand_over(p + q, r, 2 * kTileRows, std::min<int64_t>(2, width - q));
            }
          }
          for (; r < to; r += height) {
            const char* at = a + r * lda;
            switch (width) {
              case 4: one_tile_through<P, 4>(at, lda, panel, panel_bytes, chunks); break;
              case 3: one_tile_through<P, 3>(at, lda, panel, panel_bytes, chunks); break;
              case 2: one_tile_through<P, 2>(at, lda, panel, panel_bytes, chunks); break;
              default: one_tile_through<P, 1>(at, lda, panel, panel_bytes, chunks); break;
            }
            _tile_stored(0, sums[0], kStride);
            if (width > 1) _tile_stored(1, sums[0] + kTileRows, kStride);
            if (width > 2) _tile_stored(2, sums[0] + 2 * kTileRows, kStride);
            if (width > 3) _tile_stored(3, sums[0] + 3 * kTileRows, kStride);
            hand_over(p, r, height, width);
          }
        }
      }
      _tile_release();
    });
  }
}

}  // namespace tgis_cpu

#endif
