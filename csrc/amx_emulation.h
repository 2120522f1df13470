// AMX's tile registers and TDPBF16PS in software, on AVX512 (a build with PHALANX_EMULATE_AMX;
// ops.cpu's PHALANX_CPU_ISA=amx_emulated): the GEMM's and the attention's AMX code runs unchanged on
// a CPU without AMX and gives the bits an AMX CPU gives, at a few times the time. What it is for: a
// CPU without AMX can check what serving on one computes (acceptance of a drafter trained on
// another path's features, exactness of the AMX code itself), and the kernels' AMX code is tested on
// every AVX512-BF16 CPU, not only on those with AMX.
//
// The instruction, as gemm.cpp states it (measured bit for bit on an Intel Xeon with AMX-BF16):
// for output (m, n), with K = the A tile's bytes a row / 4 pairs,
//     even = sum over p = 0 .. K - 1 of A[m, 2p] B[p, 2n], one product at a time from zero
//     odd  = sum over p = 0 .. K - 1 of A[m, 2p + 1] B[p, 2n + 1], likewise
//     C[m, n] = C[m, n] + (even + odd)
// every addition rounded to float32 (nearest even), denormal inputs and results zero. A bf16 x bf16
// product is exact in float32, so each step is one FMA; MXCSR's DAZ and FTZ give the denormal rule.
//
// The tile state is the thread's (as the hardware's is): `config` sets each tile's rows and bytes
// a row and zeroes every tile (as LDTILECFG does), `release` unconfigures them.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace phalanx::amx_emulation {

struct Tiles {
  alignas(64) uint8_t data[8][16][64];
  int rows[8];
  int colsb[8];
};

inline Tiles& tiles() {
  static thread_local Tiles t{};
  return t;
}

[[noreturn]] inline void fault(const char* what, int tile) {
  std::fprintf(stderr, "phalanx: emulated AMX: %s (tile %d)\n", what, tile);
  std::abort();
}

inline void config(const int (&rows)[8]) {
  Tiles& t = tiles();
  std::memset(t.data, 0, sizeof t.data);
  for (int i = 0; i < 8; ++i) {
    if (rows[i] < 0 || rows[i] > 16) fault("a tile has more than 16 rows", i);
    t.rows[i] = rows[i];
    t.colsb[i] = rows[i] ? 64 : 0;
  }
}

inline void release() {
  const int none[8] = {};
  config(none);
}

inline void zero(int tile) {
  std::memset(tiles().data[tile], 0, sizeof tiles().data[tile]);
}

inline void loadd(int tile, const void* base, int64_t stride) {
  Tiles& t = tiles();
  if (!t.rows[tile]) fault("load into an unconfigured tile", tile);
  const auto* src = static_cast<const uint8_t*>(base);
  for (int r = 0; r < t.rows[tile]; ++r) std::memcpy(t.data[tile][r], src + r * stride, t.colsb[tile]);
}

inline void stored(int tile, void* base, int64_t stride) {
  Tiles& t = tiles();
  if (!t.rows[tile]) fault("store from an unconfigured tile", tile);
  auto* dst = static_cast<uint8_t*>(base);
  for (int r = 0; r < t.rows[tile]; ++r) std::memcpy(dst + r * stride, t.data[tile][r], t.colsb[tile]);
}

// C[m, n] += (even + odd) over the pairs of A's row m and B's column n (above). B's row p holds the
// pairs (B[p, 2n], B[p, 2n + 1]) of the 16 columns n: the low halves shifted up are the even
// elements as float32, the high halves masked the odd ones.
inline void dpbf16ps(int c, int a, int b) {
  Tiles& t = tiles();
  const int M = t.rows[c], K = t.colsb[a] / 4;
  if (!M || !K || t.colsb[c] != 64 || t.colsb[b] != 64 || t.rows[a] != M || t.rows[b] < K)
    fault("TDPBF16PS on tiles of mismatched shapes", c);
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // FTZ (bit 15) and DAZ (bit 6)
  __m512 be[16], bo[16];
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int p = 0; p < K; ++p) {
    const __m512i v = _mm512_load_si512(t.data[b][p]);
    be[p] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    bo[p] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
  }
  for (int m = 0; m < M; ++m) {
    const auto* pairs = reinterpret_cast<const uint32_t*>(t.data[a][m]);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (int p = 0; p < K; ++p) {
      const uint32_t lo = pairs[p] << 16, hi = pairs[p] & 0xFFFF0000u;
      float x_even, x_odd;
      std::memcpy(&x_even, &lo, 4);
      std::memcpy(&x_odd, &hi, 4);
      even = _mm512_fmadd_ps(_mm512_set1_ps(x_even), be[p], even);
      odd = _mm512_fmadd_ps(_mm512_set1_ps(x_odd), bo[p], odd);
    }
    auto* acc = reinterpret_cast<float*>(t.data[c][m]);
    _mm512_store_ps(acc, _mm512_add_ps(_mm512_load_ps(acc), _mm512_add_ps(even, odd)));
  }
  _mm_setcsr(csr);
}

}  // namespace phalanx::amx_emulation
