// Paged attention over a [S, Q] query grid, keys and values read in place from the paged cache
// through the block table (ops.cpu's `decode_attention`; the decode group and each prefill chunk).
// Each query's result depends only on its own query, keys and values: every sum runs in one fixed
// order, whatever the batch or the number of query tokens around it (batch-invariant).
#include <ATen/ops/empty_like.h>

#include <atomic>

#include "common.h"
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
                           int64_t block_size, float scale) {
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
  std::atomic<int64_t> next_task{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
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
  });
}

}  // namespace

// q [S, Q, H, D]; kv_cache [2, KVH, NB, BS, D]; block_table [S, W] int64; visible [S, Q] int64
// (keys 0 .. visible-1 are attended); returns [S, Q, H, D].
namespace {

// float_out: a bf16 query grid's result in float32, before its one rounding to bf16 (the float32
// variant below, which tests use to see every bit of the kernel's summation order).
at::Tensor run_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table, at::Tensor visible,
                         double scale, bool float_out) {
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
                                                  BS, static_cast<float>(scale));
    else
      decode_attention_impl<c10::BFloat16, c10::BFloat16>(
          q.data_ptr<c10::BFloat16>(), base, base + plane, block_table.data_ptr<int64_t>(),
          visible.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), S, Q, H, KVH, D, block_table.size(1), NB, BS,
          static_cast<float>(scale));
  } else if (q.scalar_type() == at::kFloat) {
    const auto* base = kv_cache.data_ptr<float>();
    decode_attention_impl<float, float>(q.data_ptr<float>(), base, base + plane, block_table.data_ptr<int64_t>(),
                                 visible.data_ptr<int64_t>(), out.data_ptr<float>(), S, Q, H, KVH, D,
                                 block_table.size(1), NB, BS, static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "decode_attention: dtype must be bfloat16 or float32, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

at::Tensor decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table, at::Tensor visible,
                            double scale) {
  return run_attention(q, kv_cache, block_table, visible, scale, false);
}

at::Tensor decode_attention_f32(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table, at::Tensor visible,
                                double scale) {
  return run_attention(q, kv_cache, block_table, visible, scale, true);
}

}  // namespace phalanx
