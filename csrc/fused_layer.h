// One decoder layer in one call (ops.cpu's `fused_layer`) and the pieces the drafting chains
// (chains.cpp) build on: a linear as Python passes it, the attention plan, a layer's weights.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace phalanx {

// One linear of a fused layer as ``layers.linear.PackedLinear`` holds it: its packed weight (`gemm`'s
// pairs, or oneDNN's blocked layout when the layer's path is 0), its bias (undefined: none) and
// its out features.
struct Linear {
  at::Tensor packed, bias;
  int64_t out_features;
};

// A linear from its two tensors as Python passes them (packed, bias; an empty tensor: none).
Linear make_linear(const at::Tensor* t, int64_t out_features);
// y = x W^T (+ b) as PackedLinear.forward computes it: `gemm` on path `isa` (1, 2), or oneDNN's
// packed linear (0).
at::Tensor apply(const Linear& l, const at::Tensor& x, int64_t isa);

// Where a layer's queries attend, grouped as the module path groups them (``attention.torch_paged``):
// the decode group's [Bd, Qd] query grid over `dec_table` / `dec_visible` (undefined: none) — the flat
// batch itself when `dec_idx` is undefined, else gathered from flat rows `dec_idx` [Bd * Qd] (padded)
// with grid entries `dec_sel` landing on flat rows `dec_rows` — then each prefill chunk, flat rows
// [start, end) as a [1, q] grid over its own table and visible counts.
struct AttnPlan {
  at::Tensor dec_table, dec_visible, dec_idx, dec_sel, dec_rows;
  std::vector<int64_t> pre_bounds;  // start, end of each prefill chunk
  std::vector<at::Tensor> pre_tables, pre_visibles;
};

// A plan whose flat batch is one [R, Q] grid in order.
AttnPlan grid_plan(at::Tensor block_table, at::Tensor visible);
// q [T, H, D] (rotated) -> attention output [T, H * D]
at::Tensor attend(const AttnPlan& a, const at::Tensor& q, const at::Tensor& kv_cache, double scale, int64_t isa);

struct LayerWeights {
  std::optional<at::Tensor> ln1;
  at::Tensor ln2;
  Linear qkv, o, gate_up, down;
  int64_t H, KVH, D, isa;
  double eps, scale;
};

// linears: [qkv, o, gate_up, down] x (packed, bias) — an empty tensor for "none";
// widths their out features; heads [num_heads, num_kv_heads, head_dim].
LayerWeights layer_weights(std::optional<at::Tensor> ln1, at::Tensor ln2, double eps,
                           const std::vector<at::Tensor>& linears, const std::vector<int64_t>& widths,
                           const std::vector<int64_t>& heads, double scale, int64_t isa);
// The layer from its attention input `x_in` and the residual stream `res` on: returns (the MLP's
// output, the residual stream before it).
std::vector<at::Tensor> attn_mlp(const LayerWeights& w, at::Tensor x_in, at::Tensor res, at::Tensor cos,
                                 at::Tensor sin, at::Tensor kv_cache, at::Tensor slots, const AttnPlan& plan);
// A decoder layer: the input norm (none without ln1; with `residual`, the residual add fused into
// it), then `attn_mlp`.
std::vector<at::Tensor> layer_impl(const LayerWeights& w, at::Tensor delta, std::optional<at::Tensor> residual,
                                   at::Tensor cos, at::Tensor sin, at::Tensor kv_cache, at::Tensor slots,
                                   const AttnPlan& plan);

}  // namespace phalanx
