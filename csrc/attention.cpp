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
template <int NV>
void decode_task_bf16(const c10::BFloat16* const* qrow, const c10::BFloat16* const* krow,
                      const c10::BFloat16* const* vrow, const int64_t* limit, int64_t rows, int64_t len,
                      float scale, float* scores, c10::BFloat16* const* orow) {
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

#else
template <int NV>
void decode_task_bf16(const c10::BFloat16* const*, const c10::BFloat16* const*, const c10::BFloat16* const*,
                      const int64_t*, int64_t, int64_t, float, float*, c10::BFloat16* const*) {}
#endif

// Query tokens per task in a long query grid (a prefill chunk). Splitting a sequence's queries into
// blocks lets both threads work on one long prompt (a task per (sequence, KV head) left SmolLM2's 3
// KV heads to 2 threads as 2 + 1) and keeps a task's fp32 score rows (rows x keys) near the core's
// cache. Each query row's sums do not depend on the block it is in (batch-invariant as before).
constexpr int64_t kQueryBlock = 32;

template <typename T>
void decode_attention_impl(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_table,
                           const int64_t* visible, T* out, int64_t num_seqs, int64_t qlen, int64_t num_heads,
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
  const bool tiled = bf16_dot && head_dim % 32 == 0 && nv >= 2 && nv <= 8;
  std::atomic<int64_t> next_task{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(max_rows * head_dim), acc(max_rows * head_dim), kv(head_dim), scores;
    std::vector<const T*> qrow(max_rows), krow, vrow;
    std::vector<T*> orow(max_rows);
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
                                int64_t, float, float*, T* const*);
          static constexpr Task tasks[] = {nullptr, nullptr, decode_task_bf16<2>, nullptr, decode_task_bf16<4>,
                                           nullptr, decode_task_bf16<6>, nullptr, decode_task_bf16<8>};
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
at::Tensor decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table,
                               at::Tensor visible, double scale) {
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
  auto out = at::empty_like(q);
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
    decode_attention_impl<c10::BFloat16>(q.data_ptr<c10::BFloat16>(), base, base + plane,
                                         block_table.data_ptr<int64_t>(), visible.data_ptr<int64_t>(),
                                         out.data_ptr<c10::BFloat16>(), S, Q, H, KVH, D, block_table.size(1), NB,
                                         BS, static_cast<float>(scale));
  } else if (q.scalar_type() == at::kFloat) {
    const auto* base = kv_cache.data_ptr<float>();
    decode_attention_impl<float>(q.data_ptr<float>(), base, base + plane, block_table.data_ptr<int64_t>(),
                                 visible.data_ptr<int64_t>(), out.data_ptr<float>(), S, Q, H, KVH, D,
                                 block_table.size(1), NB, BS, static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "decode_attention: dtype must be bfloat16 or float32, got ", q.scalar_type());
  }
  return out;
}

}  // namespace phalanx
