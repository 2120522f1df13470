// Paged attention over a [S, Q] query grid, keys and values read in place from the paged cache
// through the block table (ops.cpu's `decode_attention`; the decode group and each prefill chunk).
// Each query's result depends only on its own query, keys and values: every sum runs in one fixed
// order, whatever the batch or the number of query tokens around it (batch-invariant).
#include <ATen/ops/empty_like.h>

#include <atomic>

#include "amx_tiles.h"
#include "common.h"
#include "gemm.h"
#include "ops.h"

namespace phalanx {
namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// One (request, KV head) task of the bf16 decode attention for head_dim = 16 * NV (NV even):
// scores 16 keys at a time (AVX512-BF16 dots, one reduce16 per 16 keys), softmax per row, then the
// weighted sum of values with each tile of RT query rows' accumulators held in registers while
// the keys stream past. Every sum runs in a fixed order that depends only on the row's own keys.
template <int NV, typename O>
void decode_task_bf16(const c10::BFloat16* const* qrow, const c10::BFloat16* const* krow,
                      const c10::BFloat16* const* vrow, const int64_t* limit, int64_t rows, int64_t len,
                      float scale, float* scores, O* const* orow) {
  constexpr int ND = NV / 2;  // 32-element bf16 pair chunks per head
  constexpr int RT = NV <= 4 ? 4 : 2;  // query rows per register tile in the value pass
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    __m512bh qv[ND];
    for (int c = 0; c < ND; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qrow[r] + 32 * c);
    float* srow = scores + r * len;
    for (int64_t l0 = 0; l0 < limit[r]; l0 += 16) {
      const int64_t n = std::min<int64_t>(16, limit[r] - l0);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        const c10::BFloat16* k = krow[l0 + std::min<int64_t>(j, n - 1)];  // past n: a repeat, unused
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < ND; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
        acc[j] = a;
      }
      const __mmask16 m = static_cast<__mmask16>((1u << n) - 1u);
      _mm512_mask_storeu_ps(srow + l0, m, _mm512_mul_ps(reduce16(acc), vscale));
    }
    softmax_row(srow, limit[r]);
  }
  for (int64_t r0 = 0; r0 < rows; r0 += RT) {
    const int64_t nr = std::min<int64_t>(RT, rows - r0);
    int64_t tile_len = 0;
    for (int64_t i = 0; i < nr; ++i) tile_len = std::max(tile_len, limit[r0 + i]);
    __m512 acc[RT][NV];
    for (int i = 0; i < RT; ++i)
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < tile_len; ++l) {
      __m512 vf[NV];
      for (int c = 0; c < NV; ++c) vf[c] = load16_ps(vrow[l] + 16 * c);
      for (int i = 0; i < RT; ++i) {
        if (i >= nr || l >= limit[r0 + i]) continue;  // a key this row does not see: no term at all
        const __m512 p = _mm512_set1_ps(scores[(r0 + i) * len + l]);
        for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_fmadd_ps(p, vf[c], acc[i][c]);
      }
    }
    for (int i = 0; i < nr; ++i) {
      alignas(64) float tmp[16 * NV];
      for (int c = 0; c < NV; ++c) _mm512_store_ps(tmp + 16 * c, acc[i][c]);
      from_float(tmp, orow[r0 + i], 16 * NV);
    }
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// decode_task_bf16 for CPUs without AVX512-BF16 (AVX2 + FMA), written to the same arithmetic step
// for step: each key's 16 lanes (lane i: the pairs (2i, 2i + 1) of every 32-element chunk, the odd
// element then the even one, as VDPBF16PS takes them, under denormals-are-zero / flush-to-zero)
// held as two 8-lane halves, the same transpose-and-add tree over a key's 16 lanes (reduce16), the
// same softmax_row, and the same FMA per key in the value pass.
constexpr unsigned kDazFtz = 0x8040;  // MXCSR: denormals are zero (bit 6), flush to zero (bit 15)

// Lane j of 16 key vectors (lanes[j][0..15]) -> their sums, reduce16's tree: per 128-bit quarter
// L, S_L = (x[4L] + x[4L+2]) + (x[4L+1] + x[4L+3]); the sum = (S_0 + S_1) + (S_2 + S_3).
inline void reduce16_avx2(const float (*lanes)[16], float scale, float* out) {
  for (int g = 0; g < 4; ++g) {  // keys 4g .. 4g + 3
    __m256 s2[2];
    for (int h = 0; h < 2; ++h) {  // lanes 8h .. 8h + 7: quarters 2h, 2h + 1
      const __m256 v0 = _mm256_load_ps(lanes[4 * g] + 8 * h), v1 = _mm256_load_ps(lanes[4 * g + 1] + 8 * h);
      const __m256 v2 = _mm256_load_ps(lanes[4 * g + 2] + 8 * h), v3 = _mm256_load_ps(lanes[4 * g + 3] + 8 * h);
      const __m256 a = _mm256_add_ps(_mm256_unpacklo_ps(v0, v1), _mm256_unpackhi_ps(v0, v1));
      const __m256 b = _mm256_add_ps(_mm256_unpacklo_ps(v2, v3), _mm256_unpackhi_ps(v2, v3));
      const __m256d ad = _mm256_castps_pd(a), bd = _mm256_castps_pd(b);
      s2[h] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ad, bd)), _mm256_castpd_ps(_mm256_unpackhi_pd(ad, bd)));
    }
    const __m128 q01 = _mm_add_ps(_mm256_castps256_ps128(s2[0]), _mm256_extractf128_ps(s2[0], 1));
    const __m128 q23 = _mm_add_ps(_mm256_castps256_ps128(s2[1]), _mm256_extractf128_ps(s2[1], 1));
    _mm_storeu_ps(out + 4 * g, _mm_mul_ps(_mm_add_ps(q01, q23), _mm_set1_ps(scale)));
  }
}

// 8 floats on a 32-byte boundary: the unit of the task's unpacked queries, values and accumulators.
struct alignas(32) F8 {
  float v[8];
};

constexpr int kRowTile = 4;         // query rows whose scores one pass over a key block computes
constexpr int64_t kKeyBlock = 64;   // keys per block of the score pass (the tile's lane sums: 16 KB)

// Lane sums of R query rows against the keys k[0 .. padded) (lanes[i * kKeyBlock + j][0..15]: row
// i, key j; the score pass reduces them). Each row's queries come as float32 halves, 4 vectors per
// 32-element chunk c (qf[i][4c + h]: odd elements of half h, qf[i][4c + 2 + h]: even ones); every
// key is unpacked once for all R rows, and each row's two accumulators take the same FMAs in the same
// order as the one-row loop (per chunk: the odd element, then the even one).
template <int ND, int R>
inline void score_tile_avx2(const F8* const* qf, const c10::BFloat16* const* k, int64_t n, int64_t padded,
                            float (*lanes)[16]) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t j = 0; j < padded; ++j) {
    const c10::BFloat16* kj = k[std::min<int64_t>(j, n - 1)];  // past n: a repeat, unused
    __m256 a[R][2];
    for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int c = 0; c < ND; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kj + 32 * c + 16 * h));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, high));
        for (int i = 0; i < R; ++i) a[i][h] = _mm256_fmadd_ps(_mm256_load_ps(qf[i][4 * c + h].v), odd, a[i][h]);
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        for (int i = 0; i < R; ++i) a[i][h] = _mm256_fmadd_ps(_mm256_load_ps(qf[i][4 * c + 2 + h].v), even, a[i][h]);
      }
    for (int i = 0; i < R; ++i) {
      _mm256_store_ps(lanes[i * kKeyBlock + j], a[i][0]);
      _mm256_store_ps(lanes[i * kKeyBlock + j] + 8, a[i][1]);
    }
  }
}

// acc[0 .. W) += p_l * v_l for the keys l of one value block a row sees, one FMA per key in key order
// (vals: the block's keys as float32, `stride` vectors apart).
template <int W>
inline void value_slice_avx2(F8* acc, const F8* vals, int64_t stride, const float* p, int64_t n) {
  __m256 a[W];
  for (int c = 0; c < W; ++c) a[c] = _mm256_load_ps(acc[c].v);
  for (int64_t l = 0; l < n; ++l) {
    const __m256 pl = _mm256_set1_ps(p[l]);
    for (int c = 0; c < W; ++c) a[c] = _mm256_fmadd_ps(pl, _mm256_load_ps(vals[l * stride + c].v), a[c]);
  }
  for (int c = 0; c < W; ++c) _mm256_store_ps(acc[c].v, a[c]);
}

template <int NV, typename O>
void decode_task_bf16(const c10::BFloat16* const* qrow, const c10::BFloat16* const* krow,
                      const c10::BFloat16* const* vrow, const int64_t* limit, int64_t rows, int64_t len,
                      float scale, float* scores, O* const* orow) {
  constexpr int ND = NV / 2;       // 32-element chunks per head
  constexpr int64_t DV = 2 * NV;   // 8-float vectors per head
  constexpr int64_t kValueBlock = 256 / NV;  // keys per block of the value pass (16 KB as float32)
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const unsigned csr = _mm_getcsr();
  thread_local std::vector<F8> qbuf, vbuf, acc;  // this thread's, kept between calls (grown, never shrunk)
  qbuf.resize(rows * 4 * ND);
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < ND; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow[r] + 32 * c + 16 * h));
        _mm256_store_ps(qbuf[(r * ND + c) * 4 + h].v, _mm256_castsi256_ps(_mm256_and_si256(w, high)));
        _mm256_store_ps(qbuf[(r * ND + c) * 4 + 2 + h].v, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      }
  // scores: kRowTile rows x kKeyBlock keys at a time, the lane sums under DAZ / FTZ (as VDPBF16PS),
  // then each key's reduce16 tree and the scale in the normal mode
  alignas(32) float lanes[kRowTile * kKeyBlock][16];
  for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
    const int nr = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
    int64_t tile_len = 0;
    for (int i = 0; i < nr; ++i) tile_len = std::max(tile_len, limit[r0 + i]);
    const F8* qf[kRowTile];
    for (int i = 0; i < nr; ++i) qf[i] = qbuf.data() + (r0 + i) * 4 * ND;
    for (int64_t c0 = 0; c0 < tile_len; c0 += kKeyBlock) {
      const int64_t cn = std::min<int64_t>(kKeyBlock, tile_len - c0), padded = (cn + 15) / 16 * 16;
      _mm_setcsr(csr | kDazFtz);
      switch (nr) {
        case 4: score_tile_avx2<ND, 4>(qf, krow + c0, cn, padded, lanes); break;
        case 3: score_tile_avx2<ND, 3>(qf, krow + c0, cn, padded, lanes); break;
        case 2: score_tile_avx2<ND, 2>(qf, krow + c0, cn, padded, lanes); break;
        default: score_tile_avx2<ND, 1>(qf, krow + c0, cn, padded, lanes); break;
      }
      _mm_setcsr(csr);
      for (int i = 0; i < nr; ++i) {
        const int64_t seen = std::min<int64_t>(cn, limit[r0 + i] - c0);  // keys of this block the row sees
        float* srow = scores + (r0 + i) * len + c0;
        int64_t j0 = 0;
        for (; j0 + 16 <= seen; j0 += 16) reduce16_avx2(lanes + i * kKeyBlock + j0, scale, srow + j0);
        if (j0 < seen) {  // a last group of fewer than 16 keys: its sums past `seen` are not the row's
          alignas(16) float sums[16];
          reduce16_avx2(lanes + i * kKeyBlock + j0, scale, sums);
          for (int64_t j = j0; j < seen; ++j) srow[j] = sums[j - j0];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) softmax_row(scores + r * len, limit[r]);
  // out[r] = sum_l p[r, l] * v_l, one FMA per key in key order for every element: the values
  // unpacked to float32 a block at a time, each row's accumulators carried from block to block
  acc.assign(rows * DV, F8{});
  vbuf.resize(kValueBlock * DV);
  for (int64_t l0 = 0; l0 < len; l0 += kValueBlock) {
    const int64_t ln = std::min<int64_t>(kValueBlock, len - l0);
    for (int64_t j = 0; j < ln; ++j)
      for (int64_t c = 0; c < DV; ++c)
        _mm256_store_ps(vbuf[j * DV + c].v, load8_ps(reinterpret_cast<const uint16_t*>(vrow[l0 + j]) + 8 * c));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min<int64_t>(limit[r], l0 + ln) - l0;  // keys of this block the row sees
      if (n <= 0) continue;
      const float* p = scores + r * len + l0;
      F8* a = acc.data() + r * DV;
      int64_t c = 0;
      for (; c + 8 <= DV; c += 8) value_slice_avx2<8>(a + c, vbuf.data() + c, DV, p, n);
      if (c < DV) value_slice_avx2<4>(a + c, vbuf.data() + c, DV, p, n);  // DV is a multiple of 4
    }
  }
  for (int64_t r = 0; r < rows; ++r) from_float(acc[r * DV].v, orow[r], 16 * NV);
}
#else
template <int NV, typename O>
void decode_task_bf16(const c10::BFloat16* const*, const c10::BFloat16* const*, const c10::BFloat16* const*,
                      const int64_t*, int64_t, int64_t, float, float*, O* const*) {}
#endif

#if PHALANX_AMX
constexpr bool kAmxAttention = true;

// The bf16 task on AMX tiles (the GEMM's AMX path, `isa` 3: its tile instruction's order, gemm.cpp),
// for head_dim = 32 * S (S <= 4). Tiles: tmm0-3 accumulators (16 x 16 float32), tmm4 and tmm6 the
// A operand, tmm5 the B operand (tmm6 the accumulator of a lone row group's scores); every tile 16
// rows x 64 bytes.
//
// The order. Scores: for key l and query row r, acc = 0, then per step s of 32 head elements
// acc = acc + (even + odd), where even sums q[r, 2p] k[l, 2p] one product at a time in pair order
// p = 16 s .. 16 s + 15 from zero and odd the odd elements' likewise (one TDPBF16PS, 16 keys x 16
// rows). Softmax (flash attention's split): m = the row's largest score, e_l = exp2_amx_ps(max(
// fma(s_l, c, -(m * c)), -125)) with c = scale * log2(e) in float32, their sum over 16 lanes (key l
// in lane l % 16, the groups of 16 in order, keys past the row's limit zero) then
// _mm512_reduce_add_ps. Values: each e rounded to bf16 (nearest even, denormals to zero), then for
// output element d, acc = 0 and per step of 32 keys acc = acc + (even + odd) over the keys' pairs
// (2j, 2j + 1) the same way; keys a row does not see weigh exactly zero, so a step past its last
// key adds zero; the output is acc * (1 / sum). Nothing depends on the other rows in a tile, or on
// how many there are: a query's result is the same decoding or in a prompt. Denormal inputs and
// tile results count as zero (the tiles' DAZ / FTZ). Unlike the register-tiled task's float32
// probabilities and Cephes exps, these are bf16 (as SDPA's flash kernel and vLLM's CPU attention
// round them): an AMX CPU gives other bits than the other paths, as its GEMM does
// (PHALANX_CPU_ISA=avx512_bf16 runs the register-tiled task there).
//
// Measured (benchmarks/attention_bench.py, SmolLM2's shapes, 2 threads, a Xeon with AMX) against
// the register-tiled task: a 1,930-token prefill 51.4 -> 13.3 ms, 512 tokens 3.55 -> 1.19, a
// 256-token chunk after 768 cached 6.06 -> 1.67, verifying 8 x 4 at 300 keys 0.33 -> 0.16;
// decoding (memory-bound) about level. The flash-style softmax took the prefill from 20.5 ms (Cephes
// exps, a scaling pass, float32 probabilities written back) and put it under SDPA's 16.8-18.9.

// A 16 x 16 matrix of 32-bit elements: rows in[0..15] -> columns out[0..15].
inline void transpose16x16(const __m512i* in, __m512i* out) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane L: elements 4L, 4L + 1 of rows i, i + 1, interleaved
    a[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // b[i + e], lane L: element 4L + e of rows i .. i + 3
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // column 4L + e: lane L of b[e], b[4 + e], b[8 + e], b[12 + e]
    const __m512i x01 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44), x23 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
    const __m512i y01 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
    const __m512i y23 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
    out[e] = _mm512_shuffle_i32x4(x01, y01, 0x88);
    out[4 + e] = _mm512_shuffle_i32x4(x01, y01, 0xDD);
    out[8 + e] = _mm512_shuffle_i32x4(x23, y23, 0x88);
    out[12 + e] = _mm512_shuffle_i32x4(x23, y23, 0xDD);
  }
}

// Lanes [0, n) of 16 (n <= 0: none, n >= 16: all).
inline __mmask16 tail_mask(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFFu : n <= 0 ? 0u : (1u << n) - 1u);
}

// 2^t for t in [-125, 1]: t = n + f with n the nearest integer (ties to even), 2^f by a degree-5
// polynomial on [-0.5, 0.5] (Horner with FMAs; within 4 ulp), times 2^n exactly (VSCALEFPS). Ten
// instructions for 16 exps against Cephes' ~20 (exp_nonpositive_ps): the probabilities it feeds are
// rounded to bf16 anyway.
inline __m512 exp2_amx_ps(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3276470126584172e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675540961325169e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713464617729e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120237350464e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440460205e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(p, n);
}

template <typename O>
void decode_task_amx(const c10::BFloat16* const* qrow, const c10::BFloat16* const* krow,
                     const c10::BFloat16* const* vrow, const int64_t* limit, int64_t rows, int64_t len,
                     int64_t head_dim, float scale, O* const* orow) {
  const int64_t steps = head_dim / 32;   // 32 head elements (16 pairs) per tile step
  const int64_t dtiles = head_dim / 16;  // 16 output elements per accumulator tile
  const int64_t groups = (rows + 15) / 16;
  const int64_t ls = (len + 31) / 32 * 32;  // a score row: whole 16-key tiles and 32-key value steps
  // A operands: the queries (16-row groups, zero rows past the task's), the bf16 probabilities;
  // B operands: 16 keys' pairs per step ([16 pairs][16 keys]), the values' key pairs per 32-key step
  // and 16-element tile ([16 key pairs][16 elements]); the scores, 16-row groups of `ls` each
  thread_local std::vector<uint16_t> qa, pb;
  thread_local std::vector<uint32_t> kt, vt;
  thread_local std::vector<float> sc;
  if (groups > 1) {  // a prompt's queries, staged as A tiles (decoding reads them as B tiles below)
    qa.assign(groups * 16 * head_dim, uint16_t{0});
    for (int64_t r = 0; r < rows; ++r) std::memcpy(qa.data() + r * head_dim, qrow[r], head_dim * 2);
    kt.resize(steps * 256);
  }
  sc.resize(groups * 16 * ls);
  thread_local std::vector<int64_t> glen;  // per row group: the most keys a row of it sees
  glen.assign(groups, 0);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = g * 16; r < std::min<int64_t>(rows, g * 16 + 16); ++r) glen[g] = std::max(glen[g], limit[r]);
  }
  if (groups == 1) {
    // One row group (decoding, verification): the keys are the A operand, read in place (16 keys
    // one stride apart in a cache block; else staged), the queries' pairs the B operand, and the
    // [16 keys][16 rows] tile's columns copied out: cheaper than transposing every key for a few
    // rows. Each score is the same sum either way (a product of two bf16 values is exact, and the
    // tile sums an element's products in pair order whichever operand holds which).
    thread_local std::vector<uint16_t> ks;
    ks.resize(16 * head_dim);
    alignas(64) uint32_t qb[4][256];  // per step, [16 pairs][16 rows]
    std::memset(qb, 0, sizeof(qb));
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t* qp = reinterpret_cast<const uint32_t*>(qrow[r]);
      for (int64_t st = 0; st < steps; ++st)
        for (int p = 0; p < 16; ++p) qb[st][p * 16 + r] = qp[st * 16 + p];
    }
    alignas(64) float ct[16][16];
    for (int64_t l0 = 0; l0 < glen[0]; l0 += 16) {
      const int64_t n = std::min<int64_t>(16, glen[0] - l0);
      // the next 16 keys on their way while these are scored (decoding streams the cache: a tile
      // load waits for its 16 rows together)
      for (int64_t j = l0 + 16; j < std::min<int64_t>(l0 + 32, glen[0]); ++j)
        for (int64_t b = 0; b < head_dim * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(krow[j]) + b, _MM_HINT_T0);
      const c10::BFloat16* a = krow[l0];
      bool in_place = n == 16;
      for (int64_t j = 1; in_place && j < 16; ++j) in_place = krow[l0 + j] == a + j * head_dim;
      if (!in_place) {  // the missing rows zero: their scores are never read
        std::fill(ks.begin(), ks.end(), uint16_t{0});
        for (int64_t j = 0; j < n; ++j) std::memcpy(ks.data() + j * head_dim, krow[l0 + j], head_dim * 2);
        a = reinterpret_cast<const c10::BFloat16*>(ks.data());
      }
      px_tile_zero(6);
      for (int64_t st = 0; st < steps; ++st) {
        px_tile_loadd(4, a + 32 * st, head_dim * 2);
        px_tile_loadd(5, qb[st], 64);
        px_tile_dpbf16ps(6, 4, 5);
      }
      px_tile_stored(6, ct, 64);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = sc.data() + r * ls + l0;
        for (int64_t j = 0; j < n; ++j) row[j] = ct[j][r];
      }
    }
  }
  // scores: per 16 keys, their pairs transposed once into B tiles, then each row group's 16 x 16 tile
  for (int64_t l0 = 0; groups > 1 && l0 < len; l0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - l0);
    for (int64_t s = 0; s < steps; ++s) {
      __m512i in[16], out[16];
      for (int64_t j = 0; j < 16; ++j)
        in[j] = j < n ? _mm512_loadu_si512(krow[l0 + j] + 32 * s) : _mm512_setzero_si512();
      transpose16x16(in, out);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kt.data() + s * 256 + p * 16, out[p]);
    }
    // up to 4 row groups at a time, each its own accumulator (tmm0-3), so the tile unit works on
    // four independent sums instead of waiting on one; the A tiles alternate between tmm4 and tmm6
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
      const int64_t ng = std::min<int64_t>(4, groups - g0);
      int64_t most = 0;
      for (int64_t g = g0; g < g0 + ng; ++g) most = std::max(most, glen[g]);
      if (most <= l0) continue;  // a group past its rows' keys is computed along (its columns unread)
      px_tile_zero(0);
      px_tile_zero(1);
      px_tile_zero(2);
      px_tile_zero(3);
      const int64_t stride = head_dim * 2;
      for (int64_t s = 0; s < steps; ++s) {
        const uint16_t* qs = qa.data() + g0 * 16 * head_dim + 32 * s;
        px_tile_loadd(5, kt.data() + s * 256, 64);
        px_tile_loadd(4, qs, stride);
        px_tile_dpbf16ps(0, 4, 5);
        if (ng > 1) {
          px_tile_loadd(6, qs + 16 * head_dim, stride);
          px_tile_dpbf16ps(1, 6, 5);
        }
        if (ng > 2) {
          px_tile_loadd(4, qs + 32 * head_dim, stride);
          px_tile_dpbf16ps(2, 4, 5);
        }
        if (ng > 3) {
          px_tile_loadd(6, qs + 48 * head_dim, stride);
          px_tile_dpbf16ps(3, 6, 5);
        }
      }
      float* out = sc.data() + g0 * 16 * ls + l0;
      px_tile_stored(0, out, ls * 4);
      if (ng > 1) px_tile_stored(1, out + 16 * ls, ls * 4);
      if (ng > 2) px_tile_stored(2, out + 32 * ls, ls * 4);
      if (ng > 3) px_tile_stored(3, out + 48 * ls, ls * 4);
    }
  }
  // The softmax, as flash attention splits it: per row the raw scores' maximum m; then, 32 keys at a
  // time, e = 2^t with t = max(fma(s, c, -(m c)), -125) and c = scale * log2(e) (exp2_amx_ps), whose
  // float32 sum (16 lanes over the key groups in order, then their reduction) normalises the row's
  // output after the value tiles; e itself is rounded to bf16 for them. Keys past a row's limit
  // weigh zero. A score is read twice (its row's maximum, its exp), never rewritten.
  const float c = scale * 1.44269504088896341f;
  const __m512 vc = _mm512_set1_ps(c), floor2 = _mm512_set1_ps(-125.f);
  thread_local std::vector<float> bias, inv;
  bias.assign(rows, 0.f);
  inv.assign(rows, 0.f);  // a row without keys: its output stays zero
  for (int64_t r = 0; r < rows; ++r) {
    if (limit[r] <= 0) continue;
    const float* row = sc.data() + r * ls;  // the row groups lie one after another
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t l = 0; l < limit[r]; l += 16)
      vmax = _mm512_mask_max_ps(vmax, tail_mask(limit[r] - l), vmax, _mm512_loadu_ps(row + l));
    bias[r] = -(_mm512_reduce_max_ps(vmax) * c);
  }
  // a row group's bf16 exps, [16 rows][its keys rounded up to 32]: the A tiles of the value products
  auto probabilities = [&](int64_t g, int64_t lg, uint16_t* dst) {
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t r = g * 16 + i;
      const int64_t seen = r < rows ? limit[r] : 0;
      uint16_t* out = dst + i * lg;
      if (seen <= 0) {
        std::memset(out, 0, lg * 2);
        continue;
      }
      const float* row = sc.data() + r * ls;
      const __m512 vb = _mm512_set1_ps(bias[r]);
      __m512 vsum = _mm512_setzero_ps();
      int64_t k0 = 0;
      for (; k0 < seen; k0 += 32) {
        const __mmask16 m0 = tail_mask(seen - k0), m1 = tail_mask(seen - k0 - 16);
        const __m512 e0 = _mm512_maskz_mov_ps(
            m0, exp2_amx_ps(_mm512_max_ps(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, row + k0), vc, vb), floor2)));
        const __m512 e1 = _mm512_maskz_mov_ps(
            m1, exp2_amx_ps(_mm512_max_ps(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, row + k0 + 16), vc, vb), floor2)));
        vsum = _mm512_add_ps(_mm512_add_ps(vsum, e0), e1);
        _mm512_storeu_si512(out + k0, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      }
      if (k0 < lg) std::memset(out + k0, 0, (lg - k0) * 2);
      inv[r] = 1.f / _mm512_reduce_add_ps(vsum);
    }
  };
  // the values' key pairs: element 2e of a tile row is key 2j's element, 2e + 1 key 2j + 1's;
  // `stage` writes 32-key step ks's tiles [t0, t0 + nt) at dst (256 words a tile), keys past `len` zero
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  auto stage = [&](int64_t ks, int64_t t0, int64_t nt, uint32_t* dst) {
    for (int64_t j = 32 * ks; j < 32 * ks + 32; j += 2) {
      uint32_t* row = dst + ((j % 32) / 2) * 16;
      for (int64_t f = j + 16; f < std::min<int64_t>(j + 18, len); ++f)  // values a few pairs ahead
        for (int64_t b = 0; b < head_dim * 2; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(vrow[f]) + b, _MM_HINT_T0);
      for (int64_t c = t0 / 2; c < (t0 + nt) / 2; ++c) {  // 32 elements: two tiles
        const __m512i v0 = j < len ? _mm512_loadu_si512(vrow[j] + 32 * c) : _mm512_setzero_si512();
        const __m512i v1 = j + 1 < len ? _mm512_loadu_si512(vrow[j + 1] + 32 * c) : _mm512_setzero_si512();
        _mm512_storeu_si512(row + (2 * c - t0) * 256, _mm512_permutex2var_epi16(v0, lo, v1));
        _mm512_storeu_si512(row + (2 * c + 1 - t0) * 256, _mm512_permutex2var_epi16(v0, hi, v1));
      }
    }
  };
  // several row groups share the staged values; one stages each step as it goes (in L1)
  if (groups > 1) {
    vt.resize((ls / 32) * dtiles * 256);
    for (int64_t ks = 0; ks < ls / 32; ++ks) stage(ks, 0, dtiles, vt.data() + ks * dtiles * 256);
  } else {
    vt.resize(4 * 256);
  }
  alignas(64) float acc[16][64];
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = g * 16, nr = std::min<int64_t>(16, rows - r0);
    const int64_t lg = (glen[g] + 31) / 32 * 32;
    pb.resize(16 * std::max<int64_t>(lg, 32));
    probabilities(g, lg, pb.data());
    for (int64_t t0 = 0; t0 < dtiles; t0 += 4) {  // up to 4 accumulator tiles (64 elements) at a time
      const int64_t nt = std::min<int64_t>(4, dtiles - t0);
      px_tile_zero(0);
      px_tile_zero(1);
      px_tile_zero(2);
      px_tile_zero(3);
      for (int64_t k0 = 0; k0 < glen[g]; k0 += 32) {
        px_tile_loadd(4, pb.data() + k0, lg * 2);
        const uint32_t* b = vt.data() + ((k0 / 32) * dtiles + t0) * 256;
        if (groups == 1) {
          stage(k0 / 32, t0, nt, vt.data());
          b = vt.data();
        }
        px_tile_loadd(5, b, 64);
        px_tile_dpbf16ps(0, 4, 5);
        if (nt > 1) {
          px_tile_loadd(5, b + 256, 64);
          px_tile_dpbf16ps(1, 4, 5);
        }
        if (nt > 2) {
          px_tile_loadd(5, b + 512, 64);
          px_tile_dpbf16ps(2, 4, 5);
        }
        if (nt > 3) {
          px_tile_loadd(5, b + 768, 64);
          px_tile_dpbf16ps(3, 4, 5);
        }
      }
      px_tile_stored(0, &acc[0][0], 256);
      px_tile_stored(1, &acc[0][16], 256);
      px_tile_stored(2, &acc[0][32], 256);
      px_tile_stored(3, &acc[0][48], 256);
      for (int64_t i = 0; i < nr; ++i) {  // the softmax's normalisation
        const __m512 vi = _mm512_set1_ps(inv[r0 + i]);
        for (int64_t d = 0; d < 16 * nt; d += 16) _mm512_store_ps(acc[i] + d, _mm512_mul_ps(_mm512_load_ps(acc[i] + d), vi));
        from_float(acc[i], orow[r0 + i] + 16 * t0, 16 * nt);
      }
    }
  }
}

#else
constexpr bool kAmxAttention = false;
template <typename O>
void decode_task_amx(const c10::BFloat16* const*, const c10::BFloat16* const*, const c10::BFloat16* const*,
                     const int64_t*, int64_t, int64_t, int64_t, float, O* const*) {}
#endif

// Whether this build has a register-tiled bf16 task (AVX512-BF16, or AVX2 + FMA).
#if (defined(__AVX512BF16__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kTiledBf16 = true;
#else
constexpr bool kTiledBf16 = false;
#endif

// Query tokens per task in a long query grid (a prefill chunk). Splitting a sequence's queries into
// blocks lets both threads work on one long prompt (a task per (sequence, KV head) left SmolLM2's 3
// KV heads to 2 threads as 2 + 1) and keeps a task's fp32 score rows (rows x keys) near the core's
// cache. Each query row's sums do not depend on the block it is in (batch-invariant as before).
constexpr int64_t kQueryBlock = 32;

template <typename T, typename O>
void decode_attention_impl(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_table,
                           const int64_t* visible, O* out, int64_t num_seqs, int64_t qlen, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t table_width, int64_t num_blocks,
                           int64_t block_size, float scale, bool amx) {
  constexpr bool bf16_dot = kBf16Dot && std::is_same_v<T, c10::BFloat16>;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_len = table_width * block_size;
  // A task: one query block of one sequence against one KV head (rows = its queries x the heads
  // that share the KV head). Tasks are handed out from a shared counter, the last query blocks
  // (the most keys under a causal mask) first, so the threads finish together.
  const int64_t qb = std::min<int64_t>(qlen, kQueryBlock);
  const int64_t num_qblocks = (qlen + qb - 1) / qb;
  const int64_t pairs = num_seqs * num_kv_heads;
  const int64_t num_tasks = pairs * num_qblocks;
  const int64_t max_rows = qb * group;
  // bf16 with head_dim 32 / 64 / 96 / 128: the register-tiled task (decode_task_bf16)
  const int64_t nv = head_dim / 16;
  const bool tiled = kTiledBf16 && std::is_same_v<T, c10::BFloat16> && head_dim % 32 == 0 && nv >= 2 && nv <= 8;
  amx = amx && kAmxAttention && tiled;  // the AMX task serves the tiled task's head sizes (32 .. 128)
  std::atomic<int64_t> next_task{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    if (amx) configure_amx_tiles({16, 16, 16, 16, 16, 16, 16, 0});  // tmm0-6, 16 x 64 bytes each
    std::vector<float> qf(max_rows * head_dim), acc(max_rows * head_dim), kv(head_dim), scores;
    std::vector<const T*> qrow(max_rows), krow, vrow;
    std::vector<O*> orow(max_rows);
    std::vector<int64_t> limit(max_rows);
    for (int64_t task; (task = next_task.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
      const int64_t pair = task % pairs, q0 = (num_qblocks - 1 - task / pairs) * qb;
      const int64_t s = pair / num_kv_heads, h = pair % num_kv_heads;
      const int64_t rows = std::min<int64_t>(qb, qlen - q0) * group;
      int64_t len = 0;
      for (int64_t r = 0; r < rows; ++r) {
        limit[r] = std::min<int64_t>(std::max<int64_t>(visible[s * qlen + q0 + r / group], 0), max_len);
        len = std::max(len, limit[r]);
      }
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (tiled) {
          const int64_t* table = block_table + s * table_width;
          krow.resize(len);
          vrow.resize(len);
          for (int64_t l = 0; l < len; ++l) {
            const int64_t slot = (h * num_blocks + table[l / block_size]) * block_size + l % block_size;
            krow[l] = k_cache + slot * head_dim;
            vrow[l] = v_cache + slot * head_dim;
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t qi = q0 + r / group, head = h * group + r % group;
            qrow[r] = q + ((s * qlen + qi) * num_heads + head) * head_dim;
            orow[r] = out + ((s * qlen + qi) * num_heads + head) * head_dim;
          }
          if (amx) {
            decode_task_amx<O>(qrow.data(), krow.data(), vrow.data(), limit.data(), rows, len, head_dim, scale,
                               orow.data());
            continue;
          }
          scores.resize(rows * std::max<int64_t>(len, 1));
          using Task = void (*)(const T* const*, const T* const*, const T* const*, const int64_t*, int64_t,
                                int64_t, float, float*, O* const*);
          static constexpr Task tasks[] = {nullptr, nullptr, decode_task_bf16<2, O>, nullptr, decode_task_bf16<4, O>,
                                           nullptr, decode_task_bf16<6, O>, nullptr, decode_task_bf16<8, O>};
          tasks[nv](qrow.data(), krow.data(), vrow.data(), limit.data(), rows, len, scale, scores.data(),
                    orow.data());
          continue;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t qi = q0 + r / group, head = h * group + r % group;
        qrow[r] = q + ((s * qlen + qi) * num_heads + head) * head_dim;
        if (!bf16_dot) to_float(qrow[r], qf.data() + r * head_dim, head_dim);
      }
      scores.assign(rows * std::max<int64_t>(len, 1), 0.f);
      const int64_t* table = block_table + s * table_width;
      const int64_t head_base = h * num_blocks;
      // scores[r, l] = scale * q_r . k_l for the keys query r may see
      for (int64_t l = 0; l < len; ++l) {
        const int64_t slot = (head_base + table[l / block_size]) * block_size + l % block_size;
        const T* krow = k_cache + slot * head_dim;
        if constexpr (bf16_dot) {
          for (int64_t r = 0; r < rows; ++r)
            if (l < limit[r]) scores[r * len + l] = scale * dot_bf16(qrow[r], krow, head_dim);
        } else {
          to_float(krow, kv.data(), head_dim);
          for (int64_t r = 0; r < rows; ++r)
            if (l < limit[r]) scores[r * len + l] = scale * dot(qf.data() + r * head_dim, kv.data(), head_dim);
        }
      }
      // softmax over each row's visible keys
      for (int64_t r = 0; r < rows; ++r) softmax_row(scores.data() + r * len, limit[r]);
      // out_r = sum_l p[r, l] * v_l (in key order)
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < len; ++l) {
        const int64_t slot = (head_base + table[l / block_size]) * block_size + l % block_size;
        if constexpr (bf16_dot) {
          for (int64_t r = 0; r < rows; ++r)
            if (l < limit[r]) axpy_bf16(acc.data() + r * head_dim, scores[r * len + l], v_cache + slot * head_dim, head_dim);
          continue;
        }
        to_float(v_cache + slot * head_dim, kv.data(), head_dim);
        for (int64_t r = 0; r < rows; ++r) {
          if (l >= limit[r]) continue;
          const float p = scores[r * len + l];
          float* a = acc.data() + r * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * kv[d];
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t qi = q0 + r / group, head = h * group + r % group;
        from_float(acc.data() + r * head_dim, out + ((s * qlen + qi) * num_heads + head) * head_dim, head_dim);
      }
    }
    if (amx) release_amx_tiles();
  });
}

}  // namespace

// q [S, Q, H, D]; kv_cache [2, KVH, NB, BS, D]; block_table [S, W] int64; visible [S, Q] int64
// (keys 0 .. visible-1 are attended); returns [S, Q, H, D].
namespace {

// float_out: a bf16 query grid's result in float32, before its one rounding to bf16 (the float32
// variant below, which tests use to see every bit of the kernel's summation order).
at::Tensor run_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table, at::Tensor visible,
                         double scale, bool float_out, int64_t isa) {
  TORCH_CHECK(isa != kGemmAmx || amx_tiles_granted(),
              "decode_attention: path 3 (AMX) is not in this build or not granted by the OS");
  TORCH_CHECK(q.dim() == 4 && kv_cache.dim() == 5, "decode_attention: q must be [S, Q, H, D], kv_cache 5-D");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "decode_attention: q and kv_cache dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && visible.scalar_type() == at::kLong,
              "decode_attention: block_table and visible must be int64");
  TORCH_CHECK(q.size(2) % kv_cache.size(1) == 0, "decode_attention: heads not a multiple of KV heads");
  TORCH_CHECK(q.size(3) == kv_cache.size(4), "decode_attention: head_dim mismatch");
  TORCH_CHECK(block_table.size(0) == q.size(0) && visible.size(0) == q.size(0) && visible.size(1) == q.size(1),
              "decode_attention: batch sizes disagree");
  TORCH_CHECK(kv_cache.is_contiguous(), "decode_attention: kv_cache must be contiguous (it is read in place)");
  q = q.contiguous();
  block_table = block_table.contiguous();
  visible = visible.contiguous();
  auto out = float_out ? at::empty(q.sizes(), q.options().dtype(at::kFloat)) : at::empty_like(q);
  const int64_t S = q.size(0), Q = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t KVH = kv_cache.size(1), NB = kv_cache.size(2), BS = kv_cache.size(3);
  {  // the kernel reads the cache through the table: an id out of range would read out of bounds
    const int64_t* t = block_table.data_ptr<int64_t>();
    for (int64_t i = 0; i < block_table.numel(); ++i)
      TORCH_CHECK(t[i] >= 0 && t[i] < NB, "decode_attention: block id ", t[i], " outside the cache's ", NB, " blocks");
  }
  const int64_t plane = KVH * NB * BS * D;  // keys, then values
  if (q.scalar_type() == at::kBFloat16) {
    const auto* base = kv_cache.data_ptr<c10::BFloat16>();
    if (float_out)
      decode_attention_impl<c10::BFloat16, float>(q.data_ptr<c10::BFloat16>(), base, base + plane,
                                                  block_table.data_ptr<int64_t>(), visible.data_ptr<int64_t>(),
                                                  out.data_ptr<float>(), S, Q, H, KVH, D, block_table.size(1), NB,
                                                  BS, static_cast<float>(scale), isa == kGemmAmx);
    else
      decode_attention_impl<c10::BFloat16, c10::BFloat16>(
          q.data_ptr<c10::BFloat16>(), base, base + plane, block_table.data_ptr<int64_t>(),
          visible.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), S, Q, H, KVH, D, block_table.size(1), NB, BS,
          static_cast<float>(scale), isa == kGemmAmx);
  } else if (q.scalar_type() == at::kFloat) {
    const auto* base = kv_cache.data_ptr<float>();
    decode_attention_impl<float, float>(q.data_ptr<float>(), base, base + plane, block_table.data_ptr<int64_t>(),
                                 visible.data_ptr<int64_t>(), out.data_ptr<float>(), S, Q, H, KVH, D,
                                 block_table.size(1), NB, BS, static_cast<float>(scale), false);
  } else {
    TORCH_CHECK(false, "decode_attention: dtype must be bfloat16 or float32, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

at::Tensor decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table, at::Tensor visible,
                            double scale, int64_t isa) {
  return run_attention(q, kv_cache, block_table, visible, scale, false, isa);
}

at::Tensor decode_attention_f32(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table, at::Tensor visible,
                                double scale, int64_t isa) {
  return run_attention(q, kv_cache, block_table, visible, scale, true, isa);
}

}  // namespace phalanx
