"""The Llama-family decoder: Llama, Mistral, Qwen2, Qwen3 and their MoE variants (Mixtral,
Qwen2-MoE, Qwen3-MoE), which differ only in small switches read from `ModelConfig`.

Owns: the module tree, the forward over one flat batch (returning final hidden states and, on
request, auxiliary hidden states of chosen layers for EAGLE-3), `compute_logits`, and the map
from Hugging Face checkpoint names to our (fused) parameters.
Does not own: reading files (``models.loader``), attention math (``attention.torch_paged``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from phalanx.attention.metadata import AttentionMetadata
from phalanx.attention.torch_paged import attention_kernel, paged_attention
from phalanx.config import ModelConfig
from phalanx.layers.linear import (
    PackedEmbedding,
    PackedLinear,
    empty_embedding,
    empty_linear,
    prepack_linears,
    prepack_supported,
)
from phalanx.layers.mlp import GatedMLP
from phalanx.layers.moe import SparseMoE
from phalanx.layers.norm import RMSNorm
from phalanx.layers.rotary import RotaryEmbedding
from phalanx.ops import cpu as cpu_ops


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, in_features: int | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        in_features = in_features or cfg.hidden_size
        self.qkv_proj = empty_linear(in_features, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = empty_linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary

    def forward(
        self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [T, in_features] -> [T, hidden]
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, : self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
            q, k = self.rotary(meta.positions, q, k, meta.memo.rotary_rows)
        else:
            # Queries and keys are adjacent in the fused projection: rotate them in one pass.
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = self.rotary.rotate(meta.positions, qk, meta.memo.rotary_rows)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module
        if layer_id in cfg.moe_layer_ids:
            self.mlp = SparseMoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                cfg.shared_expert_intermediate_size,
            )
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

        self._fused: FusedLayer | None | bool = False  # `fused_form` (False: not resolved yet)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        delta, residual = self.forward_split(x, None, kv_cache, meta)
        return residual + delta

    def fused_form(self) -> FusedLayer | None:
        """The arguments of the C++ one-call layer (``ops.cpu.fused_layer``) when every part of this
        layer already runs on the kernels it chains (bf16: packed linears, fused norms, rotary and
        SiLU-and-multiply; no q/k norm, a dense MLP), else None. Resolved once, at the first
        one-grid forward (after loading packed the linears and attached the kernels)."""
        if self._fused is False:
            self._fused = _fused_form(self)
        return self._fused  # type: ignore[return-value]

    def forward_split(
        self, delta: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream entering this layer is ``residual + delta`` (just ``delta`` when
        ``residual`` is None); returns the same split for the stream leaving it (the MLP's output,
        and the stream before it), so the add that closes a layer is fused into the next layer's
        input norm (`RMSNorm.add_forward`: the same sum, rounded once, as ``x + mlp(h)``)."""
        plan = meta.fused_plan()
        if plan is not None and delta.is_contiguous():
            fused = self.fused_form()
            if fused is not None and attention_kernel(delta.dtype, meta) is not None:
                p = fused.parts
                cos, sin = p.rotary.tables(meta.positions, delta.dtype, meta.memo.rotary_rows)
                return p.kernel.fused_layer(delta, residual, fused.ln1, *p.layer_args(), cos, sin, kv_cache,
                                            meta.slot_mapping, *plan)
        if residual is None:
            x_in, residual = self.input_layernorm(delta), delta
        else:
            x_in, residual = self.input_layernorm.add_forward(delta, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(x_in, kv_cache, meta), residual)
        return self.mlp(h), residual


class FusedParts(NamedTuple):
    """A layer's arguments for the C++ kernels from its attention on (``ops.cpu``'s `attn_mlp`)."""

    kernel: Any  # the compiled ops module
    ln2: torch.Tensor  # the post-attention norm's weight
    eps: float
    linears: list[torch.Tensor]  # [qkv, o, gate_up, down] x (packed, bias); an empty tensor: no bias
    widths: list[int]  # their out features
    heads: list[int]  # [num_heads, num_kv_heads, head_dim]
    scale: float
    isa: int  # the linears' GEMM path (PackedLinear.isa: 3 / 2 / 1 the kernels' GEMM, 0 oneDNN)
    rotary: RotaryEmbedding

    def layer_args(self) -> tuple:
        """The arguments after the input norm, in the kernels' order."""
        return self.ln2, self.eps, self.linears, self.widths, self.heads, self.scale, self.isa


class FusedLayer(NamedTuple):
    """A decoder layer's one-call form: its input norm's weight (None: no input norm) and the rest."""

    ln1: torch.Tensor | None
    parts: FusedParts


def _fused_form(layer: DecoderLayer) -> FusedLayer | None:
    ln1 = layer.input_layernorm
    if isinstance(ln1, RMSNorm):
        if ln1.kernel is None or ln1.eps != layer.post_attention_layernorm.eps:
            return None
    elif not isinstance(ln1, nn.Identity):
        return None
    parts = fused_parts(layer.self_attn, layer.mlp, layer.post_attention_layernorm)
    return None if parts is None else FusedLayer(ln1.weight if isinstance(ln1, RMSNorm) else None, parts)


def fused_parts(attn: Attention, mlp: nn.Module, ln2: RMSNorm) -> FusedParts | None:
    """The C++ layer's arguments from its attention on when every part runs on the kernels it chains
    — packed linears, fused norm, rotary and SiLU-and-multiply, no q/k norm, a dense MLP — else None."""
    linears = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    if not all(isinstance(x, PackedLinear) for x in linears) or len({x.isa for x in linears}) != 1:  # type: ignore[union-attr]
        return None
    if not (ln2.kernel is not None and isinstance(mlp, GatedMLP) and mlp.kernel is not None
            and attn.rotary.kernel is not None and attn.q_norm is None and hasattr(mlp.kernel, "fused_layer")):
        return None
    return FusedParts(
        kernel=mlp.kernel,
        ln2=ln2.weight,
        eps=ln2.eps,
        linears=[t for x in linears for t in packed_pair(x)],  # type: ignore[arg-type]
        widths=[x.out_features for x in linears],  # type: ignore[union-attr]
        heads=[attn.num_heads, attn.num_kv_heads, attn.head_dim],
        scale=attn.scale,
        isa=attn.qkv_proj.isa,  # type: ignore[union-attr]
        rotary=attn.rotary,
    )


_NONE = torch.empty(0)  # "no tensor" in the kernels' tensor lists


def packed_pair(x: PackedLinear) -> list[torch.Tensor]:
    """(packed weight, bias) as the C++ kernels take a linear."""
    return [x.packed, _NONE if x.bias is None else x.bias]


class ModelChain(NamedTuple):
    """A dense draft model's arguments for ``ops.cpu.model_chain`` that do not change between steps."""

    kernel: Any  # the compiled ops module
    embed: torch.Tensor  # [V, H] the embedding table
    layers: list[list[torch.Tensor]]  # per layer [input norm, post-attention norm, *FusedParts.linears]
    widths: list[int]  # the layers' linears' out features (FusedParts.widths)
    heads: list[int]  # [num_heads, num_kv_heads, head_dim]
    scale: float
    eps: float
    isa: int  # the GEMM path of every linear and the head
    norm: torch.Tensor  # the final norm's weight
    logits_head: list[torch.Tensor]  # (packed, bias)
    vocab: int
    cos_table: torch.Tensor  # [P, D] rotary tables in the model's dtype
    sin_table: torch.Tensor

    def args(self) -> tuple:
        """The arguments between the step's inputs and the KV caches, in the kernel's order."""
        return tuple(self)[1:]


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max(cfg.max_model_len, cfg.max_position_embeddings), cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = empty_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only LM. `forward` returns final (normed) hidden states [T, H] and, when
    `aux_layer_ids` is given, the residual stream after that many layers for each id (vLLM's
    convention: 0 is the embeddings, j the output of layer j - 1, so id j is also the stream entering
    layer j; `num_layers` is the last layer's output before the final norm)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head: nn.Module | None = (
            None if cfg.tie_word_embeddings else empty_linear(cfg.hidden_size, cfg.vocab_size)
        )
        self.tied_head: PackedLinear | None = None  # the embedding packed as the logits head (prepack)
        self._chain: ModelChain | None | bool = False  # `chain_form` (False: not resolved yet)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embedding_table(self) -> torch.Tensor:
        """The embedding table for the kernels' own lookups (``embedding_rows``): [V, H] row-major,
        or the tied head's packed table once `prepack` shares it."""
        embed = self.model.embed_tokens
        return embed.table if isinstance(embed, PackedEmbedding) else embed.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        aux_layer_ids: tuple[int, ...] = (),
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        delta = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual: torch.Tensor | None = None  # the stream is residual + delta (see forward_split)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layer_ids:  # EAGLE-3 reads the stream entering layer i: materialise it
                if residual is not None:
                    delta, residual = residual + delta, None
                captured[i] = delta
            delta, residual = layer.forward_split(delta, residual, kv_caches[i], meta)
        n = len(self.model.layers)
        if n in aux_layer_ids:  # id n: the last layer's output, before the final norm (vLLM's convention)
            if residual is not None:
                delta, residual = residual + delta, None
            captured[n] = delta
        normed = self.model.norm(delta) if residual is None else self.model.norm.add_forward(delta, residual)[0]
        # in the order the head lists them (a repeated id repeats its layer)
        return normed, [captured[i] for i in aux_layer_ids]

    def chain_form(self) -> ModelChain | None:
        """The arguments of ``ops.cpu.model_chain`` (a draft model's drafting passes in one call)
        when every layer has the one-call form with an input norm, the final norm is fused and the
        logits head packed on the layers' GEMM path; else None. Resolved once."""
        if self._chain is False:
            self._chain = self._resolve_chain()
        return self._chain  # type: ignore[return-value]

    def _resolve_chain(self) -> ModelChain | None:
        forms = [layer.fused_form() for layer in self.model.layers]
        head = self.lm_head if self.lm_head is not None else self.tied_head
        norm = self.model.norm
        if not forms or any(f is None or f.ln1 is None or f.parts.eps != norm.eps for f in forms):
            return None
        p = forms[0].parts  # type: ignore[union-attr]
        if norm.kernel is None or not isinstance(head, PackedLinear) or head.isa != p.isa:
            return None
        cos, sin = p.rotary.typed_tables(norm.weight.dtype)
        return ModelChain(
            kernel=p.kernel,
            embed=self.embedding_table(),
            layers=[[f.ln1, f.parts.ln2, *f.parts.linears] for f in forms],  # type: ignore[union-attr]
            widths=p.widths,
            heads=p.heads,
            scale=p.scale,
            eps=p.eps,
            isa=p.isa,
            norm=norm.weight,
            logits_head=packed_pair(head),
            vocab=head.out_features,
            cos_table=cos,
            sin_table=sin,
        )

    def draft_chain(
        self,
        ids: torch.Tensor,  # [R * q] the tokens of pass 1
        start: torch.Tensor,  # [R] int64: each request's first position in pass 1
        q: int,
        block_table: torch.Tensor,  # [R, W]
        block_size: int,
        passes: int,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [R, passes] greedy drafts
        """`passes` greedy drafting passes of this model in one C++ call (`chain_form` must be set):
        pass 1 over the [R, q] grid (drafting from each request's last row), then one token per
        request per pass — bitwise `forward` + `compute_logits` + argmax pass by pass."""
        chain = self.chain_form()
        assert chain is not None
        return chain.kernel.model_chain(ids, start, q, block_table, block_size, passes, *chain.args(), kv_caches)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:  # [N, H] -> [N, V]
        """float32 logits (sampling), or in the model's dtype with ``float32=False`` (an argmax
        needs no float32 copy: bf16 -> float32 is exact, so the answer is the same)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.tied_head is not None:
            logits = self.tied_head(hidden)
        else:
            logits = torch.nn.functional.linear(hidden, self.model.embed_tokens.weight)
        return logits.float() if float32 else logits

    def prepack(self) -> None:
        """bf16 on CPU: pack every linear, the experts and the logits head once, after loading, all
        on one GEMM path (``layers.linear``; the kernels' batch-invariant GEMM by default). A tied
        head packs the embedding; on the kernels' GEMM the lookup then reads that packed table and
        the row-major one is dropped (on oneDNN's path the lookup keeps it). No-op otherwise."""
        isa = cpu_ops.gemm_isa()
        if not prepack_supported(self.config.dtype, isa):
            return
        prepack_linears(self, isa)
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.prepack(isa)
        if self.lm_head is None:
            self.tied_head = PackedLinear(self.model.embed_tokens.weight, None, isa)
            if self.tied_head.isa:
                self.model.embed_tokens = PackedEmbedding(self.tied_head)

    # ---- checkpoint names -> parameters ---------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = map_hf_name(hf_name, self.config)
            if target is None:
                continue
            name, shard = target
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter ({name!r})")
            param = params[name]
            if shard is not None and ":" in shard:  # one expert of a stacked tensor
                expert, half = shard.split(":")
                first, last = self.get_submodule(name.rsplit(".", 1)[0]).expert_range
                if not first <= int(expert) < last:
                    continue  # another rank's expert (expert parallelism)
                shard = f"{int(expert) - first}:{half}"
            with torch.no_grad():
                _copy_shard(param, shard, tensor, self.config, hf_name)
            loaded.add(name if shard is None else f"{name}#{shard}")
        self._check_complete(params, loaded)

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = missing_weights(params, loaded)
        if missing:
            raise ValueError(f"checkpoint {self.config.path!r} lacks weights for: {missing[:8]}")


def _shards_needed(name: str, param: torch.Tensor) -> set[str] | None:
    """The shards (as `map_hf_name` names them) that fill parameter `name` when the checkpoint holds
    it in parts; None for a parameter loaded whole."""
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        return {"q", "k", "v"}
    if name.endswith("gate_up_proj.weight"):
        return {"gate", "up"}
    if name.endswith(".mlp.w13"):
        return {f"{e}:{half}" for e in range(param.shape[0]) for half in ("gate", "up")}
    if name.endswith(".mlp.w2"):
        return {f"{e}:None" for e in range(param.shape[0])}
    return None


def missing_weights(params: dict[str, nn.Parameter], loaded: set[str]) -> list[str]:
    """The parameters a load left (partly) unfilled: `loaded` holds each loaded name, or
    ``name#shard`` for a part of a fused or stacked one (q / k / v, gate / up, one expert's half),
    so a checkpoint with q_proj but no k_proj is caught, not served from unfilled memory."""
    whole: set[str] = set()
    parts: dict[str, set[str]] = {}
    for n in loaded:
        base, _, shard = n.partition("#")
        if shard:
            parts.setdefault(base, set()).add(shard)
        else:
            whole.add(base)
    missing = []
    for name, param in params.items():
        if name in whole:
            continue
        need = _shards_needed(name, param)
        lacking = sorted(need - parts.get(name, set())) if need is not None else None
        if lacking is None:
            missing.append(name)
        elif lacking:
            missing.append(f"{name} ({', '.join(lacking[:4])}{', ...' if len(lacking) > 4 else ''})")
    return missing


_EXPERT_RE = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_EXPERT_PARTS = {"w1": ("w13", "gate"), "gate_proj": ("w13", "gate"), "w3": ("w13", "up"),
                 "up_proj": ("w13", "up"), "w2": ("w2", None), "down_proj": ("w2", None)}


def map_hf_name(hf_name: str, cfg: ModelConfig) -> tuple[str, str | None] | None:
    """HF tensor name -> (our parameter name, shard) or None to skip (e.g. rotary buffers)."""
    if "rotary_emb" in hf_name:
        return None
    m = _EXPERT_RE.match(hf_name)
    if m:
        prefix, expert, part = m.groups()
        if part not in _EXPERT_PARTS:
            raise ValueError(f"unknown expert tensor {hf_name!r}")
        param, half = _EXPERT_PARTS[part]
        return f"{prefix}.mlp.{param}", f"{expert}:{half}"
    name = hf_name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, shard = _FUSED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard
    return name, None


def _copy_shard(param: torch.Tensor, shard: str | None, tensor: torch.Tensor, cfg: ModelConfig, hf_name: str) -> None:
    def put(dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"shape mismatch for {hf_name!r}: checkpoint {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src)

    if shard is None:
        put(param, tensor)
        return
    if ":" in shard:  # expert e of a stacked expert tensor
        expert_s, half = shard.split(":")
        moe_param = param
        e = int(expert_s)
        dst = moe_param[e]
        if half != "None":
            inter = dst.shape[0] // 2
            dst = dst[:inter] if half == "gate" else dst[inter:]
        put(dst, tensor)
        return
    q_size = cfg.num_heads * cfg.head_dim
    kv_size = cfg.num_kv_heads * cfg.head_dim
    if shard in ("q", "k", "v"):
        offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        start, size = offsets[shard]
        put(param[start : start + size], tensor)
    else:  # gate / up halves of gate_up_proj
        inter = param.shape[0] // 2
        put(param[:inter] if shard == "gate" else param[inter:], tensor)
