// A step's drafting passes in one call: EAGLE-1 / EAGLE-3 heads (`eagle_chain`) and dense draft
// models (`model_chain`), built from the fused layer's pieces in the module path's order.
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "common.h"
#include "fused_layer.h"
#include "gemm.h"
#include "ops.h"

namespace phalanx {
namespace {

// Positions and KV slots of a drafting pass's [R, q] grid: request r's tokens at start[r] + shift + i.
std::vector<at::Tensor> grid_slots(const at::Tensor& start, int64_t q, int64_t shift, const at::Tensor& block_table,
                                      int64_t block_size) {
  const int64_t R = start.numel(), width = block_table.size(1);
  const int64_t* first = start.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  auto pos = at::empty({R * q}, start.options());
  auto slots = at::empty_like(pos);
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

void check_chain_inputs(const at::Tensor& ids, const at::Tensor* feed, const at::Tensor& start, int64_t qlen,
                        const at::Tensor& block_table, int64_t passes) {
  const int64_t R = start.numel();
  TORCH_CHECK(R > 0 && qlen > 0 && passes >= 1, "drafting chain: needs requests, a query length and a pass");
  TORCH_CHECK(start.dim() == 1 && start.scalar_type() == at::kLong && start.is_contiguous() &&
                  block_table.dim() == 2 && block_table.size(0) == R && block_table.scalar_type() == at::kLong &&
                  block_table.is_contiguous() && ids.dim() == 1 && ids.size(0) == R * qlen &&
                  (feed == nullptr || (feed->dim() == 2 && feed->size(0) == R * qlen)),
              "drafting chain: start [R] and block_table [R, W] contiguous int64, ids [R * qlen], feed [R * qlen, H]");
}

at::Tensor last_rows(const at::Tensor& x, int64_t R, int64_t q) {  // rows q-1, 2q-1, ... of x
  return q == 1 ? x : x.index_select(0, at::arange(q - 1, R * q, q, at::TensorOptions().dtype(at::kLong)));
}

}  // namespace

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
// fc (EAGLE-1) and logits_head are (packed, bias) like a fused layer's linears, out_features
// their widths; cos / sin the whole rotary tables [P, D]. Returns the drafts [R, passes].
at::Tensor eagle_chain(at::Tensor ids, at::Tensor feed, at::Tensor start, int64_t qlen,
                          at::Tensor block_table, int64_t block_size, int64_t passes, at::Tensor embed,
                          std::vector<at::Tensor> fc, std::vector<at::Tensor> logits_head,
                          std::vector<int64_t> out_features, std::vector<at::Tensor> eagle3, at::Tensor ln2,
                          double eps, std::vector<at::Tensor> linears, std::vector<int64_t> widths,
                          std::vector<int64_t> heads, double scale, int64_t isa, at::Tensor cos_table,
                          at::Tensor sin_table, at::Tensor kv_cache) {
  const auto w = layer_weights(std::nullopt, ln2, eps, linears, widths, heads, scale, isa);
  const bool is3 = !eagle3.empty();
  TORCH_CHECK(logits_head.size() == 2 && out_features.size() == 2 && (is3 ? eagle3.size() == 4 && fc.empty() : fc.size() == 2),
              "eagle_chain: logits_head (and EAGLE-1's fc) are (packed, bias), out_features their widths; "
              "EAGLE-3 passes [input_layernorm, hidden_norm, norm, d2t] and no fc");
  const Linear fc_l = is3 ? Linear{} : make_linear(fc.data(), out_features[0]);
  const Linear head_l = make_linear(logits_head.data(), out_features[1]);
  block_table = block_table.contiguous();
  start = start.contiguous();
  check_chain_inputs(ids, &feed, start, qlen, block_table, passes);
  const int64_t R = start.numel();
  auto drafts = at::empty({R, passes}, start.options());
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t q = p == 0 ? qlen : 1;
    auto ps = grid_slots(start, q, p == 0 ? 0 : qlen + p - 1, block_table, block_size);
    auto pos = ps[0], slots = ps[1];
    auto cos = cos_table.index_select(0, pos).unsqueeze(1), sin = sin_table.index_select(0, pos).unsqueeze(1);
    auto visible = (pos + 1).view({R, q});
    auto embeds = embedding_rows(embed, ids, feed.size(1), -1);
    std::vector<at::Tensor> layer;
    if (is3) {
      auto x = at::cat({rms_norm_impl(embeds, std::nullopt, eagle3[0], eps)[0],
                           rms_norm_impl(feed, std::nullopt, eagle3[1], eps)[0]}, 1);
      layer = attn_mlp(w, x, feed, cos, sin, kv_cache, slots, grid_plan(block_table, visible));
    } else {
      auto x = apply(fc_l, at::cat({embeds, feed}, 1), isa);
      layer = attn_mlp(w, x, x, cos, sin, kv_cache, slots, grid_plan(block_table, visible));
    }
    feed = last_rows(layer[1] + layer[0], R, q);
    auto for_logits = is3 ? rms_norm_impl(feed, std::nullopt, eagle3[2], eps)[0] : feed;
    ids = argmax_rows(apply(head_l, for_logits, isa));
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
at::Tensor model_chain(at::Tensor ids, at::Tensor start, int64_t qlen, at::Tensor block_table,
                          int64_t block_size, int64_t passes, at::Tensor embed,
                          std::vector<std::vector<at::Tensor>> layers, std::vector<int64_t> widths,
                          std::vector<int64_t> heads, double scale, double eps, int64_t isa, at::Tensor norm,
                          std::vector<at::Tensor> logits_head, int64_t vocab, at::Tensor cos_table,
                          at::Tensor sin_table, std::vector<at::Tensor> kv_caches) {
  TORCH_CHECK(!layers.empty() && layers.size() == kv_caches.size() && logits_head.size() == 2,
              "model_chain: one [ln1, ln2, linears...] entry and one KV cache per layer; logits_head is (packed, bias)");
  std::vector<LayerWeights> w;
  for (const auto& l : layers) {
    TORCH_CHECK(l.size() == 10, "model_chain: a layer is [input norm, post-attention norm, 8 linear tensors]");
    w.push_back(layer_weights(l[0], l[1], eps, std::vector<at::Tensor>(l.begin() + 2, l.end()), widths, heads, scale,
                              isa));
  }
  const Linear head_l = make_linear(logits_head.data(), vocab);
  block_table = block_table.contiguous();
  start = start.contiguous();
  check_chain_inputs(ids, nullptr, start, qlen, block_table, passes);
  const int64_t R = start.numel();
  auto drafts = at::empty({R, passes}, start.options());
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t q = p == 0 ? qlen : 1;
    auto ps = grid_slots(start, q, p == 0 ? 0 : qlen + p - 1, block_table, block_size);
    auto cos = cos_table.index_select(0, ps[0]).unsqueeze(1), sin = sin_table.index_select(0, ps[0]).unsqueeze(1);
    auto visible = (ps[0] + 1).view({R, q});
    at::Tensor delta = embedding_rows(embed, ids, norm.size(0), vocab);
    std::optional<at::Tensor> residual;
    for (size_t l = 0; l < w.size(); ++l) {
      auto out = layer_impl(w[l], delta, residual, cos, sin, kv_caches[l], ps[1], grid_plan(block_table, visible));
      delta = out[0];
      residual = out[1];
    }
    auto normed = last_rows(rms_norm_impl(delta, residual, norm, eps)[0], R, q);
    ids = argmax_rows(apply(head_l, normed, isa));
    drafts.select(1, p).copy_(ids);
  }
  return drafts;
}

}  // namespace phalanx
