"""The EAGLE-1 / EAGLE-3 draft head as a plain PyTorch module for training, and its on-disk format.

Owns: `EagleHead` (one or more Llama decoder layers beside the target, with the training-time-test
forward `unrolled` that runs several drafting passes at every position at once, and a greedy
`draft_chain` for simulations), `head_config` (the config.json vLLM loads, from the target's Hugging
Face config), saving (`save_head`, vLLM's tensor names; a one-layer EAGLE-3 head's layer is
``midlayer``) and loading (`load_head`), and `grow_from` (a head continued with more layers).
Does not own: the engine's inference head (``models.eagle``, tested against this one), the
objective (``training.objective``) or the data (``training.distill``).

Both heads reuse the target's token embeddings (and EAGLE-1 its lm_head); positions and RoPE follow
the target's theta (default RoPE, ``rotate_half`` convention).

EAGLE-1 (``architectures: ["EagleLlamaForCausalLM"]``), input at position t is
(e = embed(x_{t+1}), f = target final hidden state at t, after the final norm)::

    x   = fc(cat(e, f))                      # fc.weight [H, 2H], no bias
    r   = x + attn(x)                        # layers.0.self_attn.*, no input_layernorm
    out = r + mlp(post_attention_layernorm(r))
    logits = target_lm_head(out)             # predicts x_{t+2}; no final norm
    # drafting step 2..k feeds `out` back as f

EAGLE-3 (``architectures: ["Eagle3LlamaForCausalLM"]``), target features are the
residual stream at three layers (vLLM ids: id j = output of layer j-1 =
HF ``hidden_states[j]``)::

    g   = fc(cat(a_low, a_mid, a_high))      # fc.weight [H, 3H], no bias (step 1 only)
    x   = cat(input_layernorm(e), hidden_norm(g))          # [2H]
    r   = g + attn(x)                        # q/k/v_proj in-features 2H
    pre = r + mlp(post_attention_layernorm(r))
    logits_draft = lm_head(norm(pre))        # [draft_vocab]; target id = i + d2t[i]
    # drafting step 2..k feeds `pre` back as g (fc is not applied again)
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    fr = pos.float()[..., None] * inv                     # [..., T, hd/2]
    emb = torch.cat([fr, fr], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    def __init__(self, in_features: int, hidden: int, n_heads: int, n_kv: int, head_dim: int):
        super().__init__()
        self.nh, self.nkv, self.hd = n_heads, n_kv, head_dim
        self.q_proj = nn.Linear(in_features, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)

    def qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def attend(self, q, ks, vs, mask):
        k = torch.cat(ks, dim=2)
        v = torch.cat(vs, dim=2)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def attend_chain(self, q, ks, vs, j: int, chain_ok):
        """Pass j of the training-time test (``EagleHead.unrolled``): the query at t attends to pass
        0's keys at positions <= t - j and to one key of each pass i = 1..j, its own chain's, at
        t - j + i (``chain_ok`` [T, j] bool: that position exists). ``q`` [B, nh, T, hd];
        ``ks[i]`` / ``vs[i]`` [B, nkv, T, hd]: pass i's keys / values.

        Equal to ``attend`` over the concatenated keys under the dense [T, T * (j + 1)] mask (the
        tests hold it to that), at a quarter of the work: see `ChainAttention`."""
        B, nh, T, hd = q.shape
        g = nh // self.nkv
        # RoPE's float32 tables promote q and k to float32 under autocast: attend in autocast's
        # dtype, as SDPA under autocast does (bf16 on CPUs with fast bf16 matmuls)
        dt = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype

        def heads(x):  # [B, nkv, T, ...] -> [B, nh, T, ...]: query head h reads key / value head h // g
            x = x.to(dt)
            return x.repeat_interleave(g, dim=1) if g > 1 else x

        # pass i's key for the chain through t sits at t - (j - i): shift it onto t
        ck = cv = None
        if j:
            ck = heads(torch.stack([F.pad(ks[i], (0, 0, j - i, 0))[:, :, :T] for i in range(1, j + 1)], dim=3))
            cv = heads(torch.stack([F.pad(vs[i], (0, 0, j - i, 0))[:, :, :T] for i in range(1, j + 1)], dim=3))
        o = ChainAttention.apply(q.to(dt), heads(ks[0]), heads(vs[0]), ck, cv, chain_ok, j, hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, nh * hd))


# ATen's CPU flash attention: (q, k, v, dropout, causal, scale=) -> (output, logsumexp [B, H, T] float32),
# and its backward: (dout, q, k, v, out, logsumexp, dropout, causal, scale=) -> (dq, dk, dv)
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class ChainAttention(torch.autograd.Function):
    """Softmax attention of each query t over two key sets: pass 0's keys at positions <= t - j
    (causal, shifted by j: ATen's flash kernel, which skips the masked half and never holds a T x T
    matrix) and j keys of its own (``ck`` / ``cv`` [B, H, T, j, hd]: the drafting chain's, scored as
    dot products; ``chain_ok`` [T, j] masks the ones before the sequence). The two parts are joined
    by their log-sum-exps. Backward: ATen's flash backward given the *joint* output and
    log-sum-exp yields exactly the first set's share of the joint softmax's gradient; the chain keys'
    share is computed here. The dense alternative (every pass's keys concatenated under a
    [T, T * (j + 1)] mask) does 4x the attention work for 3 passes and cannot skip masked blocks."""

    @staticmethod
    def forward(ctx, q, k0, v0, ck, cv, chain_ok, j: int, scale: float):  # noqa: ANN001, ANN205
        with torch.autocast("cpu", enabled=False):
            B, H, T, hd = q.shape
            if not j:  # pass 0: plain causal attention
                out, lse = _FLASH(q, k0, v0, 0.0, True, scale=scale)
                pc = None
            else:
                o0 = q.new_zeros(B, H, T, hd)
                lse0 = torch.full((B, H, T), float("-inf"))
                if T > j:
                    o_, l_ = _FLASH(q[:, :, j:], k0[:, :, : T - j], v0[:, :, : T - j], 0.0, True, scale=scale)
                    o0[:, :, j:] = o_
                    lse0[:, :, j:] = l_
                c = torch.einsum("bhtd,bhtjd->bhtj", q.float(), ck.float()).mul_(scale).masked_fill_(~chain_ok, float("-inf"))
                lse = torch.logaddexp(lse0, torch.logsumexp(c, dim=-1))
                pc = torch.exp(c - lse[..., None])  # [B, H, T, j] the chain keys' probabilities
                out = (torch.exp(lse0 - lse)[..., None] * o0.float()
                       + torch.einsum("bhtj,bhtjd->bhtd", pc, cv.float())).to(q.dtype)
        ctx.j, ctx.scale = j, scale
        ctx.save_for_backward(q, k0, v0, ck, cv, out, lse, pc)
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k0, v0, ck, cv, out, lse, pc = ctx.saved_tensors
        j, scale = ctx.j, ctx.scale
        with torch.autocast("cpu", enabled=False):
            T = q.shape[2]
            dout = dout.to(q.dtype).contiguous()
            if not j:
                dq, dk0, dv0 = _FLASH_BACKWARD(dout, q, k0, v0, out, lse, 0.0, True, scale=scale)
                return dq, dk0, dv0, None, None, None, None, None
            dq, dk0, dv0 = torch.zeros_like(q), torch.zeros_like(k0), torch.zeros_like(v0)
            if T > j:
                gq, gk, gv = _FLASH_BACKWARD(dout[:, :, j:], q[:, :, j:], k0[:, :, : T - j], v0[:, :, : T - j],
                                             out[:, :, j:], lse[:, :, j:].contiguous(), 0.0, True, scale=scale)
                dq[:, :, j:] = gq
                dk0[:, :, : T - j] = gk
                dv0[:, :, : T - j] = gv
            # the chain keys' share of the joint softmax's gradient
            d32 = dout.float()
            delta = (d32 * out.float()).sum(-1, keepdim=True)  # [B, H, T, 1], as the flash backward takes it
            ds = pc * (torch.einsum("bhtd,bhtjd->bhtj", d32, cv.float()) - delta)
            dq = (dq.float() + scale * torch.einsum("bhtj,bhtjd->bhtd", ds, ck.float())).to(q.dtype)
            dck = (scale * torch.einsum("bhtj,bhtd->bhtjd", ds, q.float())).to(ck.dtype)
            dcv = torch.einsum("bhtj,bhtd->bhtjd", pc, d32).to(cv.dtype)
        return dq, dk0, dv0, dck, dcv, None, None, None


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Layer 0 of a head takes the token embedding and the feature (EAGLE-3: two normed halves
    concatenated, EAGLE-1: fc's output, no input norm); layers 1.. are plain pre-norm Llama layers
    on the residual stream (vLLM's multi-layer EAGLE / EAGLE-3 heads)."""

    def __init__(self, cfg: dict, eagle3: bool, first: bool = True):
        super().__init__()
        H = cfg["hidden_size"]
        hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
        self.eagle3, self.first = eagle3, first
        self.self_attn = Attention(2 * H if eagle3 and first else H, H, cfg["num_attention_heads"],
                                   cfg["num_key_value_heads"], hd)
        self.mlp = MLP(H, cfg["intermediate_size"])
        self.post_attention_layernorm = RMSNorm(H, cfg["rms_norm_eps"])
        if eagle3 or not first:
            self.input_layernorm = RMSNorm(H, cfg["rms_norm_eps"])
        if eagle3 and first:
            self.hidden_norm = RMSNorm(H, cfg["rms_norm_eps"])


class EagleHead(nn.Module):
    """One EAGLE-1 (eagle3=False) or EAGLE-3 (eagle3=True) head of ``num_hidden_layers`` layers.

    Parameter names equal the on-disk names (a one-layer EAGLE-3 head's ``layers.0`` is saved as
    ``midlayer``).  ``embed`` / ``target_lm_head`` are the target's, frozen, and not saved.
    """

    def __init__(self, cfg: dict, eagle3: bool, embed: torch.Tensor, target_lm_head: torch.Tensor):
        super().__init__()
        self.cfg, self.eagle3 = cfg, eagle3
        H = cfg["hidden_size"]
        self.fc = nn.Linear((3 if eagle3 else 2) * H, H, bias=False)
        n = int(cfg.get("num_hidden_layers", 1))
        self.layers = nn.ModuleList([DecoderLayer(cfg, eagle3, first=i == 0) for i in range(n)])
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        if eagle3:
            dv = cfg["draft_vocab_size"]
            self.norm = RMSNorm(H, cfg["rms_norm_eps"])
            self.lm_head = nn.Linear(H, dv, bias=False)
            self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg["vocab_size"], dtype=torch.bool))
        else:
            self.register_buffer("target_lm_head", target_lm_head.detach().float().clone(), persistent=False)

    # ---- pieces of the forward
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: concat of the three target layers [.., 3H] -> [.., H]. EAGLE-1: identity."""
        return self.fc(aux) if self.eagle3 else aux

    def layer_in(self, tok: torch.Tensor, feat: torch.Tensor):
        """Layer 0's attention input and residual for token ids ``tok`` and (fused) features ``feat``."""
        e = F.embedding(tok, self.embed)
        lyr = self.layers[0]
        if self.eagle3:
            x = torch.cat([lyr.input_layernorm(e), lyr.hidden_norm(feat)], dim=-1)
            return x, feat
        x = self.fc(torch.cat([e, feat], dim=-1))
        return x, x

    def layer_out(self, attn_out, residual, li: int = 0):
        lyr = self.layers[li]
        r = residual + attn_out
        pre = r + lyr.mlp(lyr.post_attention_layernorm(r))
        return pre

    def forward_layers(self, tok, feat, cos, sin, ks: list[list], vs: list[list], attend):
        """All layers for one pass: appends each layer's new keys / values to ``ks[li]`` / ``vs[li]``
        and attends with ``attend(attention module, q, keys, values)`` over everything they hold.
        Returns ``pre`` [B, T, H]."""
        h = None
        for li, lyr in enumerate(self.layers):
            if li == 0:
                x, res = self.layer_in(tok, feat)
            else:
                x, res = lyr.input_layernorm(h), h
            q, k, v = lyr.self_attn.qkv(x, cos, sin)
            ks[li].append(k)
            vs[li].append(v)
            h = self.layer_out(attend(lyr.self_attn, q, ks[li], vs[li]), res, li)
        return h

    def causal_forward(self, tok: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """One pass over one sequence (no batch dim), causal, positions 0..T-1: ``pre`` [T, H]."""
        T = tok.shape[0]
        cos, sin = rope_cos_sin(torch.arange(T)[None], self.layers[0].self_attn.hd, self.cfg["rope_theta"])
        ks: list[list] = [[] for _ in self.layers]
        vs: list[list] = [[] for _ in self.layers]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        return self.forward_layers(tok[None], feat[None], cos[:, None], sin[:, None], ks, vs,
                                   lambda attn, q, k, v: attn.attend(q, k, v, mask))[0]

    def logits(self, pre: torch.Tensor) -> torch.Tensor:
        """Logits over the head's own vocabulary (target vocab for EAGLE-1, draft vocab for EAGLE-3)."""
        if self.eagle3:
            return self.lm_head(self.norm(pre))
        return pre @ self.target_lm_head.t()

    def target_logits(self, pre: torch.Tensor) -> torch.Tensor:
        lg = self.logits(pre)
        if not self.eagle3:
            return lg
        full = lg.new_full(lg.shape[:-1] + (self.cfg["vocab_size"],), float("-inf"))
        ids = torch.arange(lg.shape[-1]) + self.d2t
        full[..., ids] = lg
        return full

    def unrolled(self, tok: torch.Tensor, feat0: torch.Tensor, pos: torch.Tensor, passes: int):
        """Training-time-test forward. tok/feat0: [B,T], [B,T,H] (pass-0 inputs at each position).

        Returns the list of per-pass outputs ``pre`` [B,T,H]; pass j at position t
        uses as feature the pass j-1 output at t-1 and sees true-feature keys at
        positions <= t-j plus its own chain's keys of passes 1..j (in every layer).
        """
        B, T = tok.shape
        hd = self.layers[0].self_attn.hd
        cos, sin = rope_cos_sin(pos, hd, self.cfg["rope_theta"])
        cos, sin = cos[:, None], sin[:, None]
        t = torch.arange(T)
        ks: list[list] = [[] for _ in self.layers]
        vs: list[list] = [[] for _ in self.layers]
        outs = []
        feat = feat0
        for j in range(passes):
            chain_ok = t[:, None] >= (j - torch.arange(1, j + 1))[None, :]  # [T, j]: t - j + i >= 0
            pre = self.forward_layers(tok, feat, cos, sin, ks, vs,
                                      lambda attn, q, k, v, j=j, c=chain_ok: attn.attend_chain(q, k, v, j, c))
            outs.append(pre)
            # next pass: own output of the previous position replaces the feature
            nxt = torch.cat([feat0[:, :1], pre[:, :-1]], dim=1)
            feat = nxt
        return outs

    @torch.no_grad()
    def draft_chain(self, tok: torch.Tensor, feat0: torch.Tensor, k: int) -> list[int]:
        """Greedy chain drafting for one sequence (no batch dim).

        tok[t] = x_{t+1}, feat0[t] = (fused) target feature at t for t = 0..L-2
        (L = context length); returns k drafted target-token ids.
        """
        toks, feats = list(tok.tolist()), [feat0]
        drafted = []
        for _ in range(k):
            pre = self.causal_forward(torch.tensor(toks), torch.cat(feats, dim=0))[-1]
            nxt = int(self.target_logits(pre).argmax())
            drafted.append(nxt)
            toks.append(nxt)
            feats.append(pre[None])
        return drafted


# --------------------------------------------------------------------------- save / load
def target_rope_theta(target: Mapping[str, Any]) -> float:
    """The target's RoPE theta from a Hugging Face config dict (old or new spelling)."""
    theta = target.get("rope_theta") or (target.get("rope_parameters") or {}).get("rope_theta")
    return float(theta or 10000.0)


def head_config(target: Mapping[str, Any], eagle3: bool, draft_vocab: int | None, aux_ids: list[int] | None,
                num_layers: int = 1, intermediate_size: int | None = None, num_heads: int | None = None,
                num_kv_heads: int | None = None) -> dict:
    """The head's config.json (vLLM's format) from the target's Hugging Face config dict. The layer
    shape defaults to the target's (hidden size, heads, MLP width); a smaller MLP or fewer heads
    make a smaller, cheaper head (the head dimension stays the target's). Rotary embeddings are
    the default kind with the target's theta."""
    text = target.get("text_config") or {}
    target = {**text, **target}
    H = int(target["hidden_size"])
    heads = int(target["num_attention_heads"])
    head_dim = int(target.get("head_dim") or H // heads)
    theta = target_rope_theta(target)
    cfg = {
        "architectures": ["Eagle3LlamaForCausalLM" if eagle3 else "EagleLlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": int(intermediate_size or target["intermediate_size"]),
        "num_hidden_layers": num_layers,
        "num_attention_heads": int(num_heads or heads),
        "num_key_value_heads": int(num_kv_heads or target.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(target.get("max_position_embeddings", 4096)),
        "vocab_size": int(target["vocab_size"]),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "eos_token_id": target.get("eos_token_id"),
        "pad_token_id": target.get("pad_token_id"),
        "bos_token_id": None,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }
    if eagle3:
        cfg.update({
            "draft_vocab_size": draft_vocab,
            "target_hidden_size": H,
            "eagle_aux_hidden_state_layer_ids": aux_ids,
            "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": aux_ids},
        })
    return cfg


def state_dict_on_disk(head: EagleHead) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in head.state_dict().items():
        if name in ("embed", "target_lm_head"):
            continue
        disk = name
        if head.eagle3 and len(head.layers) == 1 and name.startswith("layers.0."):
            disk = "midlayer." + name[len("layers.0."):]
        if name in ("d2t", "t2d"):
            out[disk] = t.clone()
        else:
            out[disk] = t.detach().to(torch.bfloat16).contiguous()
    return out


def save_head(head: EagleHead, cfg: dict, out: Path, tok_dir: Path | None = None,
              extra: Mapping[str, Any] | None = None) -> None:
    """Write the head folder (config.json + model.safetensors, plus ``extra`` as training.json and
    the tokenizer files of ``tok_dir`` if given). The folder is built beside ``out`` and renamed
    into place, replacing an existing one: a reader sees the old head or the new one, never half."""
    from safetensors.torch import save_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(state_dict_on_disk(head), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if extra is not None:
        (tmp / "training.json").write_text(json.dumps(extra, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if tok_dir is not None and (Path(tok_dir) / f).exists():
            shutil.copy(Path(tok_dir) / f, tmp / f)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def load_head(path: str | Path, target: Any = None, *, embed: torch.Tensor | None = None,
              lm_head: torch.Tensor | None = None) -> EagleHead:
    """Load a saved head (fp32) next to a target: an HF model, or its embedding and output matrices."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    eagle3 = cfg["architectures"][0].startswith("Eagle3")
    if target is not None:
        embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert embed is not None and lm_head is not None, "load_head needs the target or its embed and lm_head"
    head = EagleHead(cfg, eagle3, embed, lm_head)
    sd = load_file(str(path / "model.safetensors"))
    fixed = {}
    for k, v in sd.items():
        if k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer."):]
        fixed[k] = v if v.dtype in (torch.long, torch.bool) else v.float()
    missing, unexpected = head.load_state_dict(fixed, strict=False)
    assert not unexpected and set(missing) <= {"embed", "target_lm_head"}, (missing, unexpected)
    head.eval()
    return head


def grow_from(head: EagleHead, prev: EagleHead, where: object = "the previous head") -> None:
    """Start ``head`` from ``prev``: the same configuration, or ``prev`` with fewer layers. The extra
    layers go on top and start as the identity (their ``o_proj`` and ``down_proj`` are zero, so the
    residual stream passes through): the grown head drafts exactly as ``prev`` until trained."""
    n_prev, n = len(prev.layers), len(head.layers)
    same = {k: v for k, v in prev.cfg.items() if k != "num_hidden_layers"} == {
        k: v for k, v in head.cfg.items() if k != "num_hidden_layers"
    }
    if not same or n_prev > n:
        raise ValueError(f"{where} was trained with another configuration ({n_prev} layers, {prev.cfg}); "
                         f"a head can continue from one with the same settings and at most as many layers")
    missing, unexpected = head.load_state_dict(prev.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all(k.startswith(tuple(f"layers.{i}." for i in range(n_prev, n))) for k in missing), missing
    with torch.no_grad():
        for lyr in list(head.layers)[n_prev:]:
            lyr.self_attn.o_proj.weight.zero_()
            lyr.mlp.down_proj.weight.zero_()


