"""Fused C++ kernels for the CPU hot path, built on first use (JIT) and optional.

Owns: the kernel source, building / loading it (`load`), the backend choice (``PHALANX_KERNELS``),
`decode_attention` (the paged attention's decode group and prefill chunks), `cache_write` (a layer's
new keys and values into the paged cache, one call), `argmax` (greedy tokens from the logits),
`pack_pairs` / `pair_linear` (few-row bf16 linears, used by ``layers.linear.PackedLinear``),
`fused_layer` (a whole decoder layer in one call, used by ``models.llama.DecoderLayer``),
`eagle_chain` / `model_chain` (a step's k drafting passes in one call, used by the EAGLE heads and
``models.llama.CausalLM`` as a draft model) and `attach` (hands the module to the layers that use
the elementwise ops: RMSNorm, residual add + RMSNorm, rotary, SiLU-and-multiply).
Does not own: the reference implementations (``attention.torch_paged``, ``layers.*``), which every
result of these kernels is tested against and which serve whenever the kernels are off.

Why. In eager PyTorch every small op costs a fixed ~5-30 us on this CPU, and a decoder layer is
~40 of them: at batch 1 those fixed costs, not arithmetic, are most of a step. The reference decode
attention gathers every request's K/V blocks into a contiguous copy per layer and runs two bf16
batched matmuls, a mask and a softmax (profiles of the c = 16 serving workload put that path on par
with all the linear layers together); `torch.rms_norm` on CPU is ~8 ops (plus the residual add before
it), rotary ~6. The kernels do each of those in one call. The SiLU-and-multiply of the
gated MLP is one vectorised pass (the earlier scalar attempt lost to PyTorch's two vectorised ops;
this one is ~10-20 % faster than them and equal to the last bit on every tested input), and
`argmax` over the logits reads bf16 in place (torch's last-dim argmax is scalar here: 957 -> 138 us
for 32 x 32000).

decode_attention reads the keys and values straight from the paged cache through the block table,
once per (request, KV head) for all of its query heads and query tokens, with AVX512-BF16 dot
products (bf16 with head_dim 32-128: 16 keys per step and one transpose-and-add tree for their 16
sums, then the values streamed past register-held accumulators of up to 4 query rows; 2-2.6x
faster than one horizontal reduction and one accumulator round trip per key), float32 scores,
softmax and accumulation, the output rounded once (the reference rounds
scores and probabilities to the activation dtype in between). Each query's result depends only on
its own query, keys and values, never on the batch or on how many query tokens its request has
(every reduction runs in a fixed order): the kernel is batch-invariant. bf16 and float32.

The elementwise ops are bf16 only (the fast path; float32 models stay on the reference ops, whose
numerics the Hugging Face parity tests pin) and round exactly where the PyTorch ops they replace
round (norm: float32 normalisation, round, times the bf16 weight, round; add: one rounding; rotary:
both products, then the sum), so they agree with the reference to the last bit (rotary, the add)
or except where the float32 reduction order flips a rounding (the norm, one bf16 ulp, rarely).

Backends (``PHALANX_KERNELS``): ``auto`` (default) uses the kernels when they build (a C++
compiler and ninja, both present after ``make install``) and falls back to the reference with one
warning otherwise; ``torch`` always uses the reference; ``cpp`` requires the kernels (an error if
they cannot be built). `main` builds them ahead of time (``make install`` runs it), so the first
server start does not pay the ~30 s compile; the build is cached in ``PHALANX_KERNEL_CACHE``
(default ``~/.cache/phalanx/kernels``). The choice for the elementwise ops is made once, when a
model is loaded (`attach`); the decode attention checks it per forward.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "cpp")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;

// bf16 <-> float32 on uint16 bit patterns, written so loops over them vectorise (c10::BFloat16's
// conversions are not inlined into vector code): bf16 -> float is a shift, float -> bf16 rounds to
// nearest even exactly as c10 does (NaN -> canonical NaN).
inline float bits_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(float));
  return f;
}

inline uint16_t float_to_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(float));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

inline float round_bf16(float x) { return bits_to_float(float_to_bits(x)); }

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(s[i]);
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_bits(src[i]);
}

// Dot product with a fixed summation order (kLanes partial sums, then lane 0..kLanes-1).
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += a[d + j] * b[d + j];
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += lanes[j];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

#if defined(__AVX512F__)
inline __m512 load16_ps(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_ps(const c10::BFloat16* p) {  // 16 bf16 -> 16 float32 (exact)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16Dot = true;
// bf16 x bf16 dot product with float32 accumulation (AVX512-BF16 pairs), fixed order.
inline float dot_bf16(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= n; d += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
  if (d < n) {
    const __mmask32 m = static_cast<__mmask32>((1ull << (n - d)) - 1);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, a + d),
                           (__m512bh)_mm512_maskz_loadu_epi16(m, b + d));
  }
  return _mm512_reduce_add_ps(acc);
}

// acc[0:n] += p * v[0:n], v in bf16 (widened to float32 in registers).
inline void axpy_bf16(float* acc, float p, const c10::BFloat16* v, int64_t n) {
  const __m512 pv = _mm512_set1_ps(p);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 vf = load16_ps(v + d);
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, vf, _mm512_loadu_ps(acc + d)));
  }
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(v);
  for (; d < n; ++d) acc[d] = std::fma(p, bits_to_float(bits[d]), acc[d]);
}

// Lane j of the result = the sum of v[j]'s 16 lanes (a fixed transpose-and-add tree: 15 adds and
// 14 shuffles for 16 sums, against 16 full horizontal reductions).
inline __m512 reduce16(const __m512* v) {
  __m512 s1[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 s2[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's partial sums of four vectors
    const __m512d a = _mm512_castps_pd(s1[2 * i]), b = _mm512_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // across the four 128-bit lanes: 0x88 picks lanes (0, 2), 0xDD lanes (1, 3) of each operand
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88), _mm512_shuffle_f32x4(s2[0], s2[1], 0xDD));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], 0x88), _mm512_shuffle_f32x4(s2[2], s2[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u, w, 0x88), _mm512_shuffle_f32x4(u, w, 0xDD));
}

#else
constexpr bool kBf16Dot = false;
inline float dot_bf16(const c10::BFloat16*, const c10::BFloat16*, int64_t) { return 0.f; }
inline void axpy_bf16(float*, float, const c10::BFloat16*, int64_t) {}
#endif

// exp for x <= 0 (softmax after subtracting the row maximum): Cephes' float polynomial, ~1 ulp,
// plain arithmetic so the loops over keys vectorise (std::exp does not).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return y * scale;
}

#if defined(__AVX512F__)
// Cephes' exp polynomial (exp_nonpositive's operations) on 16 lanes, for x in [-87, 88].
inline __m512 exp_core_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, r), r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

inline __m512 exp_nonpositive_ps(__m512 x) {  // exp_nonpositive, 16 lanes, the same operations
  return exp_core_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)));
}

// exp(x) for any float32 x: the same polynomial on [-87, 88], +inf above ~88.72.
inline __m512 exp_ps(__m512 x) {
  const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.7228f), _CMP_GT_OQ);
  const __m512 y = exp_core_ps(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)));
  return _mm512_mask_mov_ps(y, over, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// In-place softmax of row[0:n] (float32, fixed order): max, exp(x - max), sum, scale.
inline void softmax_row(float* row, int64_t n) {
  if (n <= 0) return;
  int64_t l = 0;
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (; l + 16 <= n; l += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + l));
  float m = _mm512_reduce_max_ps(vmax);
  for (; l < n; ++l) m = std::max(m, row[l]);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (l = 0; l + 16 <= n; l += 16) {
    const __m512 e = exp_nonpositive_ps(_mm512_sub_ps(_mm512_loadu_ps(row + l), vm));
    _mm512_storeu_ps(row + l, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (; l < n; ++l) {
    row[l] = exp_nonpositive(row[l] - m);
    sum += row[l];
  }
  const float inv = 1.f / sum;
  for (l = 0; l < n; ++l) row[l] *= inv;
}
#else
inline void softmax_row(float* row, int64_t n) {
  if (n <= 0) return;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < n; ++l) m = std::max(m, row[l]);
  float sum = 0.f;
  for (int64_t l = 0; l < n; ++l) {
    row[l] = exp_nonpositive(row[l] - m);
    sum += row[l];
  }
  const float inv = 1.f / sum;
  for (int64_t l = 0; l < n; ++l) row[l] *= inv;
}
#endif

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

template <typename T>
void decode_attention_impl(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_table,
                           const int64_t* visible, T* out, int64_t num_seqs, int64_t qlen, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t table_width, int64_t num_blocks,
                           int64_t block_size, float scale) {
  constexpr bool bf16_dot = kBf16Dot && std::is_same_v<T, c10::BFloat16>;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows = qlen * group;  // query vectors that share one KV head of one sequence
  const int64_t max_len = table_width * block_size;
  // bf16 with head_dim 32 / 64 / 96 / 128: the register-tiled task (decode_task_bf16)
  const int64_t nv = head_dim / 16;
  const bool tiled = bf16_dot && head_dim % 32 == 0 && nv >= 2 && nv <= 8;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * head_dim), acc(rows * head_dim), kv(head_dim), scores;
    std::vector<const T*> qrow(rows), krow, vrow;
    std::vector<T*> orow(rows);
    std::vector<int64_t> limit(rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
      int64_t len = 0;
      for (int64_t r = 0; r < rows; ++r) {
        limit[r] = std::min<int64_t>(std::max<int64_t>(visible[s * qlen + r / group], 0), max_len);
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
            const int64_t qi = r / group, head = h * group + r % group;
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
        const int64_t qi = r / group, head = h * group + r % group;
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
        const int64_t qi = r / group, head = h * group + r % group;
        from_float(acc.data() + r * head_dim, out + ((s * qlen + qi) * num_heads + head) * head_dim, head_dim);
      }
    }
  });
}

}  // namespace

// ---- elementwise ops of a decoder layer, bf16 only, same rounding steps as the PyTorch ops --------

inline const uint16_t* u16(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
inline uint16_t* u16_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// 1 / sqrt(mean(x^2) + eps) over one row, float32, fixed order.
inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
}

void check_bf16_rows(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, op, ": expects bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, op, ": the last dimension must be contiguous");
}

// norm(x) = weight * bf16(x / rms(x)) (Hugging Face's Llama RMSNorm: float32 normalisation, rounded
// to bf16, then the bf16 weight); with `residual`, x is first replaced by bf16(x + residual), which
// is also returned (the residual stream for the rest of the layer).
std::vector<torch::Tensor> rms_norm_impl(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                         double eps) {
  check_bf16_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be bfloat16 [", x.size(-1), "]");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  auto out = torch::empty_like(x);
  torch::Tensor sum, res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == torch::kBFloat16,
                "add_rms_norm: residual must match x");
    res = residual->contiguous();
    sum = torch::empty_like(x);
  }
  const uint16_t* xp = u16(x);
  const uint16_t* wp = u16(weight);
  const uint16_t* rp = res.defined() ? u16(res) : nullptr;
  uint16_t* op = u16_mut(out);
  uint16_t* sp = sum.defined() ? u16_mut(sum) : nullptr;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = r * n;
      if (rp) {
        for (int64_t d = 0; d < n; ++d) {
          const uint16_t b = float_to_bits(bits_to_float(xp[base + d]) + bits_to_float(rp[base + d]));
          sp[base + d] = b;
          row[d] = bits_to_float(b);
        }
      } else {
        for (int64_t d = 0; d < n; ++d) row[d] = bits_to_float(xp[base + d]);
      }
      const float inv = inv_rms(row.data(), n, e);
      for (int64_t d = 0; d < n; ++d) op[base + d] = float_to_bits(bits_to_float(wp[d]) * round_bf16(row[d] * inv));
    }
  });
  if (sp) return {out, sum};
  return {out};
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  return rms_norm_impl(x, c10::nullopt, weight, eps)[0];
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  return rms_norm_impl(x, residual, weight, eps);
}

// Rotate-half rotary on x [T, N, D] (any row / head strides, last dim contiguous) with cos / sin
// rows [T, 1, D] (bf16): bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), as the PyTorch ops round.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_bf16_rows(x, "rotary");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "rotary: x must be [T, N, D] with even D");
  TORCH_CHECK(cos.scalar_type() == torch::kBFloat16 && sin.scalar_type() == torch::kBFloat16 &&
                  cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel(),
              "rotary: cos / sin must be bfloat16 [T, 1, D]");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = x.size(0), N = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sn = x.stride(1);
  auto out = torch::empty({T, N, D}, x.options());
  const uint16_t* xp = u16(x);
  const uint16_t* cp = u16(cos);
  const uint16_t* sp = u16(sin);
  uint16_t* op = u16_mut(out);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* c = cp + t * D;
      const uint16_t* s = sp + t * D;
      for (int64_t h = 0; h < N; ++h) {
        const uint16_t* row = xp + t * st + h * sn;
        uint16_t* dst = op + (t * N + h) * D;
        for (int64_t d = 0; d < half; ++d) {  // rotate_half(x)[d] = -x[d + half]
          const float a = round_bf16(bits_to_float(row[d]) * bits_to_float(c[d]));
          const float b = round_bf16(-bits_to_float(row[d + half]) * bits_to_float(s[d]));
          dst[d] = float_to_bits(a + b);
        }
        for (int64_t d = half; d < D; ++d) {  // rotate_half(x)[d] = x[d - half]
          const float a = round_bf16(bits_to_float(row[d]) * bits_to_float(c[d]));
          const float b = round_bf16(bits_to_float(row[d - half]) * bits_to_float(s[d]));
          dst[d] = float_to_bits(a + b);
        }
      }
    }
  });
  return out;
}

#if defined(__AVX512F__)
// float32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0: float_to_bits on 16 lanes.
inline __m256i float_to_bits_ps(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

#endif

// silu(gate) * up for a gated MLP: x [T, 2I] (bf16, last dim contiguous) holds gate | up per row;
// returns bf16(bf16(g / (1 + exp(-g))) * u) [T, I], rounded where F.silu(gate) * up rounds.
torch::Tensor silu_mul(torch::Tensor x) {
  check_bf16_rows(x, "silu_mul");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul: x must be [T, 2 * I]");
  x = x.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const uint16_t* xp = u16(x);
  uint16_t* op = u16_mut(out);
  auto scalar = [](uint16_t g, uint16_t u) {
    const float gf = bits_to_float(g);
    return float_to_bits(round_bf16(gf / (1.f + std::exp(-gf))) * bits_to_float(u));
  };
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* g = xp + t * 2 * I;
      const uint16_t* u = g + I;
      uint16_t* o = op + t * I;
      int64_t d = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; d + 16 <= I; d += 16) {
        const __m512 gf = load16_ps(reinterpret_cast<const c10::BFloat16*>(g + d));
        const __m512 uf = load16_ps(reinterpret_cast<const c10::BFloat16*>(u + d));
        const __m512 silu = _mm512_div_ps(gf, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gf))));
#if defined(__AVX512BF16__)
        const __m256i s = (__m256i)_mm512_cvtneps_pbh(silu);
#else
        const __m256i s = float_to_bits_ps(silu);
#endif
        const __m512 sf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s), 16));
#if defined(__AVX512BF16__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sf, uf)));
#else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), float_to_bits_ps(_mm512_mul_ps(sf, uf)));
#endif
      }
#endif
      for (; d < I; ++d) o[d] = scalar(g[d], u[d]);
    }
  });
  return out;
}

// Row-wise argmax of x [N, V] (bf16 or float32, last dim contiguous) -> int64 [N]: the first index
// of the row's maximum, a NaN counting as the maximum (torch.argmax's answer, read in place: no
// float32 copy of bf16 logits, and vectorised where torch's reduction over the last dim is not).
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  auto value = [&](int64_t i) { return static_cast<float>(x[i]); };
  int64_t i = 0, best_i = 0;
  float best = n > 0 ? value(0) : 0.f;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vbest = load16_ps(x);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i vidx = idx;
    __mmask16 nan = _mm512_cmp_ps_mask(vbest, vbest, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = load16_ps(x + i);
      idx = _mm512_add_epi32(idx, step);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);  // strict: a lane keeps its first max
      vbest = _mm512_mask_mov_ps(vbest, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
    }
    if (nan) {
      for (int64_t j = 0; j < n; ++j)
        if (value(j) != value(j)) return j;
    }
    alignas(64) float vals[16];
    alignas(64) int32_t where[16];
    _mm512_store_ps(vals, vbest);
    _mm512_store_si512(where, vidx);
    best = vals[0];
    best_i = where[0];
    for (int j = 1; j < 16; ++j)
      if (vals[j] > best || (vals[j] == best && where[j] < best_i)) {
        best = vals[j];
        best_i = where[j];
      }
  }
#endif
  for (; i < n; ++i) {
    const float v = value(i);
    if (v != v) {  // the first NaN is the answer (every earlier one was seen by the vector loop)
      return i;
    }
    if (v > best || (i == 0)) {
      best = v;
      best_i = i;
    }
  }
  return best_i;
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [N, V] with V > 0");
  x = x.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  auto out = torch::empty({N}, x.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  if (x.scalar_type() == torch::kBFloat16) {
    const auto* xp = x.data_ptr<c10::BFloat16>();
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) { for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * V, V); });
  } else if (x.scalar_type() == torch::kFloat32) {
    const auto* xp = x.data_ptr<float>();
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) { for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * V, V); });
  } else {
    TORCH_CHECK(false, "argmax_rows: dtype must be bfloat16 or float32, got ", x.scalar_type());
  }
  return out;
}

// ---- few-row bf16 linear: y = x W^T for x [M, K] with small M (decode and drafting) ---------------
// oneDNN's packed linear costs ~18 us per call at 1-4 rows whatever the size (its fixed overhead is
// most of a small layer's time). This one streams a copy of W packed in AVX512-BF16 pairs,
// [ceil(N / 16)][ceil(K / 2)][16 outputs][2], with one float32 accumulator per output lane, the k
// pairs in order within blocks of 512 (block sums added in order, as oneDNN's one-row kernel does)
// and one rounding at the end: bitwise oneDNN's result at one row, and at 2-4 rows when K <= 512
// (where oneDNN's multi-row order is the same); every row's result is the same whatever the row count.
// `pair_linear_module` checks the match on the running CPU before anything uses it.
torch::Tensor pack_pairs(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack_pairs: w must be a bfloat16 [N, K] matrix");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NB = (N + 15) / 16, KP = (K + 1) / 2;
  auto out = torch::zeros({NB, KP, 16, 2}, w.options());
  const uint16_t* wp = u16(w);
  uint16_t* op = u16_mut(out);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) op[(((n / 16) * KP + k / 2) * 16 + n % 16) * 2 + k % 2] = wp[n * K + k];
  return out;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kPairLinear = true;
// oneDNN sums K in blocks of 512 (256 pairs): each block from zero, then added to the running total.
constexpr int64_t kPairKBlock = 256;

// T blocks of 16 outputs for M rows: T * M independent accumulators hide the dot-product latency
// without splitting any output's sum.
template <int M, int T>
inline void pair_tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t KP, int64_t nb, uint16_t* y,
                      int64_t N) {
  __m512 acc[T][M], total[T][M];
  const uint16_t* wb = w + nb * KP * 32;
  const int64_t full = K / 2;
  for (int64_t k0 = 0; k0 < KP; k0 += kPairKBlock) {
    for (int t = 0; t < T; ++t)
      for (int m = 0; m < M; ++m) acc[t][m] = _mm512_setzero_ps();
    const int64_t k1 = std::min<int64_t>(KP, k0 + kPairKBlock);
    for (int64_t kp = k0; kp < k1; ++kp) {
      __m512bh xb[M];
      for (int m = 0; m < M; ++m) {
        uint32_t pair = x[m * K + 2 * kp];  // an odd K's last pair is (x, 0) against (w, 0)
        if (kp < full) std::memcpy(&pair, x + m * K + 2 * kp, 4);
        xb[m] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      }
      for (int t = 0; t < T; ++t) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + (t * KP + kp) * 32);
        for (int m = 0; m < M; ++m) acc[t][m] = _mm512_dpbf16_ps(acc[t][m], xb[m], wv);
      }
    }
    for (int t = 0; t < T; ++t)
      for (int m = 0; m < M; ++m) total[t][m] = k0 == 0 ? acc[t][m] : _mm512_add_ps(total[t][m], acc[t][m]);
  }
  for (int t = 0; t < T; ++t) {
    const int64_t n0 = (nb + t) * 16, cnt = std::min<int64_t>(16, N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1);
    for (int m = 0; m < M; ++m)
      _mm256_mask_storeu_epi16(y + m * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(total[t][m]));
  }
}

template <int M>
void pair_rows(const uint16_t* x, int64_t K, const uint16_t* w, int64_t KP, int64_t nb0, int64_t nb1, uint16_t* y,
               int64_t N) {
  constexpr int T = M == 1 ? 8 : 4;
  int64_t nb = nb0;
  for (; nb + T <= nb1; nb += T) pair_tile<M, T>(x, K, w, KP, nb, y, N);
  for (; nb < nb1; ++nb) pair_tile<M, 1>(x, K, w, KP, nb, y, N);
}
#else
constexpr bool kPairLinear = false;
#endif

bool pair_linear_supported() { return kPairLinear; }

torch::Tensor pair_linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  TORCH_CHECK(kPairLinear, "pair_linear: this build has no AVX512-BF16");
  check_bf16_rows(x, "pair_linear");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "pair_linear: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.size(1) == (x.size(1) + 1) / 2 &&
              packed.size(0) == (N + 15) / 16 && packed.scalar_type() == torch::kBFloat16,
              "pair_linear: packed must be pack_pairs of an [N, K] weight with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KP = packed.size(1);
  auto out = torch::empty({M, N}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const uint16_t* xp = u16(x);
  const uint16_t* wp = u16(packed);
  uint16_t* y = u16_mut(out);
  // chunks of 8 output blocks; a thread only for >= ~128 KB of weights
  const int64_t chunks = (NB + 7) / 8, grain = std::max<int64_t>(1, (int64_t{1} << 17) / (KP * 32 * 8));
  at::parallel_for(0, chunks, grain, [&](int64_t b, int64_t e) {
    const int64_t nb0 = b * 8, nb1 = std::min<int64_t>(NB, e * 8);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t rows = std::min<int64_t>(4, M - m0);
      const uint16_t* xm = xp + m0 * K;
      uint16_t* ym = y + m0 * N;
      if (rows == 4) pair_rows<4>(xm, K, wp, KP, nb0, nb1, ym, N);
      else if (rows == 3) pair_rows<3>(xm, K, wp, KP, nb0, nb1, ym, N);
      else if (rows == 2) pair_rows<2>(xm, K, wp, KP, nb0, nb1, ym, N);
      else pair_rows<1>(xm, K, wp, KP, nb0, nb1, ym, N);
    }
  });
#endif
  return out;
}

// Writes a layer's new keys and values into its paged cache: for token t < N (= slots.numel(); rows
// of k / v past N are lockstep padding and write nothing), cache[0, h, slot_t] = k[t, h] and
// cache[1, h, slot_t] = v[t, h] (slot = block * BS + offset). One call instead of two index_copy_.
void cache_write(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "cache_write: kv_cache must be a contiguous [2, KVH, NB, BS, D] tensor");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == kv_cache.size(1) && k.size(2) == kv_cache.size(4),
              "cache_write: k and v must be [T, KVH, D] matching the cache");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "cache_write: k, v and kv_cache dtypes differ");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "cache_write: the last dimension of k and v must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.size(0) <= k.size(0),
              "cache_write: slots must be int64 [N] with N <= T");
  slots = slots.contiguous();
  const int64_t N = slots.size(0), KVH = kv_cache.size(1), D = kv_cache.size(4);
  const int64_t cap = kv_cache.size(2) * kv_cache.size(3);  // slots per head
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < cap, "cache_write: slot ", sp[i], " outside the cache's ", cap, " slots");
  const int64_t bytes = D * kv_cache.element_size();
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = kv_cache.element_size();
  const int64_t plane = KVH * cap * bytes;  // keys, then values
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        char* dst = base + (h * cap + sp[t]) * bytes;
        std::memcpy(dst, kp + (t * k.stride(0) + h * k.stride(1)) * es, bytes);
        std::memcpy(dst + plane, vp + (t * v.stride(0) + h * v.stride(1)) * es, bytes);
      }
  });
}

// q [S, Q, H, D]; kv_cache [2, KVH, NB, BS, D]; block_table [S, W] int64; visible [S, Q] int64
// (keys 0 .. visible-1 are attended); returns [S, Q, H, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                               torch::Tensor visible, double scale) {
  TORCH_CHECK(q.dim() == 4 && kv_cache.dim() == 5, "decode_attention: q must be [S, Q, H, D], kv_cache 5-D");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "decode_attention: q and kv_cache dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && visible.scalar_type() == torch::kInt64,
              "decode_attention: block_table and visible must be int64");
  TORCH_CHECK(q.size(2) % kv_cache.size(1) == 0, "decode_attention: heads not a multiple of KV heads");
  TORCH_CHECK(q.size(3) == kv_cache.size(4), "decode_attention: head_dim mismatch");
  TORCH_CHECK(block_table.size(0) == q.size(0) && visible.size(0) == q.size(0) && visible.size(1) == q.size(1),
              "decode_attention: batch sizes disagree");
  TORCH_CHECK(kv_cache.is_contiguous(), "decode_attention: kv_cache must be contiguous (it is read in place)");
  q = q.contiguous();
  block_table = block_table.contiguous();
  visible = visible.contiguous();
  auto out = torch::empty_like(q);
  const int64_t S = q.size(0), Q = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t KVH = kv_cache.size(1), NB = kv_cache.size(2), BS = kv_cache.size(3);
  {  // the kernel reads the cache through the table: an id out of range would read out of bounds
    const int64_t* t = block_table.data_ptr<int64_t>();
    for (int64_t i = 0; i < block_table.numel(); ++i)
      TORCH_CHECK(t[i] >= 0 && t[i] < NB, "decode_attention: block id ", t[i], " outside the cache's ", NB, " blocks");
  }
  const int64_t plane = KVH * NB * BS * D;  // keys, then values
  if (q.scalar_type() == torch::kBFloat16) {
    const auto* base = kv_cache.data_ptr<c10::BFloat16>();
    decode_attention_impl<c10::BFloat16>(q.data_ptr<c10::BFloat16>(), base, base + plane,
                                         block_table.data_ptr<int64_t>(), visible.data_ptr<int64_t>(),
                                         out.data_ptr<c10::BFloat16>(), S, Q, H, KVH, D, block_table.size(1), NB,
                                         BS, static_cast<float>(scale));
  } else if (q.scalar_type() == torch::kFloat32) {
    const auto* base = kv_cache.data_ptr<float>();
    decode_attention_impl<float>(q.data_ptr<float>(), base, base + plane, block_table.data_ptr<int64_t>(),
                                 visible.data_ptr<int64_t>(), out.data_ptr<float>(), S, Q, H, KVH, D,
                                 block_table.size(1), NB, BS, static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "decode_attention: dtype must be bfloat16 or float32, got ", q.scalar_type());
  }
  return out;
}

// ---- one whole decoder layer in one call (any batch without lockstep padding) ----------------------
// Llama's layer as the module path runs it on the kernels above: the input norm (or none: an EAGLE-1
// head's first layer; with `residual`, the residual add fused into it), the qkv projection, rotary
// on queries and keys, the KV write, the paged attention grouped as the module path groups it (one
// [R, Q] grid for a uniform batch, else the decode group and each prefill chunk: `AttnPlan`,
// `attend`), o_proj, the add + post-attention norm, gate/up,
// SiLU-and-multiply, down. The same functions in the same order as the module path
// (``models.llama.DecoderLayer.forward_split``), so the result is bitwise the same; what it saves is
// the ~15 Python-level calls and ~10 dispatches per layer, which at a few rows cost more than the
// arithmetic. Returns (the MLP's output, the residual stream before it), as forward_split does.
// One linear of a fused layer: its oneDNN-packed weight (``layers.linear.PackedLinear.packed``), its
// bias (undefined: none) and its pair_linear copy (undefined: none), used as PackedLinear.forward
// does: pair_linear for up to `pair_rows` rows when the copy exists, oneDNN's packed linear otherwise.
struct Linear {
  torch::Tensor packed, bias, pairs;
  int64_t out_features;
};

// A linear from its three tensors as Python passes them (packed, bias, pairs; an empty tensor: none).
Linear make_linear(const torch::Tensor* t, int64_t out_features) {
  auto opt = [](const torch::Tensor& x) { return x.numel() ? x : torch::Tensor(); };
  return {t[0], opt(t[1]), opt(t[2]), out_features};
}

torch::Tensor onednn_linear(const torch::Tensor& x, const Linear& l) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, l.packed, l.bias.defined() ? c10::IValue(l.bias) : c10::IValue(), std::string("none"),
                          c10::List<c10::optional<at::Scalar>>(), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

torch::Tensor apply(const Linear& l, const torch::Tensor& x, int64_t pair_rows) {
  if (l.pairs.defined() && x.size(0) <= pair_rows && x.is_contiguous()) return pair_linear(x, l.pairs, l.out_features);
  return onednn_linear(x, l);
}

// Where a layer's queries attend, grouped as the module path groups them (``attention.torch_paged``):
// the decode group's [Bd, Qd] query grid over `dec_table` / `dec_visible` (undefined: none) — the flat
// batch itself when `dec_idx` is undefined, else gathered from flat rows `dec_idx` [Bd * Qd] (padded)
// with grid entries `dec_sel` landing on flat rows `dec_rows` — then each prefill chunk, flat rows
// [start, end) as a [1, q] grid over its own table and visible counts.
struct AttnPlan {
  torch::Tensor dec_table, dec_visible, dec_idx, dec_sel, dec_rows;
  std::vector<int64_t> pre_bounds;  // start, end of each prefill chunk
  std::vector<torch::Tensor> pre_tables, pre_visibles;
};

AttnPlan grid_plan(torch::Tensor block_table, torch::Tensor visible) { return {block_table, visible}; }

// q [T, H, D] (rotated) -> attention output [T, H * D]
torch::Tensor attend(const AttnPlan& a, const torch::Tensor& q, const torch::Tensor& kv_cache, double scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  if (!a.dec_idx.defined() && a.pre_tables.empty()) {  // the flat batch is one [R, Q] grid, rows in order
    TORCH_CHECK(a.dec_table.defined() && a.dec_visible.dim() == 2, "fused layer: no attention grid");
    const int64_t Q = a.dec_visible.size(1);
    TORCH_CHECK(Q > 0 && T % Q == 0, "fused layer: ", T, " tokens are not whole requests of ", Q);
    return decode_attention(q.reshape({T / Q, Q, H, D}), kv_cache, a.dec_table, a.dec_visible, scale).view({T, H * D});
  }
  auto out = torch::empty({T, H, D}, q.options());
  if (a.dec_table.defined()) {
    TORCH_CHECK(a.dec_idx.defined() && a.dec_sel.defined() && a.dec_rows.defined() && a.dec_visible.dim() == 2 &&
                    a.dec_idx.numel() == a.dec_visible.numel() && a.dec_sel.numel() == a.dec_rows.numel(),
                "fused layer: the decode group needs dec_idx [Bd * Qd], dec_sel and dec_rows of one length");
    const int64_t Bd = a.dec_visible.size(0), Qd = a.dec_visible.size(1);
    auto od = decode_attention(q.index_select(0, a.dec_idx).view({Bd, Qd, H, D}), kv_cache, a.dec_table,
                               a.dec_visible, scale);
    out.index_copy_(0, a.dec_rows, od.view({Bd * Qd, H, D}).index_select(0, a.dec_sel));
  }
  TORCH_CHECK(a.pre_bounds.size() == 2 * a.pre_tables.size() && a.pre_tables.size() == a.pre_visibles.size(),
              "fused layer: each prefill chunk needs its start and end, block table and visible counts");
  int64_t covered = a.dec_rows.defined() ? a.dec_rows.numel() : 0;
  for (size_t i = 0; i < a.pre_tables.size(); ++i) {
    const int64_t start = a.pre_bounds[2 * i], end = a.pre_bounds[2 * i + 1];
    TORCH_CHECK(0 <= start && start < end && end <= T, "fused layer: prefill chunk [", start, ", ", end,
                ") outside the batch's ", T, " tokens");
    covered += end - start;
  }
  TORCH_CHECK(covered == T, "fused layer: the attention plan covers ", covered, " of the batch's ", T, " tokens");
  for (size_t i = 0; i < a.pre_tables.size(); ++i) {
    const int64_t start = a.pre_bounds[2 * i], end = a.pre_bounds[2 * i + 1];
    out.slice(0, start, end).copy_(
        decode_attention(q.slice(0, start, end).unsqueeze(0), kv_cache, a.pre_tables[i], a.pre_visibles[i], scale)[0]);
  }
  return out.view({T, H * D});
}

struct LayerWeights {
  c10::optional<torch::Tensor> ln1;
  torch::Tensor ln2;
  Linear qkv, o, gate_up, down;
  int64_t H, KVH, D, pair_rows;
  double eps, scale;
};

// linears: per layer [qkv, o, gate_up, down] x (packed, bias, pairs) — an empty tensor for "none";
// widths their out features; heads [num_heads, num_kv_heads, head_dim].
LayerWeights layer_weights(c10::optional<torch::Tensor> ln1, torch::Tensor ln2, double eps,
                           const std::vector<torch::Tensor>& linears, const std::vector<int64_t>& widths,
                           const std::vector<int64_t>& heads, double scale, int64_t pair_rows) {
  TORCH_CHECK(linears.size() == 12 && widths.size() == 4 && heads.size() == 3,
              "fused layer: linears are [qkv, o, gate_up, down] x (packed, bias, pairs), widths their out "
              "features, heads [num_heads, num_kv_heads, head_dim]");
  TORCH_CHECK(widths[0] == (heads[0] + 2 * heads[1]) * heads[2], "fused layer: qkv width disagrees with the heads");
  Linear l[4];
  for (int i = 0; i < 4; ++i) l[i] = make_linear(&linears[3 * i], widths[i]);
  return {ln1, ln2, l[0], l[1], l[2], l[3], heads[0], heads[1], heads[2], pair_rows, eps, scale};
}

// The layer from its attention input `x_in` and the residual stream `res` on: returns (the MLP's
// output, the residual stream before it).
std::vector<torch::Tensor> attn_mlp(const LayerWeights& w, torch::Tensor x_in, torch::Tensor res, torch::Tensor cos,
                                    torch::Tensor sin, torch::Tensor kv_cache, torch::Tensor slots, const AttnPlan& plan) {
  const int64_t H = w.H, KVH = w.KVH, D = w.D, T = x_in.size(0);
  auto qkv = apply(w.qkv, x_in, w.pair_rows);  // [T, (H + 2 KVH) D]
  auto qk = rotary(qkv.slice(1, 0, (H + KVH) * D).view({T, H + KVH, D}), cos, sin);  // [T, H + KVH, D]
  auto v = qkv.slice(1, (H + KVH) * D, (H + 2 * KVH) * D).view({T, KVH, D});
  cache_write(kv_cache, qk.slice(1, H, H + KVH), v, slots);
  auto attn = attend(plan, qk.slice(1, 0, H), kv_cache, w.scale);
  auto o = apply(w.o, attn, w.pair_rows);
  auto post = rms_norm_impl(o, res, w.ln2, w.eps);  // (norm(o + res), o + res)
  auto act = silu_mul(apply(w.gate_up, post[0], w.pair_rows));
  return {apply(w.down, act, w.pair_rows), post[1]};
}

// A decoder layer: the input norm (none without ln1; with `residual`, the residual add fused into
// it), then `attn_mlp`.
std::vector<torch::Tensor> layer_impl(const LayerWeights& w, torch::Tensor delta, c10::optional<torch::Tensor> residual,
                                      torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache, torch::Tensor slots,
                                      const AttnPlan& plan) {
  if (residual.has_value()) {
    TORCH_CHECK(w.ln1.has_value(), "fused layer: a residual needs the input norm");
    auto r = rms_norm_impl(delta, residual, *w.ln1, w.eps);
    return attn_mlp(w, r[0], r[1], cos, sin, kv_cache, slots, plan);
  }
  auto x_in = w.ln1.has_value() ? rms_norm_impl(delta, c10::nullopt, *w.ln1, w.eps)[0] : delta.contiguous();
  return attn_mlp(w, x_in, delta, cos, sin, kv_cache, slots, plan);
}

std::vector<torch::Tensor> fused_layer(torch::Tensor delta, c10::optional<torch::Tensor> residual,
                                       c10::optional<torch::Tensor> ln1, torch::Tensor ln2, double eps,
                                       std::vector<torch::Tensor> linears, std::vector<int64_t> widths,
                                       std::vector<int64_t> heads, double scale, int64_t pair_rows, torch::Tensor cos,
                                       torch::Tensor sin, torch::Tensor kv_cache, torch::Tensor slots,
                                       c10::optional<torch::Tensor> dec_table, c10::optional<torch::Tensor> dec_visible,
                                       c10::optional<torch::Tensor> dec_idx, c10::optional<torch::Tensor> dec_sel,
                                       c10::optional<torch::Tensor> dec_rows, std::vector<int64_t> pre_bounds,
                                       std::vector<torch::Tensor> pre_tables, std::vector<torch::Tensor> pre_visibles) {
  auto get = [](const c10::optional<torch::Tensor>& t) { return t.has_value() ? *t : torch::Tensor(); };
  const AttnPlan plan{get(dec_table), get(dec_visible), get(dec_idx), get(dec_sel), get(dec_rows),
                      pre_bounds, pre_tables, pre_visibles};
  return layer_impl(layer_weights(ln1, ln2, eps, linears, widths, heads, scale, pair_rows), delta, residual, cos, sin,
                    kv_cache, slots, plan);
}

// Positions and KV slots of a drafting pass's [R, q] grid: request r's tokens at start[r] + shift + i.
std::vector<torch::Tensor> grid_slots(const torch::Tensor& start, int64_t q, int64_t shift, const torch::Tensor& block_table,
                                      int64_t block_size) {
  const int64_t R = start.numel(), width = block_table.size(1);
  const int64_t* first = start.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  auto pos = torch::empty({R * q}, start.options());
  auto slots = torch::empty_like(pos);
  int64_t* pp = pos.data_ptr<int64_t>();
  int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < q; ++i) {
      const int64_t at = first[r] + shift + i;
      TORCH_CHECK(at >= 0 && at / block_size < width, "drafting chain: position ", at, " outside the block table");
      pp[r * q + i] = at;
      sp[r * q + i] = table[r * width + at / block_size] * block_size + at % block_size;
    }
  return {pos, slots};
}

void check_chain_inputs(const torch::Tensor& ids, const torch::Tensor* feed, const torch::Tensor& start, int64_t qlen,
                        const torch::Tensor& block_table, int64_t passes) {
  const int64_t R = start.numel();
  TORCH_CHECK(R > 0 && qlen > 0 && passes >= 1, "drafting chain: needs requests, a query length and a pass");
  TORCH_CHECK(start.dim() == 1 && start.scalar_type() == torch::kInt64 && start.is_contiguous() &&
                  block_table.dim() == 2 && block_table.size(0) == R && block_table.scalar_type() == torch::kInt64 &&
                  block_table.is_contiguous() && ids.dim() == 1 && ids.size(0) == R * qlen &&
                  (feed == nullptr || (feed->dim() == 2 && feed->size(0) == R * qlen)),
              "drafting chain: start [R] and block_table [R, W] contiguous int64, ids [R * qlen], feed [R * qlen, H]");
}

torch::Tensor last_rows(const torch::Tensor& x, int64_t R, int64_t q) {  // rows q-1, 2q-1, ... of x
  return q == 1 ? x : x.index_select(0, torch::arange(q - 1, R * q, q, torch::dtype(torch::kInt64)));
}

// EAGLE drafting with a one-layer head in one call: `passes` forwards of the head, its logits and
// the argmax — the same functions in the same order as the module path (``spec_decode.eagle`` over
// ``models.eagle``), so the drafts and the head's KV are bitwise the same.
//   EAGLE-1 (`eagle3` empty): x = fc([embed(ids); feed]), the layer without input norm, out = res +
//     mlp, logits = head(out); out is fed back.
//   EAGLE-3 (`eagle3` = input_layernorm, hidden_norm, norm weights and d2t): x = [norm_in(embed(ids));
//     norm_hidden(feed)] with `feed` as the residual, pre = res + mlp, logits = head(norm(pre)) over
//     the draft vocabulary, token = argmax + d2t[argmax]; pre is fed back (pass 1's `feed` is the
//     fc-fused target features, computed before).
// Pass 0 runs the [R, qlen] grid of token ids `ids` [R * qlen] with `feed` [R * qlen, H] at positions
// start[r] .. start[r] + qlen - 1 and drafts from each request's last row; pass p >= 1 feeds each
// request's previous draft with the head's previous output at position start[r] + qlen + p - 1.
// fc (EAGLE-1) and logits_head are (packed, bias, pairs) like a fused layer's linears, out_features
// their widths; cos / sin the whole rotary tables [P, D]. Returns the drafts [R, passes].
torch::Tensor eagle_chain(torch::Tensor ids, torch::Tensor feed, torch::Tensor start, int64_t qlen,
                          torch::Tensor block_table, int64_t block_size, int64_t passes, torch::Tensor embed,
                          std::vector<torch::Tensor> fc, std::vector<torch::Tensor> logits_head,
                          std::vector<int64_t> out_features, std::vector<torch::Tensor> eagle3, torch::Tensor ln2,
                          double eps, std::vector<torch::Tensor> linears, std::vector<int64_t> widths,
                          std::vector<int64_t> heads, double scale, int64_t pair_rows, torch::Tensor cos_table,
                          torch::Tensor sin_table, torch::Tensor kv_cache) {
  const auto w = layer_weights(c10::nullopt, ln2, eps, linears, widths, heads, scale, pair_rows);
  const bool is3 = !eagle3.empty();
  TORCH_CHECK(logits_head.size() == 3 && out_features.size() == 2 && (is3 ? eagle3.size() == 4 && fc.empty() : fc.size() == 3),
              "eagle_chain: logits_head (and EAGLE-1's fc) are (packed, bias, pairs), out_features their widths; "
              "EAGLE-3 passes [input_layernorm, hidden_norm, norm, d2t] and no fc");
  const Linear fc_l = is3 ? Linear{} : make_linear(fc.data(), out_features[0]);
  const Linear head_l = make_linear(logits_head.data(), out_features[1]);
  block_table = block_table.contiguous();
  start = start.contiguous();
  check_chain_inputs(ids, &feed, start, qlen, block_table, passes);
  const int64_t R = start.numel();
  auto drafts = torch::empty({R, passes}, start.options());
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t q = p == 0 ? qlen : 1;
    auto ps = grid_slots(start, q, p == 0 ? 0 : qlen + p - 1, block_table, block_size);
    auto pos = ps[0], slots = ps[1];
    auto cos = cos_table.index_select(0, pos).unsqueeze(1), sin = sin_table.index_select(0, pos).unsqueeze(1);
    auto visible = (pos + 1).view({R, q});
    auto embeds = embed.index_select(0, ids);
    std::vector<torch::Tensor> layer;
    if (is3) {
      auto x = torch::cat({rms_norm_impl(embeds, c10::nullopt, eagle3[0], eps)[0],
                           rms_norm_impl(feed, c10::nullopt, eagle3[1], eps)[0]}, 1);
      layer = attn_mlp(w, x, feed, cos, sin, kv_cache, slots, grid_plan(block_table, visible));
    } else {
      auto x = apply(fc_l, torch::cat({embeds, feed}, 1), pair_rows);
      layer = attn_mlp(w, x, x, cos, sin, kv_cache, slots, grid_plan(block_table, visible));
    }
    feed = last_rows(layer[1] + layer[0], R, q);
    auto for_logits = is3 ? rms_norm_impl(feed, c10::nullopt, eagle3[2], eps)[0] : feed;
    ids = argmax_rows(apply(head_l, for_logits, pair_rows));
    if (is3) ids = ids + eagle3[3].index_select(0, ids);
    drafts.select(1, p).copy_(ids);
  }
  return drafts;
}

// A draft model's drafting passes in one call — a dense Llama-family model whose every layer has the
// one-call form: embed, the layers (`layer_impl`, the residual add fused into the next norm), the
// final add + norm, the logits head, the argmax; the same functions in the same order as
// ``models.llama.CausalLM.forward`` + ``compute_logits`` pass by pass (``spec_decode.draft_model``),
// so drafts and KV writes are bitwise the same. Pass 0 runs the [R, qlen] grid `ids` at start[r] ..
// start[r] + qlen - 1 and drafts from each request's last row; pass p >= 1 feeds the previous draft
// at start[r] + qlen + p - 1. layers: per layer [input norm, post-attention norm, then its linears as
// a fused layer's]; kv_caches one per layer. Returns the drafts [R, passes].
torch::Tensor model_chain(torch::Tensor ids, torch::Tensor start, int64_t qlen, torch::Tensor block_table,
                          int64_t block_size, int64_t passes, torch::Tensor embed,
                          std::vector<std::vector<torch::Tensor>> layers, std::vector<int64_t> widths,
                          std::vector<int64_t> heads, double scale, double eps, int64_t pair_rows, torch::Tensor norm,
                          std::vector<torch::Tensor> logits_head, int64_t vocab, torch::Tensor cos_table,
                          torch::Tensor sin_table, std::vector<torch::Tensor> kv_caches) {
  TORCH_CHECK(!layers.empty() && layers.size() == kv_caches.size() && logits_head.size() == 3,
              "model_chain: one [ln1, ln2, linears...] entry and one KV cache per layer; logits_head is (packed, bias, pairs)");
  std::vector<LayerWeights> w;
  for (const auto& l : layers) {
    TORCH_CHECK(l.size() == 14, "model_chain: a layer is [input norm, post-attention norm, 12 linear tensors]");
    w.push_back(layer_weights(l[0], l[1], eps, std::vector<torch::Tensor>(l.begin() + 2, l.end()), widths, heads, scale,
                              pair_rows));
  }
  const Linear head_l = make_linear(logits_head.data(), vocab);
  block_table = block_table.contiguous();
  start = start.contiguous();
  check_chain_inputs(ids, nullptr, start, qlen, block_table, passes);
  const int64_t R = start.numel();
  auto drafts = torch::empty({R, passes}, start.options());
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t q = p == 0 ? qlen : 1;
    auto ps = grid_slots(start, q, p == 0 ? 0 : qlen + p - 1, block_table, block_size);
    auto cos = cos_table.index_select(0, ps[0]).unsqueeze(1), sin = sin_table.index_select(0, ps[0]).unsqueeze(1);
    auto visible = (ps[0] + 1).view({R, q});
    torch::Tensor delta = embed.index_select(0, ids);
    c10::optional<torch::Tensor> residual;
    for (size_t l = 0; l < w.size(); ++l) {
      auto out = layer_impl(w[l], delta, residual, cos, sin, kv_caches[l], ps[1], grid_plan(block_table, visible));
      delta = out[0];
      residual = out[1];
    }
    auto normed = last_rows(rms_norm_impl(delta, residual, norm, eps)[0], R, q);
    ids = argmax_rows(apply(head_l, normed, pair_rows));
    drafts.select(1, p).copy_(ids);
  }
  return drafts;
}
"""

_lock = threading.Lock()
_module: Any = None
_failed: str | None = None
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def backend() -> str:
    value = os.environ.get("PHALANX_KERNELS", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"PHALANX_KERNELS={value!r} is not valid; valid: {', '.join(BACKENDS)}")
    return value


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags: the build uses -march=native, so a cache shared
    between different machines (a network home) must not hand one CPU another's binary."""
    import hashlib

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        import platform

        flags = platform.processor() or platform.machine()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def build_dir() -> Path:
    root = os.environ.get("PHALANX_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "phalanx", "kernels"
    )
    path = Path(root) / f"torch-{torch.__version__}-flags-{_cpu_tag()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


FUNCTIONS = (
    "decode_attention", "rms_norm", "add_rms_norm", "rotary", "silu_mul", "argmax_rows", "cache_write",
    "pack_pairs", "pair_linear", "pair_linear_supported", "fused_layer",
    "eagle_chain", "model_chain",
)
CFLAGS = ("-fopenmp", "-ffp-contract=off")  # besides -O3 -march=...: no FMA contraction, so each op rounds as written
STALE_LOCK_S = 600.0  # a build takes ~30 s here; a lock this old was left by a killed build


def clear_stale_lock(directory: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """torch's JIT build serialises builders with a ``lock`` file and waits for it to disappear
    forever; a builder killed with SIGKILL (an OOM kill, a CI timeout) leaves it behind and every
    later start would hang. Remove a lock older than `max_age_s`; returns whether one was removed."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    log.warning("phalanx: removing a stale kernel build lock %s (%.0f s old)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _wait_for_other_builder(directory: Path, max_age_s: float = STALE_LOCK_S) -> None:
    """Another process building holds the lock: wait for it, but never past `max_age_s`."""
    while (directory / "lock").exists() and not clear_stale_lock(directory, max_age_s):
        time.sleep(0.5)


def load(required: bool = False) -> Any:
    """The compiled module, building it on first use; None when it cannot be built (one warning),
    or an error when ``required``."""
    global _module, _failed
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load_inline

                _wait_for_other_builder(build_dir())
                log.info("phalanx: loading the C++ kernels from %s (the first use builds them, ~30 s)", build_dir())
                _module = load_inline(
                    name="phalanx_cpu_ops",
                    cpp_sources=[_SOURCE],
                    functions=list(FUNCTIONS),
                    extra_cflags=["-O3", "-march=native", *CFLAGS],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir()),
                    verbose=False,
                )
            except Exception as exc:  # no compiler / ninja / headers: the reference path still works
                _failed = f"{type(exc).__name__}: {exc}".strip()[:2000]
                log.warning("phalanx: the C++ kernels could not be built (%s); using the PyTorch "
                            "reference ops", _failed.splitlines()[0])
    if _module is None and required:
        raise RuntimeError(f"PHALANX_KERNELS=cpp but the C++ kernels could not be built: {_failed}")
    return _module


def kernel_for(dtype: torch.dtype) -> Any:
    """The compiled module when its kernels should serve tensors of `dtype` (the decode attention:
    bf16 and fp32), else None."""
    choice = backend()
    if choice == "torch" or dtype not in SUPPORTED_DTYPES:
        return None
    return load(required=choice == "cpp")


def attach(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Give every layer under `model` that has a fused form (modules with a ``kernel`` attribute:
    RMSNorm, RotaryEmbedding, GatedMLP) the compiled module, when `model` computes in bf16 and the
    backend allows it. Call once after loading; returns how many modules got it."""
    if dtype != torch.bfloat16 or kernel_for(dtype) is None:
        return 0
    module = load()
    count = 0
    for m in model.modules():
        if hasattr(m, "kernel"):
            m.kernel = module
            count += 1
    return count


def decode_attention(
    module: Any,
    q: torch.Tensor,  # [S, Q, H, D]
    kv_cache: torch.Tensor,  # [2, kvh, num_blocks, block_size, D]
    block_table: torch.Tensor,  # [S, W] int64
    visible: torch.Tensor,  # [S, Q] int64: query i of sequence s attends keys 0 .. visible[s, i] - 1
    scale: float,
) -> torch.Tensor:  # [S, Q, H, D]
    return module.decode_attention(q, kv_cache, block_table, visible, float(scale))


_pair_ok: bool | None = None  # pair_linear matches this CPU's oneDNN (None: not checked yet)


def pair_linear_module() -> Any:
    """The compiled module when bf16 linears of few rows should use its `pair_linear`: the backend
    allows the kernels, the CPU has AVX512-BF16, and on this CPU the kernel reproduces oneDNN's
    results to the bit (checked once per process: oneDNN picks its kernel by CPU, and one with
    another summation order, e.g. AMX tiles, would make the two paths disagree). Else None."""
    module = kernel_for(torch.bfloat16)
    if module is None or not module.pair_linear_supported():
        return None
    global _pair_ok
    if _pair_ok is None:  # the module is one per process (`load`), so is the check
        _pair_ok = _pair_linear_matches_onednn(module)
        if not _pair_ok:
            log.warning("phalanx: the few-row linear kernel does not reproduce this CPU's oneDNN results "
                        "bit for bit; bf16 linears stay on oneDNN")
    return module if _pair_ok else None


def _pair_linear_matches_onednn(module: Any) -> bool:
    """Shapes where an order difference would show: one row at long K (many roundings per output, the
    512-blocking), several rows at K <= 512, odd sizes."""
    g = torch.Generator().manual_seed(0)
    for n, k, rows in ((1024, 1408, 1), (1024, 600, 1), (1000, 256, 4), (1024, 512, 3), (999, 97, 2)):
        w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        x = torch.randn(rows, k, generator=g).bfloat16()
        if not torch.equal(module.pair_linear(x, module.pack_pairs(w), n), torch.nn.functional.linear(x, w)):
            return False
    return True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of 2-D logits [N, V] (bf16 or float32) -> int64 [N]: the kernel when the
    backend allows it (no float32 copy of bf16 logits; torch's reduction over the last dim is
    scalar here), else ``x.argmax(-1)``. The same answer either way, ties and NaN included."""
    module = None
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[1] > 0 and not x.requires_grad:
        module = kernel_for(x.dtype)
    return x.argmax(dim=-1) if module is None else module.argmax_rows(x)


def argmax_fn(dtype: torch.dtype) -> Any:
    """`argmax` resolved once for logits of `dtype` (a model's hot path: no backend look-up per
    call): the kernel's ``argmax_rows`` when it serves `dtype`, else torch's."""
    module = kernel_for(dtype)
    return module.argmax_rows if module is not None else _torch_argmax


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def main() -> None:
    """Build the kernels ahead of time (``make install``); raises if they cannot be built."""
    t0 = time.perf_counter()
    load(required=True)
    print(f"phalanx: C++ kernels ready in {build_dir()} ({time.perf_counter() - t0:.1f}s)")

