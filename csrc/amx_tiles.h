// The AMX tile configuration (palette 1) that the GEMM and the attention load, and the tile
// operations they call (`px_tile_*`: the instructions, or in a build with PHALANX_EMULATE_AMX their
// software twins of amx_emulation.h). No torch here, so a test can compile it alone for an AMX
// target on any machine (tests/unit/test_amx_tiles.py).
#pragma once

#include <cstdint>

// PHALANX_AMX: the AMX code is in this build, on tiles (an AMX target) or emulated (an AVX512-BF16
// one with PHALANX_EMULATE_AMX).
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__linux__) && \
    (defined(PHALANX_EMULATE_AMX) || (defined(__AMX_TILE__) && defined(__AMX_BF16__)))
#define PHALANX_AMX 1
#else
#define PHALANX_AMX 0
#endif

#if PHALANX_AMX && defined(PHALANX_EMULATE_AMX)
#include "amx_emulation.h"
#define px_tile_zero(t) ::phalanx::amx_emulation::zero(t)
#define px_tile_loadd(t, base, stride) ::phalanx::amx_emulation::loadd(t, base, stride)
#define px_tile_stored(t, base, stride) ::phalanx::amx_emulation::stored(t, base, stride)
#define px_tile_dpbf16ps(c, a, b) ::phalanx::amx_emulation::dpbf16ps(c, a, b)
#define px_tile_release() ::phalanx::amx_emulation::release()
#else
#define px_tile_zero(t) _tile_zero(t)
#define px_tile_loadd(t, base, stride) _tile_loadd(t, base, stride)
#define px_tile_stored(t, base, stride) _tile_stored(t, base, stride)
#define px_tile_dpbf16ps(c, a, b) _tile_dpbf16ps(c, a, b)
#define px_tile_release() _tile_release()
#endif

namespace phalanx {

// LDTILECFG's 64-byte operand.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if PHALANX_AMX && defined(PHALANX_EMULATE_AMX)
inline void load_amx_tile_config(const int (&rows)[8]) { amx_emulation::config(rows); }
#elif defined(__AMX_TILE__)
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
