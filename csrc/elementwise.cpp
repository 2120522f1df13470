// The elementwise ops of a decoder layer besides the norm: rotate-half rotary and the gated MLP's
// SiLU-and-multiply, bf16, rounded where the PyTorch ops they replace round.
#include <ATen/ops/empty.h>

#include "common.h"
#include "ops.h"

namespace phalanx {

// Rotate-half rotary on x [T, N, D] (any row / head strides, last dim contiguous) with cos / sin
// rows [T, 1, D] (bf16): bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), as the PyTorch ops round.
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_bf16_rows(x, "rotary");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "rotary: x must be [T, N, D] with even D");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 &&
                  cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel(),
              "rotary: cos / sin must be bfloat16 [T, 1, D]");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = x.size(0), N = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sn = x.stride(1);
  auto out = at::empty({T, N, D}, x.options());
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

// silu(gate) * up for a gated MLP: x [T, 2I] (bf16, last dim contiguous) holds gate | up per row;
// returns bf16(bf16(g / (1 + exp(-g))) * u) [T, I], rounded where F.silu(gate) * up rounds.
at::Tensor silu_mul(at::Tensor x) {
  check_bf16_rows(x, "silu_mul");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul: x must be [T, 2 * I]");
  x = x.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = at::empty({T, I}, x.options());
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
#elif defined(__AVX2__)
      // the AVX512-BF16 build's steps on 8 lanes: its 16-element steps as two halves (so the same
      // elements are left to the scalar tail), exp_ps's polynomial, VCVTNEPS2BF16's rounding
      const __m256 one = _mm256_set1_ps(1.f);
      for (; d + 16 <= I; d += 16)
        for (int h = 0; h < 16; h += 8) {
          const __m256 gf = load8_ps(g + d + h), uf = load8_ps(u + d + h);
          const __m256 silu = _mm256_div_ps(gf, _mm256_add_ps(one, exp_ps8(_mm256_sub_ps(_mm256_setzero_ps(), gf))));
          const __m256 sf = bf16_to_ps8(to_bf16_avx2(silu));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + d + h), to_bf16_avx2(_mm256_mul_ps(sf, uf)));
        }
#endif
      for (; d < I; ++d) o[d] = scalar(g[d], u[d]);
    }
  });
  return out;
}

}  // namespace phalanx
