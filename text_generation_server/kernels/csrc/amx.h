// AMX (Intel's tile matrix unit) for the CPU kernels: the permission to use it, the tile
// configuration, and the one configuration the kernels share. Included where the compiler
// targets AMX-TILE (-march=native on a CPU that has it); TGIS_CPU_AMX says so.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TGIS_CPU_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

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

}  // namespace tgis_cpu

#endif
