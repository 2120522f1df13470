// Row-wise argmax of logits, read in place (no float32 copy of bf16 logits).
#include <ATen/ops/empty.h>

#include "common.h"
#include "ops.h"

namespace phalanx {

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

at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [N, V] with V > 0");
  x = x.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xp = x.data_ptr<c10::BFloat16>();
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) { for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * V, V); });
  } else if (x.scalar_type() == at::kFloat) {
    const auto* xp = x.data_ptr<float>();
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) { for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * V, V); });
  } else {
    TORCH_CHECK(false, "argmax_rows: dtype must be bfloat16 or float32, got ", x.scalar_type());
  }
  return out;
}

}  // namespace phalanx
