// The operations the Python side calls (csrc/bindings.cpp registers them), one .cpp file each by
// operation, and the few the kernel files share (rms_norm_impl for the fused layer and the chains).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace phalanx {

// attention.cpp: paged attention of a [S, Q] query grid read through the block table (bf16 / fp32).
// `isa`: the GEMM path of the forward (gemm.h); 3 (AMX) runs bf16 attention on AMX tiles, any other
// the register-tiled task (AVX512-BF16 or AVX2 + FMA, one order).
at::Tensor decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table, at::Tensor visible,
                            double scale, int64_t isa);
// The same, its result in float32 before the one rounding to the query's dtype (for tests).
at::Tensor decode_attention_f32(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table, at::Tensor visible,
                                double scale, int64_t isa);

// cache.cpp: a layer's new keys and values into its paged cache.
void cache_write(at::Tensor kv_cache, at::Tensor k, at::Tensor v, at::Tensor slots);

// norm.cpp: RMSNorm, with the residual add fused in front (returns (normed, sum) then).
std::vector<at::Tensor> rms_norm_impl(at::Tensor x, std::optional<at::Tensor> residual, at::Tensor weight, double eps);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);

// elementwise.cpp: rotate-half rotary, SiLU-and-multiply.
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_mul(at::Tensor x);

// argmax.cpp: row-wise argmax of [N, V] logits.
at::Tensor argmax_rows(at::Tensor x);

// fused_layer.cpp: one decoder layer in one call.
std::vector<at::Tensor> fused_layer(at::Tensor delta, std::optional<at::Tensor> residual,
                                    std::optional<at::Tensor> ln1, at::Tensor ln2, double eps,
                                    std::vector<at::Tensor> linears, std::vector<int64_t> widths,
                                    std::vector<int64_t> heads, double scale, int64_t isa, at::Tensor cos,
                                    at::Tensor sin, at::Tensor kv_cache, at::Tensor slots,
                                    std::optional<at::Tensor> dec_table, std::optional<at::Tensor> dec_visible,
                                    std::optional<at::Tensor> dec_idx, std::optional<at::Tensor> dec_sel,
                                    std::optional<at::Tensor> dec_rows, std::vector<int64_t> pre_bounds,
                                    std::vector<at::Tensor> pre_tables, std::vector<at::Tensor> pre_visibles);

// chains.cpp: a step's drafting passes in one call (EAGLE heads, dense draft models).
at::Tensor eagle_chain(at::Tensor ids, at::Tensor feed, at::Tensor start, int64_t qlen, at::Tensor block_table,
                       int64_t block_size, int64_t passes, at::Tensor embed, std::vector<at::Tensor> fc,
                       std::vector<at::Tensor> logits_head, std::vector<int64_t> out_features,
                       std::vector<at::Tensor> eagle3, at::Tensor ln2, double eps, std::vector<at::Tensor> linears,
                       std::vector<int64_t> widths, std::vector<int64_t> heads, double scale, int64_t isa,
                       at::Tensor cos_table, at::Tensor sin_table, at::Tensor kv_cache);
at::Tensor model_chain(at::Tensor ids, at::Tensor start, int64_t qlen, at::Tensor block_table, int64_t block_size,
                       int64_t passes, at::Tensor embed, std::vector<std::vector<at::Tensor>> layers,
                       std::vector<int64_t> widths, std::vector<int64_t> heads, double scale, double eps,
                       int64_t isa, at::Tensor norm, std::vector<at::Tensor> logits_head, int64_t vocab,
                       at::Tensor cos_table, at::Tensor sin_table, std::vector<at::Tensor> kv_caches);

}  // namespace phalanx
