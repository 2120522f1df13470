// Vector helpers shared by every kernel file: bf16 <-> float32 on bit patterns, fixed-order dot
// products, AVX-512 loads, the exp polynomial and the float32 softmax of one row.
// Every helper sums in one fixed order that depends only on its own inputs (the kernels' batch
// invariance rests on that). AVX-512 / AVX512-BF16 forms are compiled where the build's -march has
// them; the plain C++ forms serve elsewhere.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace phalanx {

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

// softmax_row's middle step: row[l] = exp(row[l] - m) for l < n; returns their sum (fixed order:
// 16 lanes over the whole groups of 16, their reduction, then the rest one by one).
inline float exp_sum_row(float* row, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  int64_t l = 0;
  for (; l + 16 <= n; l += 16) {
    const __m512 e = exp_nonpositive_ps(_mm512_sub_ps(_mm512_loadu_ps(row + l), vm));
    _mm512_storeu_ps(row + l, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (; l < n; ++l) {
    row[l] = exp_nonpositive(row[l] - m);
    sum += row[l];
  }
  return sum;
}

// In-place softmax of row[0:n] (float32, fixed order): max, exp(x - max), sum, scale.
inline void softmax_row(float* row, int64_t n) {
  if (n <= 0) return;
  int64_t l = 0;
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (; l + 16 <= n; l += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + l));
  float m = _mm512_reduce_max_ps(vmax);
  for (; l < n; ++l) m = std::max(m, row[l]);
  const float inv = 1.f / exp_sum_row(row, n, m);
  for (l = 0; l < n; ++l) row[l] *= inv;
}
#elif defined(__AVX2__)
// Cephes' exp polynomial on 8 lanes: exp_core_ps's operations, op for op (the same bits).
inline __m256 exp_core_ps8(__m256 x) {
  const __m256 n = _mm256_round_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

inline __m256 exp_nonpositive_ps8(__m256 x) { return exp_core_ps8(_mm256_max_ps(x, _mm256_set1_ps(-87.0f))); }

// exp(x) for any float32 x: exp_ps's operations on 8 lanes.
inline __m256 exp_ps8(__m256 x) {
  const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.7228f), _CMP_GT_OQ);
  const __m256 y = exp_core_ps8(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
  return _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()), over);
}

// The AVX-512 softmax_row with its 16 lanes held as two 8-lane halves: the same exps, the same
// per-lane partial sums and _mm512_reduce_add_ps's tree over them (GCC: upper 8 + lower 8, then
// upper 4 + lower 4, then (0 + 2) + (1 + 3)), so both builds give the same bits.
inline void softmax_row(float* row, int64_t n) {
  if (n <= 0) return;
  int64_t l = 0;
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; l + 16 <= n; l += 16)
    vmax = _mm256_max_ps(vmax, _mm256_max_ps(_mm256_loadu_ps(row + l), _mm256_loadu_ps(row + l + 8)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  for (; l < n; ++l) m = std::max(m, row[l]);
  const __m256 vm = _mm256_set1_ps(m);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (l = 0; l + 16 <= n; l += 16) {
    const __m256 e0 = exp_nonpositive_ps8(_mm256_sub_ps(_mm256_loadu_ps(row + l), vm));
    const __m256 e1 = exp_nonpositive_ps8(_mm256_sub_ps(_mm256_loadu_ps(row + l + 8), vm));
    _mm256_storeu_ps(row + l, e0);
    _mm256_storeu_ps(row + l + 8, e1);
    lo = _mm256_add_ps(lo, e0);
    hi = _mm256_add_ps(hi, e1);
  }
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  alignas(16) float t[4];
  _mm_store_ps(t, t6);
  float sum = (t[0] + t[2]) + (t[1] + t[3]);
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

#if defined(__AVX2__)
// float32 -> bf16 bits as VCVTNEPS2BF16 rounds (8 lanes): zero and denormals -> signed zero, NaN ->
// its top half made quiet, everything else (infinities included) to nearest even.
inline __m128i to_bf16_avx2(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i out = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  const __m256i exponent = _mm256_and_si256(bits, _mm256_set1_epi32(0x7F800000));
  const __m256i tiny = _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256());
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x8000));
  out = _mm256_blendv_epi8(out, sign, tiny);
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x0040));
  out = _mm256_blendv_epi8(out, quiet, nan);
  const __m256i packed = _mm256_packus_epi32(out, out);  // per 128-bit lane: 4 words, twice
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // lanes 0 and 2
}

// 8 bf16 (bits in a register) -> 8 float32 (exact)
inline __m256 bf16_to_ps8(__m128i bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)); }
inline __m256 load8_ps(const uint16_t* p) { return bf16_to_ps8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

inline const uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
inline uint16_t* u16_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// Checks that x is bf16 with a contiguous last dimension (what the elementwise kernels read).
inline void check_bf16_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": expects bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, op, ": the last dimension must be contiguous");
}

}  // namespace phalanx
