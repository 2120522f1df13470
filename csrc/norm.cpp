// RMSNorm and the residual add fused in front of it, bf16, rounded where the PyTorch ops round.
#include <ATen/ops/empty_like.h>

#include "common.h"
#include "ops.h"

namespace phalanx {

// 1 / sqrt(mean(x^2) + eps) over one row, float32, fixed order.
inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
}

// norm(x) = weight * bf16(x / rms(x)) (Hugging Face's Llama RMSNorm: float32 normalisation, rounded
// to bf16, then the bf16 weight); with `residual`, x is first replaced by bf16(x + residual), which
// is also returned (the residual stream for the rest of the layer).
std::vector<at::Tensor> rms_norm_impl(at::Tensor x, std::optional<at::Tensor> residual, at::Tensor weight,
                                         double eps) {
  check_bf16_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be bfloat16 [", x.size(-1), "]");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  auto out = at::empty_like(x);
  at::Tensor sum, res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kBFloat16,
                "add_rms_norm: residual must match x");
    res = residual->contiguous();
    sum = at::empty_like(x);
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

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  return rms_norm_impl(x, std::nullopt, weight, eps)[0];
}

std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  return rms_norm_impl(x, residual, weight, eps);
}

}  // namespace phalanx
