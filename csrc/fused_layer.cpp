// One whole decoder layer in one call (any batch without lockstep padding).
// Llama's layer as the module path runs it on the other kernels (gemm, norm, elementwise,
// attention): the input norm (or none: an EAGLE-1 head's first layer; with `residual`, the residual
// add fused into it), the qkv projection, rotary on queries and keys, the KV write, the paged
// attention grouped as the module path groups it (one [R, Q] grid for a uniform batch, else the
// decode group and each prefill chunk: `AttnPlan`, `attend`), o_proj, the add + post-attention
// norm, gate/up, SiLU-and-multiply, down. The same functions in the same order as the module path
// (``models.llama.DecoderLayer.forward_split``), so the result is bitwise the same; what it saves is
// the ~15 Python-level calls and ~10 dispatches per layer, which at a few rows cost more than the
// arithmetic. Returns (the MLP's output, the residual stream before it), as forward_split does.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>

#include <cstring>

#include "common.h"
#include "fused_layer.h"
#include "gemm.h"
#include "ops.h"

namespace phalanx {

Linear make_linear(const at::Tensor* t, int64_t out_features) {
  return {t[0], t[1].numel() ? t[1] : at::Tensor(), out_features};
}

at::Tensor onednn_linear(const at::Tensor& x, const Linear& l) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, l.packed, l.bias.defined() ? c10::IValue(l.bias) : c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor apply(const Linear& l, const at::Tensor& x, int64_t isa) {
  if (isa == 0) return onednn_linear(x, l);
  return gemm(x, l.packed, l.out_features, l.bias.defined() ? std::optional<at::Tensor>(l.bias) : std::nullopt, isa);
}


AttnPlan grid_plan(at::Tensor block_table, at::Tensor visible) { return {block_table, visible}; }

namespace {

// The checks of a row index into a batch of `rows` rows: int64, contiguous, every entry in range.
const int64_t* row_index(const at::Tensor& idx, int64_t rows, const char* name) {
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.dim() == 1, "fused layer: ", name,
              " must be a contiguous int64 vector");
  const int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    TORCH_CHECK(0 <= p[i] && p[i] < rows, "fused layer: ", name, "[", i, "] = ", p[i], " outside [0, ", rows, ")");
  return p;
}

// dst[dst_rows[i]] = src[src_rows[i]] (dst's rows 0..n-1 when dst_rows is null) for [rows, H, D]
// tensors whose rows each hold their H * D elements contiguously, rows any stride apart (q is a view
// of the qkv projection's output): a memcpy a row. The decode group's gather and scatter of a ragged
// batch (requests verifying different numbers of drafts) are a few KB each; index_select and
// index_copy_ took ~12 and ~10 us a call for them (q made contiguous first, ~9 more), ~1 ms of a
// 30-layer forward.
void copy_rows(at::Tensor& dst, const int64_t* dst_rows, const at::Tensor& src, const int64_t* src_rows, int64_t n) {
  const int64_t H = src.size(1), D = src.size(2);
  TORCH_CHECK(dst.scalar_type() == src.scalar_type() && dst.dim() == 3 && dst.size(1) == H && dst.size(2) == D &&
                  src.stride(2) == 1 && src.stride(1) == D && dst.stride(2) == 1 && dst.stride(1) == D,
              "fused layer: rows are copied between [rows, H, D] tensors of one dtype, each row's H * D "
              "elements contiguous");
  const int64_t bytes = H * D * src.element_size();
  const int64_t ss = src.stride(0) * src.element_size(), ds = dst.stride(0) * dst.element_size();
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(d + (dst_rows ? dst_rows[i] : i) * ds, s + src_rows[i] * ss, bytes);
}

}  // namespace

// q [T, H, D] (rotated) -> attention output [T, H * D]
at::Tensor attend(const AttnPlan& a, const at::Tensor& q, const at::Tensor& kv_cache, double scale, int64_t isa) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  if (!a.dec_idx.defined() && a.pre_tables.empty()) {  // the flat batch is one [R, Q] grid, rows in order
    TORCH_CHECK(a.dec_table.defined() && a.dec_visible.dim() == 2, "fused layer: no attention grid");
    const int64_t Q = a.dec_visible.size(1);
    TORCH_CHECK(Q > 0 && T % Q == 0, "fused layer: ", T, " tokens are not whole requests of ", Q);
    return decode_attention(q.reshape({T / Q, Q, H, D}), kv_cache, a.dec_table, a.dec_visible, scale, isa).view({T, H * D});
  }
  auto out = at::empty({T, H, D}, q.options());
  if (a.dec_table.defined()) {
    TORCH_CHECK(a.dec_idx.defined() && a.dec_sel.defined() && a.dec_rows.defined() && a.dec_visible.dim() == 2 &&
                    a.dec_idx.numel() == a.dec_visible.numel() && a.dec_sel.numel() == a.dec_rows.numel(),
                "fused layer: the decode group needs dec_idx [Bd * Qd], dec_sel and dec_rows of one length");
    const int64_t Bd = a.dec_visible.size(0), Qd = a.dec_visible.size(1);
    auto grid = at::empty({Bd * Qd, H, D}, q.options());
    copy_rows(grid, nullptr, q, row_index(a.dec_idx, T, "dec_idx"), Bd * Qd);
    auto od = decode_attention(grid.view({Bd, Qd, H, D}), kv_cache, a.dec_table, a.dec_visible, scale, isa);
    copy_rows(out, row_index(a.dec_rows, T, "dec_rows"), od.reshape({Bd * Qd, H, D}),
              row_index(a.dec_sel, Bd * Qd, "dec_sel"), a.dec_sel.numel());
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
        decode_attention(q.slice(0, start, end).unsqueeze(0), kv_cache, a.pre_tables[i], a.pre_visibles[i], scale,
                         isa)[0]);
  }
  return out.view({T, H * D});
}


LayerWeights layer_weights(std::optional<at::Tensor> ln1, at::Tensor ln2, double eps,
                           const std::vector<at::Tensor>& linears, const std::vector<int64_t>& widths,
                           const std::vector<int64_t>& heads, double scale, int64_t isa) {
  TORCH_CHECK(linears.size() == 8 && widths.size() == 4 && heads.size() == 3,
              "fused layer: linears are [qkv, o, gate_up, down] x (packed, bias), widths their out "
              "features, heads [num_heads, num_kv_heads, head_dim]");
  TORCH_CHECK(widths[0] == (heads[0] + 2 * heads[1]) * heads[2], "fused layer: qkv width disagrees with the heads");
  Linear l[4];
  for (int i = 0; i < 4; ++i) l[i] = make_linear(&linears[2 * i], widths[i]);
  return {ln1, ln2, l[0], l[1], l[2], l[3], heads[0], heads[1], heads[2], isa, eps, scale};
}

// The layer from its attention input `x_in` and the residual stream `res` on: returns (the MLP's
// output, the residual stream before it).
std::vector<at::Tensor> attn_mlp(const LayerWeights& w, at::Tensor x_in, at::Tensor res, at::Tensor cos,
                                    at::Tensor sin, at::Tensor kv_cache, at::Tensor slots, const AttnPlan& plan) {
  const int64_t H = w.H, KVH = w.KVH, D = w.D, T = x_in.size(0);
  auto qkv = apply(w.qkv, x_in, w.isa);  // [T, (H + 2 KVH) D]
  auto qk = rotary(qkv.slice(1, 0, (H + KVH) * D).view({T, H + KVH, D}), cos, sin);  // [T, H + KVH, D]
  auto v = qkv.slice(1, (H + KVH) * D, (H + 2 * KVH) * D).view({T, KVH, D});
  cache_write(kv_cache, qk.slice(1, H, H + KVH), v, slots);
  auto attn = attend(plan, qk.slice(1, 0, H), kv_cache, w.scale, w.isa);
  auto o = apply(w.o, attn, w.isa);
  auto post = rms_norm_impl(o, res, w.ln2, w.eps);  // (norm(o + res), o + res)
  auto act = silu_mul(apply(w.gate_up, post[0], w.isa));
  return {apply(w.down, act, w.isa), post[1]};
}

// A decoder layer: the input norm (none without ln1; with `residual`, the residual add fused into
// it), then `attn_mlp`.
std::vector<at::Tensor> layer_impl(const LayerWeights& w, at::Tensor delta, std::optional<at::Tensor> residual,
                                      at::Tensor cos, at::Tensor sin, at::Tensor kv_cache, at::Tensor slots,
                                      const AttnPlan& plan) {
  if (residual.has_value()) {
    TORCH_CHECK(w.ln1.has_value(), "fused layer: a residual needs the input norm");
    auto r = rms_norm_impl(delta, residual, *w.ln1, w.eps);
    return attn_mlp(w, r[0], r[1], cos, sin, kv_cache, slots, plan);
  }
  auto x_in = w.ln1.has_value() ? rms_norm_impl(delta, std::nullopt, *w.ln1, w.eps)[0] : delta.contiguous();
  return attn_mlp(w, x_in, delta, cos, sin, kv_cache, slots, plan);
}

std::vector<at::Tensor> fused_layer(at::Tensor delta, std::optional<at::Tensor> residual,
                                       std::optional<at::Tensor> ln1, at::Tensor ln2, double eps,
                                       std::vector<at::Tensor> linears, std::vector<int64_t> widths,
                                       std::vector<int64_t> heads, double scale, int64_t isa, at::Tensor cos,
                                       at::Tensor sin, at::Tensor kv_cache, at::Tensor slots,
                                       std::optional<at::Tensor> dec_table, std::optional<at::Tensor> dec_visible,
                                       std::optional<at::Tensor> dec_idx, std::optional<at::Tensor> dec_sel,
                                       std::optional<at::Tensor> dec_rows, std::vector<int64_t> pre_bounds,
                                       std::vector<at::Tensor> pre_tables, std::vector<at::Tensor> pre_visibles) {
  auto get = [](const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); };
  const AttnPlan plan{get(dec_table), get(dec_visible), get(dec_idx), get(dec_sel), get(dec_rows),
                      pre_bounds, pre_tables, pre_visibles};
  return layer_impl(layer_weights(ln1, ln2, eps, linears, widths, heads, scale, isa), delta, residual, cos, sin,
                    kv_cache, slots, plan);
}

}  // namespace phalanx
