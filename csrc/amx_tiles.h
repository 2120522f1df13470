// The AMX tile configuration (palette 1) that the GEMM and the attention load: no torch here, so a
// test can compile it alone for an AMX target on any machine (tests/unit/test_amx_tiles.py).
#pragma once

#include <cstdint>

namespace phalanx {

// LDTILECFG's 64-byte operand.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if defined(__AMX_TILE__)
// This thread's tiles: tile t has rows[t] rows of 64 bytes (0: unused). The whole 64-byte block is
// LDTILECFG's memory operand. GCC 12's _tile_loadconfig names only its first 8 bytes, so the stores
// of the rows and column widths were removed as dead and the instruction loaded zero-sized tiles:
// every tile instruction after it faulted (SIGILL).
inline void load_amx_tile_config(const int (&rows)[8]) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}
#endif

}  // namespace phalanx
