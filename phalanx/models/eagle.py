"""EAGLE-1 and EAGLE-3 draft heads, in the checkpoint formats vLLM loads.

Owns: the head modules, their forward (returning the hidden state for logits and the hidden state
fed back into the next drafting pass), their logits (EAGLE-3 maps its reduced vocabulary to
target ids through `d2t`), and loading (`midlayer.*` and `model.` prefixes accepted).
Does not own: the drafting loop (``spec_decode.eagle``).

EAGLE-1 at position t, with e_t = embed(x_{t+1}) and f_t the target's final (normed) hidden state:
    x = fc([e_t; f_t]);  r = x + attn(x);  out = r + mlp(post_norm(r));  logits = lm_head(out)
(no input norm, no final norm; `out` is fed back as f for the next pass).
EAGLE-3: g = fc([a_1; a_2; a_3]) over three target layers' residual streams (first pass only),
    h = [input_norm(e_t); hidden_norm(g)];  r = g + attn(h);  pre = r + mlp(post_norm(r));
    logits = lm_head(norm(pre)) over the draft vocabulary; target id = draft id + d2t[draft id];
`pre` is fed back as g for the next pass.
Heads with `num_hidden_layers` > 1 (both kinds, as vLLM's `llama_eagle` / `llama_eagle3`) run
plain pre-norm Llama layers (`layers.1`, ...) on `out` / `pre` before the logits, each with its
own KV cache; the last layer's output is what is fed back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from phalanx.attention.metadata import AttentionMetadata
from phalanx.config import ModelConfig
from phalanx.layers.linear import (
    PackedLinear,
    empty_embedding,
    empty_linear,
    prepack_linears,
    prepack_supported,
)
from phalanx.layers.mlp import GatedMLP
from phalanx.layers.norm import RMSNorm
from phalanx.layers.rotary import RotaryEmbedding
from phalanx.models.llama import (
    Attention,
    CausalLM,
    DecoderLayer,
    FusedParts,
    _copy_shard,
    fused_parts,
    map_hf_name,
    missing_weights,
    packed_pair,
)
from phalanx.models.loader import iterate_weights
from phalanx.ops import cpu as cpu_ops


def head_config(folder: str, target: ModelConfig) -> ModelConfig:
    """The head's layer shapes as a ModelConfig (llama-style config.json), in the target's dtype."""
    with open(Path(folder) / "config.json", encoding="utf-8") as f:
        hf: dict[str, Any] = json.load(f)
    hf = {**hf, "vocab_size": hf.get("vocab_size") or target.vocab_size}
    hf.setdefault("max_position_embeddings", target.max_position_embeddings)
    return ModelConfig._from_dict(folder, "LlamaForCausalLM", hf, target.dtype, None)


def _normalise(name: str) -> str:
    name = name.removeprefix("model.")
    return name.replace("midlayer.", "layers.0.")


class _HeadBase(nn.Module):
    def __init__(self, cfg: ModelConfig, target: CausalLM) -> None:
        super().__init__()
        self.config = cfg
        self.target = [target]  # a list, so the target's parameters are not registered twice
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max(target.config.max_model_len + 64, cfg.max_position_embeddings),
            cfg.rope_theta, cfg.rope_scaling,
        )
        self.embed_tokens: nn.Embedding | None = None  # own embedding only if the checkpoint has one
        self.argmax = cpu_ops.argmax_fn(cfg.dtype)  # over [N, V] logits, in the head's dtype
        self._chain: EagleChain | None | bool = False  # `chain_form` (False: not resolved yet)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self.target[0].embed(input_ids)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = _normalise(raw_name)
            if name == "embed_tokens.weight":
                self.embed_tokens = empty_embedding(*tensor.shape, dtype=self.config.dtype)
                params["embed_tokens.weight"] = self.embed_tokens.weight
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                self._own_lm_head(tensor)
                params["lm_head.weight"] = self.lm_head.weight  # type: ignore[union-attr]
            if name in buffers:
                buffers[name].copy_(tensor)
                loaded.add(name)
                continue
            mapped = map_hf_name(name, self.config)
            if mapped is None:
                continue
            pname, shard = mapped
            if pname not in params:
                if pname.startswith("t2d"):
                    continue  # derived from d2t
                raise ValueError(f"EAGLE checkpoint tensor {raw_name!r} has no matching parameter")
            with torch.no_grad():
                _copy_shard(params[pname], shard, tensor, self.config, raw_name)
            loaded.add(pname if shard is None else f"{pname}#{shard}")
        missing = [n for n in missing_weights(params, loaded) if not n.startswith("target")]
        if missing:
            raise ValueError(f"EAGLE checkpoint {self.config.path!r} lacks weights for: {missing[:8]}")

    def _own_lm_head(self, tensor: torch.Tensor) -> None:
        self.lm_head = empty_linear(tensor.shape[1], tensor.shape[0], dtype=self.config.dtype)

    def chain_form(self) -> EagleChain | None:
        """The arguments of the C++ drafting chain (``ops.cpu.eagle_chain``: several drafting passes
        in one call) when this head can use it — one layer running wholly on the fused kernels, with
        fc and logits head packed on the layer's GEMM path — else None. Resolved once."""
        if self._chain is False:
            self._chain = self._resolve_chain() if len(self.layers) == 1 else None
        return self._chain  # type: ignore[return-value]

    def _resolve_chain(self) -> EagleChain | None:
        raise NotImplementedError

    def _chain_args(self, parts: FusedParts | None, fc: nn.Module | None, logits_head: nn.Module | None,
                    eagle3: list[torch.Tensor]) -> EagleChain | None:
        linears = [x for x in (fc, logits_head) if x is not None]
        if parts is None or not all(isinstance(x, PackedLinear) and x.isa == parts.isa for x in linears):
            return None
        assert isinstance(logits_head, PackedLinear)
        cos_table, sin_table = parts.rotary.typed_tables(parts.ln2.dtype)
        embed = self.embed_tokens.weight if self.embed_tokens is not None else self.target[0].embedding_table()
        return EagleChain(
            kernel=parts.kernel,
            embed=embed,
            fc=[] if fc is None else packed_pair(fc),  # type: ignore[arg-type]
            logits_head=packed_pair(logits_head),
            out_features=[0 if fc is None else fc.out_features, logits_head.out_features],  # type: ignore[list-item]
            eagle3=eagle3,
            parts=parts,
            cos_table=cos_table,
            sin_table=sin_table,
        )

    def draft_chain(
        self,
        ids: torch.Tensor,  # [R * q] the token fed at each position of pass 1
        feed: torch.Tensor,  # [R * q, H] the features fed with them (EAGLE-3: already fused by fc)
        start: torch.Tensor,  # [R] int64: each request's first position in pass 1
        q: int,
        block_table: torch.Tensor,  # [R, W]
        block_size: int,
        passes: int,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:  # [R, passes] the drafts (target token ids)
        """`passes` drafting passes in one C++ call (`chain_form` must be set): pass 1 over the
        [R, q] grid (drafting from each request's last row), then one token per request per pass —
        bitwise the drafts and KV writes of `forward` + `draft_token_ids` pass by pass."""
        chain = self.chain_form()
        assert chain is not None
        return chain.kernel.eagle_chain(ids, feed, start, q, block_table, block_size, passes, *chain.args(), kv_cache)


class EagleChain(NamedTuple):
    """An EAGLE head's arguments for ``ops.cpu.eagle_chain`` that do not change between steps."""

    kernel: Any  # the compiled ops module
    embed: torch.Tensor  # [V, H] the head's embedding table (the target's unless it has its own)
    fc: list[torch.Tensor]  # EAGLE-1's fc (packed, bias); [] for EAGLE-3 (its fc runs before the chain)
    logits_head: list[torch.Tensor]  # (packed, bias)
    out_features: list[int]  # [fc's (0: none), the logits head's]
    eagle3: list[torch.Tensor]  # EAGLE-3: [input_layernorm, hidden_norm, norm weights, d2t]; [] for EAGLE-1
    parts: FusedParts  # the layer from its attention on
    cos_table: torch.Tensor  # [P, D] rotary tables in the head's dtype
    sin_table: torch.Tensor

    def args(self) -> tuple:
        """The arguments between the step's inputs and the KV cache, in the kernel's order."""
        return (self.embed, self.fc, self.logits_head, self.out_features, self.eagle3, *self.parts.layer_args(),
                self.cos_table, self.sin_table)


def _more_layers(cfg: ModelConfig, rotary: RotaryEmbedding) -> list[nn.Module]:
    """Layers 1.. of a multi-layer head: plain pre-norm decoder layers (vLLM's layout)."""
    if cfg.num_layers < 1:
        raise ValueError(f"an EAGLE head needs num_hidden_layers >= 1, got {cfg.num_layers}")
    return [DecoderLayer(cfg, i, rotary) for i in range(1, cfg.num_layers)]


class Eagle1Head(_HeadBase):
    num_aux_layers = 0

    def __init__(self, cfg: ModelConfig, target: CausalLM) -> None:
        super().__init__(cfg, target)
        h = cfg.hidden_size
        self.fc = empty_linear(2 * h, h, bias=bool(cfg.hf_config.get("bias", False)))
        layer = DecoderLayer(cfg, 0, self.rotary)
        layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.layers = nn.ModuleList([layer] + _more_layers(cfg, self.rotary))
        self.lm_head: nn.Module | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] the next token at each position
        hidden: torch.Tensor,  # [T, H] target feature (first pass) or the head's own output
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (hidden for logits, hidden fed back), both [T, H]
        out = self.fc(torch.cat([self.embed(input_ids), hidden], dim=-1))
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            out = layer(out, kv, meta)
        return out, out

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N] target ids
        if self.lm_head is None:
            return self.argmax(self.target[0].compute_logits(hidden, float32=False))
        return self.argmax(self.lm_head(hidden))

    def _resolve_chain(self) -> EagleChain | None:
        fused = self.layers[0].fused_form()
        if fused is None or fused.ln1 is not None:  # the first layer has no input norm
            return None
        target = self.target[0]
        logits_head = self.lm_head if self.lm_head is not None else (target.lm_head or target.tied_head)
        return self._chain_args(fused.parts, self.fc, logits_head, [])


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, in_features=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        h, r = self.post_attention_layernorm.add_forward(self.self_attn(x, kv_cache, meta), hidden)
        return r + self.mlp(h)


class Eagle3Head(_HeadBase):
    def __init__(self, cfg: ModelConfig, target: CausalLM) -> None:
        super().__init__(cfg, target)
        hf = cfg.hf_config
        h = cfg.hidden_size
        ids = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
        n = target.num_layers
        self.aux_layer_ids: tuple[int, ...] = tuple(ids) if ids else (2, n // 2, n - 3)
        if len(self.aux_layer_ids) != 3 or not all(isinstance(i, int) and 0 <= i <= n for i in self.aux_layer_ids):
            raise ValueError(
                f"EAGLE-3 aux layer ids {list(self.aux_layer_ids)} are invalid for a {n}-layer target: three ids "
                f"in 0..{n} (id j is the residual stream after j target layers: 0 the embeddings, {n} the last "
                f"layer's output before the final norm)"
            )
        target_h = int(hf.get("target_hidden_size") or h)
        self.fc = empty_linear(3 * target_h, h)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, self.rotary), *_more_layers(cfg, self.rotary)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        draft_vocab = int(hf.get("draft_vocab_size") or cfg.vocab_size)
        self.lm_head = empty_linear(h, draft_vocab)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:  # 3 x [T, H_target] -> [T, H]
        return self.fc(torch.cat(aux, dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H] fused target feature (first pass) or the fed-back `pre`
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pre = self.layers[0](self.embed(input_ids), hidden, kv_caches[0], meta)
        for layer, kv in zip(self.layers[1:], kv_caches[1:], strict=True):
            pre = layer(pre, kv, meta)
        return self.norm(pre), pre

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] normed -> [N] target ids
        draft_ids = self.argmax(self.lm_head(hidden))
        return draft_ids + self.d2t[draft_ids]

    def _resolve_chain(self) -> EagleChain | None:
        layer = self.layers[0]
        norms = (layer.input_layernorm, layer.hidden_norm, self.norm)
        if any(n.kernel is None or n.eps != layer.post_attention_layernorm.eps for n in norms):
            return None
        parts = fused_parts(layer.self_attn, layer.mlp, layer.post_attention_layernorm)
        return self._chain_args(parts, None, self.lm_head, [*(n.weight for n in norms), self.d2t])


def load_eagle_head(folder: str, method: str, target: CausalLM) -> Eagle1Head | Eagle3Head:
    cfg = head_config(folder, target.config)
    cls = Eagle3Head if method == "eagle3" else Eagle1Head
    old = torch.get_default_dtype()
    torch.set_default_dtype(cfg.dtype)
    try:
        head = cls(cfg, target)
    finally:
        torch.set_default_dtype(old)
    head.load(iterate_weights(folder))
    head.eval()
    cpu_ops.attach(head, cfg.dtype)  # fused norm / rotary kernels (bf16), like the target
    if prepack_supported(cfg.dtype):
        prepack_linears(head)  # after loading, like the target (layers.linear)
    return head
