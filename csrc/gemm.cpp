// The batch-invariant bf16 GEMM: y = x W^T (+ b) for x [M, K] with any M (one decode row to a
// whole prompt), W [N, K] packed once by `pack_pairs`. It serves every bf16 linear of a model,
// its logits head and its MoE experts (``layers.linear.PackedLinear``, the fused layer, the
// drafting chains).
//
// The summation order. Every output y[m, n] is one float32 accumulator that starts at zero, takes
// the products of row m and column n in one fixed sequence that depends only on K and the path,
// then acc + b[n] when there is a bias, then one rounding to bf16 (nearest even, denormals to zero).
// A bf16 x bf16 product is exact in float32, so each addition rounds once, to nearest even;
// denormal inputs count as zero, denormal results flush to zero. The sequence:
//
// * AVX512-BF16 and AVX2 paths: k pair p = 0, 1, ..., ceil(K / 2) - 1,
//       acc = fma(x[m, 2p + 1], w[n, 2p + 1], acc);  acc = fma(x[m, 2p], w[n, 2p], acc)
//   (an odd K's last pair has a zero second half). That is the definition of the AVX512-BF16
//   instruction VDPBF16PS (Intel SDM) walked along the packed pairs; the AVX2 path computes the
//   same steps with float32 FMAs under MXCSR's DAZ / FTZ, so both paths give the same bits.
// * AMX path: K in steps of 16 pairs (32 elements, zero-padded to whole steps), s = 0, 1, ...;
//   per step  even = sum of x[m, 2p] w[n, 2p] and odd = sum of x[m, 2p + 1] w[n, 2p + 1], each
//   added one product at a time in pair order p = 16 s ... 16 s + 15 from zero; then
//       acc = acc + (even + odd).
//   That is what one AMX tile instruction (TDPBF16PS) was measured to compute, bit for bit, on an
//   Intel Xeon with AMX-BF16 (the SDM leaves the instruction's internal order to the
//   implementation, so tests/unit/test_gemm.py checks this order on whatever CPU runs the suite).
//   It is not the other paths' order: an AMX CPU gives other bits than an AVX512-BF16 or AVX2 one
//   (it can run its AVX512-BF16 path to match them, PHALANX_CPU_ISA=avx512_bf16).
//
// Nothing in either sequence depends on M, on which rows share a register or tile, or on how the
// rows and columns are split between threads: a row's result is the same whether the call has one
// row or thousands (batch invariance).
//
// The register tiles (AVX512-BF16 / AVX2): MR rows x NR blocks of 16 columns, each (row, block) one
// accumulator register walking the whole K (no K split); the weight panel of a tile is streamed
// once per MR rows (on the AVX2 path a chunk of more than two tiles first splits each block's panel
// into float32 halves, once, so its tiles load them instead of unpacking the pairs each time). The
// AMX tiles: 2 x 2 accumulator tiles of 16 rows x 16 columns walking the K steps; the packed pairs
// are AMX's weight-tile layout, so a step's weights load as one 16 x 64-byte tile. Work items are (a
// chunk of rows, column blocks), split over threads in order; a thread runs only for enough work to
// pay for its wake-up.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xmmintrin.h>

#include "amx_tiles.h"
#include "common.h"
#include "gemm.h"

namespace phalanx {

int64_t block_pairs(int64_t K, int64_t isa) {
  const int64_t pairs = (K + 1) / 2;
  return isa == kGemmAmx ? (pairs + kAmxPairs - 1) / kAmxPairs * kAmxPairs : pairs;
}

bool is_packed_for(const at::Tensor& packed, int64_t K, int64_t isa) {
  return packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(1) == (K + 1) / 2 &&
         packed.size(2) == 16 && packed.size(3) == 2 && packed.stride(3) == 1 && packed.stride(2) == 2 &&
         packed.stride(1) == 32 && packed.stride(0) == block_pairs(K, isa) * 32;
}

at::Tensor pack_pairs(at::Tensor w, int64_t isa) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_pairs: w must be a bfloat16 [N, K] matrix");
  TORCH_CHECK(isa == kGemmAmx || isa == kGemmAvx512Bf16 || isa == kGemmAvx2, "pack_pairs: isa ", isa,
              " is not a GEMM path (3: AMX, 2: AVX512-BF16, 1: AVX2)");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NB = (N + 15) / 16, KP = block_pairs(K, isa);
  auto out = at::zeros({NB, KP, 16, 2}, w.options());
  const uint16_t* wp = u16(w);
  uint16_t* op = u16_mut(out);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k) op[(((n / 16) * KP + k / 2) * 16 + n % 16) * 2 + k % 2] = wp[n * K + k];
  });
  return KP == (K + 1) / 2 ? out : out.narrow(1, 0, (K + 1) / 2);  // the AMX padding: past the view's end
}

namespace {

constexpr int64_t kChunkRows = 96;  // at most this many rows per work item: their x stays in cache while the weights pass
constexpr int64_t kAmxChunkRows = 256;  // the AMX path: x rows per work item (in L2 while the weights pass)
constexpr int64_t kAmxStreamBytes = int64_t{4} << 20;  // the AMX path: outputs this large bypass the caches
constexpr unsigned kDazFtz = 0x8040;  // MXCSR: denormals are zero (bit 6), flush to zero (bit 15)

// The pair (x[m, 2p], x[m, 2p + 1]) of a row as one 32-bit word (low half: the even element), and an
// odd K's last pair (x[m, K - 1], 0).
inline uint32_t full_pair(const uint16_t* row, int64_t p) {
  uint32_t pair;
  std::memcpy(&pair, row + 2 * p, 4);
  return pair;
}
inline uint32_t half_pair(const uint16_t* row, int64_t p) { return row[2 * p]; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kHasAvx512Bf16 = true;

// MR rows x NR blocks: y[m, (nb + t) * 16 + j] for m < MR, t < NR, j < 16 (columns past N not stored).
template <int MR, int NR>
inline void tile_bf16(const uint16_t* x, int64_t K, const uint16_t* w, int64_t KP, int64_t nb, const float* bias,
                      uint16_t* y, int64_t N) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NR; ++t) acc[m][t] = _mm512_setzero_ps();
  const uint16_t* wb = w + nb * KP * 32;
  const int64_t full = K / 2;
  auto step = [&](int64_t p, auto pair_of) {  // pair p of every row against the NR blocks
    __m512bh wv[NR];
    for (int t = 0; t < NR; ++t) wv[t] = (__m512bh)_mm512_loadu_si512(wb + (t * KP + p) * 32);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_of(x + m * K, p)));
      for (int t = 0; t < NR; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xb, wv[t]);
    }
  };
  for (int64_t p = 0; p < full; ++p) step(p, full_pair);
  if (full < KP) step(full, half_pair);
  for (int t = 0; t < NR; ++t) {
    const int64_t n0 = (nb + t) * 16, cnt = std::min<int64_t>(16, N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1);
    const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m512 v = bias ? _mm512_add_ps(acc[m][t], b) : acc[m][t];
      _mm256_mask_storeu_epi16(y + m * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// MR rows against column blocks [nb0, nb1): panels of NR blocks, then single blocks.
template <int MR>
inline void rows_bf16(const uint16_t* x, int64_t K, const uint16_t* w, int64_t KP, int64_t nb0, int64_t nb1,
                      const float* bias, uint16_t* y, int64_t N) {
  constexpr int NR = MR <= 2 ? 8 : 4;  // MR * NR accumulators + NR weight registers fit the 32 zmm
  int64_t nb = nb0;
  for (; nb + NR <= nb1; nb += NR) tile_bf16<MR, NR>(x, K, w, KP, nb, bias, y, N);
  for (; nb < nb1; ++nb) tile_bf16<MR, 1>(x, K, w, KP, nb, bias, y, N);
}

// Rows [0, M) of x / y against column blocks [nb0, nb1): panel by panel, every row tile per panel.
// The rows go in tiles of at most MR, as even as possible (7 rows as 3 + 4, not 6 + 1): past two
// rows a panel is 4 blocks, so a tile of one or two rows ran one block at a time, one or two
// accumulators whose dependent chains, not the FMA units, set its pace. SmolLM2's forward took
// ~10.5 ms at 7 rows against ~9.5 at 9 (6 + 3) that way (2 cores, AVX512-BF16 without AMX).
void run_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t KP, int64_t nb0, int64_t nb1,
              const float* bias, uint16_t* y, int64_t N) {
  constexpr int MR = 6;
  const int64_t panel = M <= 2 ? 8 : 4;
  const int64_t tiles = (M + MR - 1) / MR;
  for (int64_t p0 = nb0; p0 < nb1; p0 += panel) {
    const int64_t p1 = std::min(nb1, p0 + panel);
    for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
      const int64_t rows = (M - m0) / (tiles - t);
      const uint16_t* xm = x + m0 * K;
      uint16_t* ym = y + m0 * N;
      m0 += rows;
      switch (rows) {
        case 6: rows_bf16<6>(xm, K, w, KP, p0, p1, bias, ym, N); break;
        case 5: rows_bf16<5>(xm, K, w, KP, p0, p1, bias, ym, N); break;
        case 4: rows_bf16<4>(xm, K, w, KP, p0, p1, bias, ym, N); break;
        case 3: rows_bf16<3>(xm, K, w, KP, p0, p1, bias, ym, N); break;
        case 2: rows_bf16<2>(xm, K, w, KP, p0, p1, bias, ym, N); break;
        default: rows_bf16<1>(xm, K, w, KP, p0, p1, bias, ym, N); break;
      }
    }
  }
}
#else
constexpr bool kHasAvx512Bf16 = false;
void run_bf16(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, int64_t, const float*, uint16_t*,
              int64_t) {}
#endif

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kHasAvx2 = true;

// x's rows split once per call for the AVX2 path: row m, pair p -> (odd, even) elements as float32
// (exact: a bf16 value is the top half of its float32), so the tile broadcasts each straight from
// memory instead of unpacking the pair once per row and column block.
void split_pairs(const uint16_t* x, int64_t M, int64_t K, float* xs) {
  const int64_t KP = (K + 1) / 2;
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const uint16_t* row = x + m * K;
      float* out = xs + m * KP * 2;
      for (int64_t k = 0; k < K; ++k) out[2 * (k / 2) + 1 - k % 2] = bits_to_float(row[k]);
      if (K % 2) out[2 * (KP - 1)] = 0.f;  // an odd K's last pair: (x[K - 1], 0), its odd half zero
    }
  });
}

// 8 columns' pairs (32-bit words: odd << 16 | even) -> their even and odd elements as float32 (exact).
inline void unpack_pairs(const uint16_t* words, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// One pair of a block's panel split by split_panel: the odd elements of columns 0-7 and 8-15, then
// the even ones (32-byte aligned, so a std::vector of them is too).
struct alignas(32) SplitPair {
  float v[32];
};

// A block's weight panel split once into float32 for a chunk of many rows (each of its tiles then
// loads the halves instead of unpacking the pairs again).
void split_panel(const uint16_t* wb, int64_t KP, SplitPair* out) {
  for (int64_t p = 0; p < KP; ++p)
    for (int h = 0; h < 2; ++h) {
      __m256 even, odd;
      unpack_pairs(wb + p * 32 + 16 * h, even, odd);
      _mm256_store_ps(out[p].v + 8 * h, odd);
      _mm256_store_ps(out[p].v + 16 + 8 * h, even);
    }
}

// MR rows x one block of 16 columns (two 8-lane halves), the VDPBF16PS steps with FMAs (the
// caller set DAZ / FTZ): the odd element of each pair, then the even one. xs: the rows' pairs from
// split_pairs (odd, even per pair). The block's weights: packed pairs (w, kSplit false) or the
// panel from split_panel (wf, kSplit true); the same values, so the same bits.
template <int MR, bool kSplit>
inline void tile_avx2(const float* xs, int64_t KP, const uint16_t* w, const SplitPair* wf, int64_t nb,
                      const float* bias, uint16_t* y, int64_t N) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const uint16_t* wb = w + nb * KP * 32;
  for (int64_t p = 0; p < KP; ++p) {
    __m256 even[2], odd[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // 8 columns x (even, odd) as 32-bit words (odd << 16 | even)
      if constexpr (kSplit) {
        odd[h] = _mm256_load_ps(wf[p].v + 8 * h);
        even[h] = _mm256_load_ps(wf[p].v + 16 + 8 * h);
      } else {
        unpack_pairs(wb + p * 32 + 16 * h, even[h], odd[h]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const float* pair = xs + (m * KP + p) * 2;
      const __m256 vo = _mm256_broadcast_ss(pair), ve = _mm256_broadcast_ss(pair + 1);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) acc[m][h] = _mm256_fmadd_ps(ve, even[h], _mm256_fmadd_ps(vo, odd[h], acc[m][h]));
    }
  }
  const int64_t n0 = nb * 16, cnt = std::min<int64_t>(16, N - n0);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    alignas(32) uint16_t out[16];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 v = bias ? _mm256_add_ps(acc[m][h], _mm256_loadu_ps(bias + n0 + 8 * h)) : acc[m][h];
      _mm_store_si128(reinterpret_cast<__m128i*>(out + 8 * h), to_bf16_avx2(v));
    }
    std::memcpy(y + m * N + n0, out, cnt * sizeof(uint16_t));
  }
}

// The rows in tiles of at most MR, as even as possible: 16 rows as 4 + 4 + 4 + 4, not 5 + 5 + 5 + 1
// (a tile of one row has two accumulators, so its FMA chains' latency, not the FMA units, sets its
// pace: ~as long as a tile of four). Which rows share a tile changes no result (see the top).
template <int MR, bool kSplit>
void rows_avx2(const float* xs, int64_t M, int64_t KP, const uint16_t* w, const SplitPair* wf, int64_t nb,
               const float* bias, uint16_t* y, int64_t N) {
  const int64_t tiles = (M + MR - 1) / MR;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
    const int64_t rows = (M - m0) / (tiles - t);
    const float* xm = xs + m0 * KP * 2;
    uint16_t* ym = y + m0 * N;
    m0 += rows;
    switch (rows) {
      case 5: tile_avx2<5, kSplit>(xm, KP, w, wf, nb, bias, ym, N); break;
      case 4: tile_avx2<4, kSplit>(xm, KP, w, wf, nb, bias, ym, N); break;
      case 3: tile_avx2<3, kSplit>(xm, KP, w, wf, nb, bias, ym, N); break;
      case 2: tile_avx2<2, kSplit>(xm, KP, w, wf, nb, bias, ym, N); break;
      default: tile_avx2<1, kSplit>(xm, KP, w, wf, nb, bias, ym, N); break;
    }
  }
}

void run_avx2(const float* xs, int64_t M, int64_t KP, const uint16_t* w, int64_t nb0, int64_t nb1, const float* bias,
              uint16_t* y, int64_t N) {
  // 10 accumulators (10 FMA chains in flight: each output's chain of FMAs is serial, its order fixed)
  // + 4 weight + 1-2 broadcast registers of the 16 ymm
  constexpr int MR = 5;
  if (M <= 2 * MR) {
    for (int64_t nb = nb0; nb < nb1; ++nb) rows_avx2<MR, false>(xs, M, KP, w, nullptr, nb, bias, y, N);
    return;
  }
  thread_local std::vector<SplitPair> panel;  // this thread's, kept between calls (grown, never shrunk)
  if (panel.size() < static_cast<size_t>(KP)) panel.resize(KP);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    split_panel(w + nb * KP * 32, KP, panel.data());
    rows_avx2<MR, true>(xs, M, KP, w, panel.data(), nb, bias, y, N);
  }
}
#else
constexpr bool kHasAvx2 = false;
void split_pairs(const uint16_t*, int64_t, int64_t, float*) {}
void run_avx2(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, const float*, uint16_t*, int64_t) {}
#endif

#if PHALANX_AMX
#if defined(PHALANX_EMULATE_AMX)
bool amx_granted() { return true; }  // the tiles are this build's own (amx_emulation.h)
#else
// Linux gives a process the AMX tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, once, for every thread); without that grant a tile instruction faults.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}
#endif

// The tile registers: tmm0-3 the accumulators (row tile i, column block j) = tmm(2 i + j), tmm4-5 the
// two row tiles of x (16 rows x 32 bf16 each), tmm6-7 two blocks' weights (16 pairs x 16 columns).
// This thread's tiles for row tiles of r0 and r1 rows (r1 0: one row tile).
void configure_amx(int r0, int r1) {
  const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  configure_amx_tiles(rows);
}

// One thread's AMX work on a range of rows and column blocks: rows of x (ldx elements apart, K
// zero-padded to KB steps of 32) against column blocks of W, two blocks and up to 32 rows (two row
// tiles) per tile group.
//
// A group's accumulators are rounded and stored while the next group's tiles run (`pending`,
// spread over its K steps): the tile unit works on its own, so the core's rounding and stores
// overlap it instead of stalling it. A call whose output is larger than the caches (kAmxStreamBytes)
// stores with non-temporal writes, so the stores do not first read each output line from memory.
struct AmxRun {
  const uint16_t* x;
  int64_t ldx, KB;  // x's row stride (elements); K steps of 32
  const uint16_t* w;
  int64_t KS;  // pairs from one column block of w to the next (KB * kAmxPairs)
  const float* bias;
  uint16_t* y;
  int64_t N;
  bool stream;  // non-temporal stores of whole output lines

  struct Pending {  // a finished group waiting to be rounded and stored
    Pending() {}  // acc left unset (4 KB): `group` stores every tile it reads back
    alignas(64) float acc[4][16][16];  // [2 i + j]: row tile i, block j
    uint16_t* y = nullptr;  // its first row's output
    int64_t nb = 0;
    int r0 = 0, r1 = 0, blocks = 0;
  } pending;

  // Rows [a, b) of the pending group, counted over both row tiles (q < r0: row q of tile 0; else row
  // q - r0 of tile 1): each rounded (after its bias) and stored.
  void store_rows(int a, int b) {
    const Pending& p = pending;
    const int64_t n0 = p.nb * 16;
    const int64_t cnt0 = std::min<int64_t>(16, N - n0), cnt1 = p.blocks == 2 ? std::min<int64_t>(16, N - n0 - 16) : 0;
    const bool full = p.blocks == 2 && cnt1 == 16;
    for (int q = a; q < b; ++q) {
      const int i = q < p.r0 ? 0 : 1, r = i ? q - p.r0 : q;
      uint16_t* dst = p.y + (16 * i + r) * N + n0;
      __m512 v0 = _mm512_load_ps(p.acc[2 * i][r]);
      if (bias) v0 = _mm512_add_ps(v0, _mm512_loadu_ps(bias + n0));
      const __m256i lo = (__m256i)_mm512_cvtneps_pbh(v0);
      if (p.blocks == 1 || !full) {
        _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << cnt0) - 1), lo);
        if (p.blocks == 1) continue;
      }
      __m512 v1 = _mm512_load_ps(p.acc[2 * i + 1][r]);
      if (bias) v1 = _mm512_add_ps(v1, _mm512_loadu_ps(bias + n0 + 16));
      const __m256i hi = (__m256i)_mm512_cvtneps_pbh(v1);
      if (!full) {
        _mm256_mask_storeu_epi16(dst + 16, static_cast<__mmask16>((1u << cnt1) - 1), hi);
        continue;
      }
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // one whole 64-byte line
      if (stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), both);
      else _mm512_storeu_si512(dst, both);
    }
  }

  void flush() {
    if (pending.y) store_rows(0, pending.r0 + pending.r1);
    pending.y = nullptr;
  }

  // Rows m0.. (r0 + r1 of them; R2: r1 > 0) against block nb and, with B2, nb + 1. The accumulators
  // walk the K steps in order: each output's sum is the hardware's per-step sum (gemm's order).
  template <bool R2, bool B2>
  void group(int64_t m0, int64_t nb, int r0, int r1) {
    const uint16_t* xm = x + m0 * ldx;
    px_tile_zero(0);
    if constexpr (B2) px_tile_zero(1);
    if constexpr (R2) px_tile_zero(2);
    if constexpr (R2 && B2) px_tile_zero(3);
    const uint16_t* w0 = w + nb * KS * 32;
    const uint16_t* w1 = w0 + KS * 32;
    const int64_t stride = ldx * 2;
    const int waiting = pending.y ? pending.r0 + pending.r1 : 0;
    for (int64_t kb = 0; kb < KB; ++kb) {
      px_tile_loadd(4, xm + kb * 32, stride);
      if constexpr (R2) px_tile_loadd(5, xm + 16 * ldx + kb * 32, stride);
      px_tile_loadd(6, w0 + kb * kAmxPairs * 32, 64);
      px_tile_dpbf16ps(0, 4, 6);
      if constexpr (R2) px_tile_dpbf16ps(2, 5, 6);
      if constexpr (B2) {
        px_tile_loadd(7, w1 + kb * kAmxPairs * 32, 64);
        px_tile_dpbf16ps(1, 4, 7);
        if constexpr (R2) px_tile_dpbf16ps(3, 5, 7);
      }
      if (waiting) store_rows(static_cast<int>(kb * waiting / KB), static_cast<int>((kb + 1) * waiting / KB));
    }
    px_tile_stored(0, pending.acc[0], 64);
    if constexpr (B2) px_tile_stored(1, pending.acc[1], 64);
    if constexpr (R2) px_tile_stored(2, pending.acc[2], 64);
    if constexpr (R2 && B2) px_tile_stored(3, pending.acc[3], 64);
    pending.y = y + m0 * N;
    pending.nb = nb;
    pending.r0 = r0;
    pending.r1 = R2 ? r1 : 0;
    pending.blocks = B2 ? 2 : 1;
  }

  // Rows [m_begin, m_end) against column blocks [nb0, nb1): two blocks at a time, and for each pair
  // every 32 rows while the pair's weights are in cache.
  void run(int64_t m_begin, int64_t m_end, int64_t nb0, int64_t nb1) {
    int shape = -1;  // the tiles' current (r0, r1), as 32 r0 + r1
    for (int64_t nb = nb0; nb < nb1; nb += 2) {
      const bool b2 = nb + 1 < nb1;
      for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
        const int r0 = static_cast<int>(std::min<int64_t>(16, m_end - m0));
        const int r1 = static_cast<int>(std::min<int64_t>(16, m_end - m0 - r0));
        if (32 * r0 + r1 != shape) {
          configure_amx(r0, r1);
          shape = 32 * r0 + r1;
        }
        if (r1 && b2) group<true, true>(m0, nb, r0, r1);
        else if (r1) group<true, false>(m0, nb, r0, r1);
        else if (b2) group<false, true>(m0, nb, r0, r1);
        else group<false, false>(m0, nb, r0, r1);
      }
    }
    flush();
  }
};

// Rows [m0, m1) against column blocks [nb0, nb1) on this thread's tiles (see AmxRun).
void run_amx(const uint16_t* x, int64_t ldx, int64_t KB, const uint16_t* w, int64_t KS, const float* bias, uint16_t* y,
             int64_t N, bool stream, int64_t m0, int64_t m1, int64_t nb0, int64_t nb1) {
  AmxRun{x, ldx, KB, w, KS, bias, y, N, stream}.run(m0, m1, nb0, nb1);
}

void release_amx() {
  _mm_sfence();  // the non-temporal stores are ordered before the caller reads the output
  release_amx_tiles();
}
#else
bool amx_granted() { return false; }
void run_amx(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t, bool, int64_t,
             int64_t, int64_t, int64_t) {}
void release_amx() {}
#endif

}  // namespace

bool amx_tiles_granted() { return amx_granted(); }

#if PHALANX_AMX
void configure_amx_tiles(const int (&rows)[8]) { load_amx_tile_config(rows); }

void release_amx_tiles() { px_tile_release(); }
#else
void configure_amx_tiles(const int (&)[8]) {}
void release_amx_tiles() {}
#endif

std::vector<int64_t> gemm_isas() {
  std::vector<int64_t> isas;
  if (amx_granted()) isas.push_back(kGemmAmx);
  if (kHasAvx512Bf16) isas.push_back(kGemmAvx512Bf16);
  if (kHasAvx2) isas.push_back(kGemmAvx2);
  return isas;
}

at::Tensor gemm(at::Tensor x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK((isa == kGemmAmx && amx_granted()) || (isa == kGemmAvx512Bf16 && kHasAvx512Bf16) ||
                  (isa == kGemmAvx2 && kHasAvx2),
              "gemm: path ", isa, " is not in this build (3: AMX, here ", amx_granted(), "; 2: AVX512-BF16, here ",
              kHasAvx512Bf16, "; 1: AVX2, here ", kHasAvx2, ")");
  check_bf16_rows(x, "gemm");
  TORCH_CHECK(x.dim() == 2, "gemm: x must be an [M, K] matrix");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(is_packed_for(packed, K, isa) && packed.size(0) == (N + 15) / 16,
              "gemm: packed must be pack_pairs of an [N, K] weight for path ", isa, " with K = x.size(1) = ", K,
              " and N = ", N);
  // KP: the pairs of K; KS: the pairs from one column block to the next (KP, or on the AMX path KP
  // rounded up to whole tile steps: the zero padding lies between the blocks, outside the view)
  const int64_t NB = packed.size(0), KP = packed.size(1), KS = packed.stride(0) / 32;
  std::vector<float> bias_f;  // float32, zero-padded to whole blocks
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "gemm: bias must be [", N, "]");
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat,
                "gemm: bias must be bfloat16 or float32");
    const at::Tensor b = bias->contiguous();
    bias_f.assign(NB * 16, 0.f);  // converted here: a dispatched .to() costs more than a small layer
    if (b.scalar_type() == at::kFloat) std::memcpy(bias_f.data(), b.data_ptr<float>(), N * sizeof(float));
    else for (int64_t n = 0; n < N; ++n) bias_f[n] = bits_to_float(u16(b)[n]);
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const uint16_t* xp = u16(x);
  const uint16_t* wp = u16(packed);
  const float* bp = bias_f.empty() ? nullptr : bias_f.data();
  uint16_t* y = u16_mut(out);
  std::vector<float> xs;  // the AVX2 path's rows as (odd, even) float32 pairs
  if (isa == kGemmAvx2) {
    xs.resize(M * KP * 2);
    split_pairs(xp, M, K, xs.data());
  }
  // The AMX path reads x in steps of 32 columns: a K that is not a whole number of steps is copied
  // once, zero-padded (the padded weights are zero there too, so the padding adds zeros).
  std::vector<uint16_t> x_padded;
  int64_t ldx = K;
  if (isa == kGemmAmx && K != 2 * KS) {
    ldx = 2 * KS;
    x_padded.assign(M * ldx, 0);
    for (int64_t m = 0; m < M; ++m) std::memcpy(x_padded.data() + m * ldx, xp + m * K, K * sizeof(uint16_t));
  }
  const uint16_t* xa = x_padded.empty() ? xp : x_padded.data();
  // The rows split evenly over as few chunks as hold at most kChunkRows each (kAmxChunkRows on the
  // AMX path: its tiles go through a chunk ~10x faster, and each chunk reads all the weights once
  // more, so its chunks are larger; 256 rows of x still fit a core's L2): 104 rows as 52 + 52,
  // not 96 + 8 (the threads take contiguous ranges of items, so with 96 + 8 one thread had the whole
  // 96-row chunk and the other the 8: at 104 rows the layer took ~1.6x as long as at 96). A row's
  // result does not depend on its chunk.
  const int64_t chunk_max = isa == kGemmAmx ? kAmxChunkRows : kChunkRows;
  const int64_t chunks = (M + chunk_max - 1) / chunk_max, chunk_rows = (M + chunks - 1) / chunks;
  // Column blocks (of 16) per work item, as many as a path's tiles take at a time: AVX512-BF16 4,
  // AMX 2, AVX2 1; so the threads' shares differ by one tile's blocks at most (in items of 4, a
  // layer of 36 blocks splits 20 / 16: ~10 % longer than an even split).
  const int64_t item_blocks = isa == kGemmAvx512Bf16 ? 4 : isa == kGemmAmx ? 2 : 1;
  const int64_t groups = (NB + item_blocks - 1) / item_blocks;
  // a thread only for >= ~64K multiply-adds (a wake-up costs a few microseconds)
  const int64_t item_work = chunk_rows * item_blocks * 16 * K;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(item_work, 1));
  // the AMX path streams an output larger than the caches past them (whole 64-byte lines only)
  const bool stream = M * N * 2 >= kAmxStreamBytes && N % 32 == 0 && reinterpret_cast<uintptr_t>(y) % 64 == 0;
  at::parallel_for(0, chunks * groups, grain, [&](int64_t begin, int64_t end) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | kDazFtz);
    for (int64_t item = begin; item < end;) {  // items are chunk-major: merge a chunk's consecutive groups
      const int64_t c = item / groups, g0 = item % groups, g1 = std::min(groups, g0 + (end - item));
      item += g1 - g0;
      const int64_t m0 = c * chunk_rows, rows = std::min(chunk_rows, M - m0);
      const int64_t nb0 = g0 * item_blocks, nb1 = std::min(NB, g1 * item_blocks);
      if (isa == kGemmAmx) run_amx(xa, ldx, KS / kAmxPairs, wp, KS, bp, y, N, stream, m0, m0 + rows, nb0, nb1);
      else if (isa == kGemmAvx512Bf16) run_bf16(xp + m0 * K, rows, K, wp, KP, nb0, nb1, bp, y + m0 * N, N);
      else run_avx2(xs.data() + m0 * KP * 2, rows, KP, wp, nb0, nb1, bp, y + m0 * N, N);
    }
    if (isa == kGemmAmx) release_amx();
    _mm_setcsr(csr);
  });
  return out;
}

at::Tensor embedding_rows(const at::Tensor& table, const at::Tensor& ids, int64_t K, int64_t V) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "embedding_rows: ids must be a 1-D int64 tensor");
  if (table.dim() == 2) {
    TORCH_CHECK(table.size(1) == K, "embedding_rows: the table has rows of ", table.size(1), ", not K = ", K);
    return table.index_select(0, ids);
  }
  TORCH_CHECK(is_packed_for(table, K, kGemmAvx2) || is_packed_for(table, K, kGemmAmx),
              "embedding_rows: table must be [V, K] or pack_pairs of a bfloat16 [V, K] table with K = ", K);
  const at::Tensor idx = ids.contiguous();
  const int64_t T = idx.numel(), KP = table.size(1), KS = table.stride(0) / 32, padded = table.size(0) * 16;
  TORCH_CHECK(V <= padded, "embedding_rows: V = ", V, " rows, but the packed table holds ", padded);
  if (V < 0) V = padded;
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < V, "embedding_rows: token id ", ip[t], " is out of range [0, ", V, ")");
  auto out = at::empty({T, K}, table.options());
  const uint16_t* wp = u16(table);
  uint16_t* op = u16_mut(out);
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = ip[t];
      const uint16_t* col = wp + (n / 16) * KS * 32 + (n % 16) * 2;  // pair p of row n at col + 32 p
      uint16_t* row = op + t * K;
      for (int64_t p = 0; p < K / 2; ++p) std::memcpy(row + 2 * p, col + 32 * p, 4);
      if (K % 2) row[K - 1] = col[32 * (KP - 1)];
    }
  });
  return out;
}

}  // namespace phalanx
