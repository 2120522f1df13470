#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "common.h"
#include "gemm.h"

namespace phalanx {

// ---- few-row bf16 linear: y = x W^T for x [M, K] with small M (decode and drafting) ---------------
// oneDNN's packed linear costs ~18 us per call at 1-4 rows whatever the size (its fixed overhead is
// most of a small layer's time). This one streams a copy of W packed in AVX512-BF16 pairs,
// [ceil(N / 16)][ceil(K / 2)][16 outputs][2], with one float32 accumulator per output lane, the k
// pairs in order within blocks of 512 (block sums added in order, as oneDNN's one-row kernel does)
// and one rounding at the end: bitwise oneDNN's result at one row, and at 2-4 rows when K <= 512
// (where oneDNN's multi-row order is the same); every row's result is the same whatever the row count.
// `pair_linear_module` checks the match on the running CPU before anything uses it.
at::Tensor pack_pairs(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_pairs: w must be a bfloat16 [N, K] matrix");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NB = (N + 15) / 16, KP = (K + 1) / 2;
  auto out = at::zeros({NB, KP, 16, 2}, w.options());
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

at::Tensor pair_linear(at::Tensor x, at::Tensor packed, int64_t N) {
  TORCH_CHECK(kPairLinear, "pair_linear: this build has no AVX512-BF16");
  check_bf16_rows(x, "pair_linear");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "pair_linear: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.size(1) == (x.size(1) + 1) / 2 &&
              packed.size(0) == (N + 15) / 16 && packed.scalar_type() == at::kBFloat16,
              "pair_linear: packed must be pack_pairs of an [N, K] weight with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KP = packed.size(1);
  auto out = at::empty({M, N}, x.options());
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

}  // namespace phalanx
