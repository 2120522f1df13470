"""EAGLE-1 and EAGLE-3 draft heads for phalanx-math (plain PyTorch, vLLM on-disk format).

Both heads are one Llama decoder layer that runs beside the target and reuses
its token embeddings (and, for EAGLE-1, its lm_head).  Positions and RoPE are
the target's (Llama default RoPE, ``rotate_half`` convention).

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

Training: target-generated text (greedy answers of the target to train
questions), target features computed once, "training-time test" unrolling of
``--passes`` drafting steps with the matching attention mask (step j at
position t sees true-feature keys at positions <= t-j and its own earlier
steps' keys). EAGLE-1: smooth-L1 regression of ``out`` on the target's final
hidden state at t+1, + 0.5 x token CE. EAGLE-3: soft labels (the target's
distribution over the draft vocabulary, as the reference trainer uses) + the
same regression applied to ``norm(pre)`` (the head's lm_head starts from the
target's rows, so matching the target's final hidden state means matching its
logits), with ``fc`` initialised so that the fused feature starts at RMS 1.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from phalanx.demo import MODELS_DIR

TARGET = "phalanx-math"


# --------------------------------------------------------------------------- modules
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

    def forward_layers(self, tok, feat, cos, sin, ks: list[list], vs: list[list], mask):
        """All layers for one pass: appends each layer's new keys / values to ``ks[li]`` / ``vs[li]``
        and attends over everything they hold under ``mask``. Returns ``pre`` [B, T, H]."""
        h = None
        for li, lyr in enumerate(self.layers):
            if li == 0:
                x, res = self.layer_in(tok, feat)
            else:
                x, res = lyr.input_layernorm(h), h
            q, k, v = lyr.self_attn.qkv(x, cos, sin)
            ks[li].append(k)
            vs[li].append(v)
            h = self.layer_out(lyr.self_attn.attend(q, ks[li], vs[li], mask), res, li)
        return h

    def causal_forward(self, tok: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """One pass over one sequence (no batch dim), causal, positions 0..T-1: ``pre`` [T, H]."""
        T = tok.shape[0]
        cos, sin = rope_cos_sin(torch.arange(T)[None], self.layers[0].self_attn.hd, self.cfg["rope_theta"])
        ks: list[list] = [[] for _ in self.layers]
        vs: list[list] = [[] for _ in self.layers]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        return self.forward_layers(tok[None], feat[None], cos[:, None], sin[:, None], ks, vs, mask)[0]

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
            masks = [t[None, :] <= (t[:, None] - j)]          # pass-0 keys
            for i in range(1, j + 1):
                masks.append(t[None, :] == (t[:, None] - j + i))
            mask = torch.cat(masks, dim=1)                     # [T, T*(j+1)]
            pre = self.forward_layers(tok, feat, cos, sin, ks, vs, mask)
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
def head_config(target_cfg, eagle3: bool, draft_vocab: int | None, aux_ids: list[int] | None,
                num_layers: int = 1) -> dict:
    H = target_cfg.hidden_size
    cfg = {
        "architectures": ["Eagle3LlamaForCausalLM" if eagle3 else "EagleLlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": target_cfg.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target_cfg.num_attention_heads,
        "num_key_value_heads": target_cfg.num_key_value_heads,
        "head_dim": H // target_cfg.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "vocab_size": target_cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "eos_token_id": target_cfg.eos_token_id,
        "pad_token_id": target_cfg.pad_token_id,
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


def save_head(head: EagleHead, cfg: dict, out: Path, tok_dir: Path) -> None:
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file(state_dict_on_disk(head), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tok_dir) / f).exists():
            shutil.copy(Path(tok_dir) / f, out / f)


def load_head(path, target) -> EagleHead:
    """Load a saved head (fp32) next to an HF target model."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    eagle3 = cfg["architectures"][0].startswith("Eagle3")
    emb = target.get_input_embeddings().weight
    head = EagleHead(cfg, eagle3, emb, target.get_output_embeddings().weight)
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


# --------------------------------------------------------------------------- features
@torch.no_grad()
def target_features(target, ids: torch.Tensor, att: torch.Tensor, aux_ids: list[int]):
    """(final hidden after norm [B,T,H], concat of aux layers [B,T,3H]).

    Aux id j is the residual stream after j target layers (vLLM's convention: 0 the embeddings,
    ``num_layers`` the last layer's output *before* the final norm). HF's ``hidden_states[j]`` is
    that for j < num_layers, but its last entry is taken after the norm, so id ``num_layers`` is
    read from the last decoder layer's output instead."""
    n = len(target.model.layers)
    last_out: list[torch.Tensor] = []
    hook = None
    if n in (aux_ids or ()):
        hook = target.model.layers[-1].register_forward_hook(
            lambda _m, _i, o: last_out.append(o[0] if isinstance(o, tuple) else o))
    try:
        out = target.model(input_ids=ids, attention_mask=att, output_hidden_states=True)
    finally:
        if hook is not None:
            hook.remove()
    hs = out.hidden_states
    aux = torch.cat([last_out[0] if i == n else hs[i] for i in aux_ids], dim=-1) if aux_ids else None
    return out.last_hidden_state, aux


def default_aux_ids(n_layers: int) -> list[int]:
    """Low / middle / top residual-stream ids (vLLM convention, distinct, <= n_layers): the top one is
    the last layer's output (id n_layers), the feature EAGLE-1 reads, before the final norm."""
    ids = [1, n_layers // 2, n_layers]
    assert len(set(ids)) == 3
    return ids


# --------------------------------------------------------------------------- training
# One decoder layer each. EAGLE-3 reads the low / middle target layers and the last layer's output
# (aux id num_layers: the feature EAGLE-1 reads, before the final norm); while its ids stopped at the
# stream entering the last layer, one layer stalled at 3.55 accepted tokens per step on the 6-layer
# demo target and two reached ~3.87 against EAGLE-1's 3.90 (docs/demo-models.md).
HEAD_LAYERS = {"eagle": 1, "eagle3": 1}
# The committed heads' recipes: (steps, peak lr, layers, labels) per stage; stage i > 0 continues
# from stage i - 1's saved head with a fresh optimizer and schedule (a stage may grow the head:
# more layers than the stage before, `grow_from`).
HEAD_STAGES: dict[str, list[tuple[int, float, int, str]]] = {
    "eagle": [(2400, 2e-3, 1, "hard")],
    "eagle3": [(2400, 2e-3, 1, "soft"), (2400, 1e-3, 1, "hard"), (1600, 5e-4, 1, "hard")],
}
assert all(stages[-1][2] == HEAD_LAYERS[k] for k, stages in HEAD_STAGES.items())


def committed_name(kind: str) -> str:
    return "phalanx-math-eagle3" if kind == "eagle3" else "phalanx-math-eagle"


def train_committed(kind: str, seed: int = 0, threads: int = 2, resume_stage: int = 0) -> list[dict]:
    """Build the committed ``kind`` head: every stage of `HEAD_STAGES[kind]` from ``resume_stage``
    on (a resumed stage continues from the committed folder)."""
    name = committed_name(kind)
    out = []
    for i, (steps, lr, layers, labels) in enumerate(HEAD_STAGES[kind]):
        if i < resume_stage:
            continue
        init = str(MODELS_DIR / name) if i > 0 else None
        out.append(train(kind, seed, steps, lr=lr, threads=threads, init_from=init, layers=layers, labels=labels))
    return out


def train(kind: str, seed: int = 0, steps: int | None = None, n_seqs: int | None = None, batch: int = 32,
          passes: int = 3, lr: float = 2e-3, draft_vocab: int = 512, threads: int = 2, bf16: bool = True,
          aux_ids: list[int] | None = None, out_name: str | None = None, layers: int | None = None,
          init_from: str | None = None, labels: str | None = None) -> dict:
    """Train an EAGLE head on the target's own greedy answers.

    ``bf16``: bfloat16 autocast for the head's forward (fp32 master weights); ``threads``: torch
    threads for the training loop (the target features are computed in fp32 either way);
    ``aux_ids`` / ``out_name``: EAGLE-3 target layers and output folder, for experiments;
    ``layers``: decoder layers in the head (default `HEAD_LAYERS[kind]`; the defaults build the
    committed heads); ``init_from``: a saved head folder to continue from (a second stage with a
    fresh optimizer and schedule; its loss curve is prepended from ``<name>-curve.json``);
    ``labels``: EAGLE-3's token loss, ``soft`` (default: cross-entropy against the target's
    distribution over the draft vocabulary) or ``hard`` (against the target's greedy token, as
    EAGLE-1 trains: what greedy acceptance counts).
    """
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from phalanx.demo.common import (
        IMG_DIR,
        TOK_DIR,
        WORK_DIR,
        Timer,
        collate,
        load_tokenizer,
        plot_curves,
        setup,
        smooth,
    )
    from phalanx.demo.tokenizer import prompt_text
    from phalanx.demo.train import N_DISTILL, distill_rows

    eagle3 = kind == "eagle3"
    labels = labels or ("soft" if eagle3 else "hard")
    if labels not in ("soft", "hard") or (labels == "soft" and not eagle3):
        raise ValueError(f"labels={labels!r}: EAGLE-3 heads train on 'soft' or 'hard' labels, EAGLE-1 on 'hard'")
    name = out_name or committed_name(kind)
    steps = steps or 2400
    rows = distill_rows(seed, n_seqs or N_DISTILL)
    setup(seed)
    tok = load_tokenizer()
    target = AutoModelForCausalLM.from_pretrained(MODELS_DIR / TARGET, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tcfg = target.config
    aux_ids = aux_ids or default_aux_ids(tcfg.num_hidden_layers)

    # sequences: prompt + target answer + <|end|>; answer_start for the loss mask
    seqs, starts = [], []
    for r in rows:
        p = tok(prompt_text(r["question"]), add_special_tokens=False)["input_ids"]
        a = tok(r["answer"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        seqs.append(p + a)
        starts.append(len(p))

    # draft vocabulary for EAGLE-3: the most frequent target tokens in the answers
    d2t = t2d = None
    if eagle3:
        cnt = torch.zeros(tcfg.vocab_size, dtype=torch.long)
        for s, st in zip(seqs, starts):
            cnt += torch.bincount(torch.tensor(s[st:]), minlength=tcfg.vocab_size)
        order = torch.argsort(cnt, descending=True, stable=True)[:draft_vocab]
        keep = torch.sort(order).values                            # draft id i -> target id keep[i]
        d2t = keep - torch.arange(draft_vocab)
        t2d = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
        t2d[keep] = True
        tgt2draft = torch.full((tcfg.vocab_size,), -100, dtype=torch.long)
        tgt2draft[keep] = torch.arange(draft_vocab)
        cover = cnt[keep].sum().item() / cnt.sum().item()
        print(f"draft vocab {draft_vocab}/{tcfg.vocab_size}: covers {cover * 100:.2f}% of answer tokens", flush=True)

    layers = layers or HEAD_LAYERS[kind]
    cfg = head_config(tcfg, eagle3, draft_vocab if eagle3 else None, aux_ids if eagle3 else None, layers)
    head = EagleHead(cfg, eagle3, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    if eagle3:
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        with torch.no_grad():
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[keep])
            head.norm.weight.copy_(target.model.norm.weight)
    nparams = sum(p.numel() for p in head.parameters())
    print(f"{name}: {nparams / 1e6:.3f}M parameters, {len(seqs)} target-generated sequences, "
          f"{steps} steps x batch {batch}, {passes} unrolled passes", flush=True)

    # target features once, kept in memory (bf16)
    feats = []
    with Timer("target features"):
        for s in tqdm(range(0, len(seqs), 64), desc="features", mininterval=5):
            chunk = seqs[s:s + 64]
            ids, att, _ = collate(chunk, None, tok.pad_token_id)
            last, aux = target_features(target, ids, att, aux_ids)
            for i, sq in enumerate(chunk):
                f = aux[i, :len(sq)] if eagle3 else last[i, :len(sq)]
                feats.append((f.to(torch.bfloat16), last[i, :len(sq)].to(torch.bfloat16)))

    prior_curve = {"train": [], "val": [], "stages": []}
    if init_from is not None:
        prev = load_head(init_from, target)
        grow_from(head, prev, init_from)
        curve_file = WORK_DIR / "results" / f"{Path(init_from).name}-curve.json"
        if curve_file.exists():
            prior_curve = json.loads(curve_file.read_text())
    elif eagle3:
        # The target's residual stream is large (RMS ~80 after layer 0 here, against ~1 for the head's
        # own activations) and g is also the head's residual: start g at RMS 1. (Measured: the first
        # 150-300 steps' CE is the same either way; the gap to EAGLE-1 is not an init problem.)
        with torch.no_grad():
            sample = torch.cat([f for f, _ in feats[:64]]).float()
            head.fc.weight.mul_(1.0 / head.fc(sample).pow(2).mean().sqrt())
    val_n = 256
    tr_idx = list(range(val_n, len(seqs)))
    rng = random.Random(seed)
    # Adam moves every weight by about lr per step whatever its size. EAGLE-3's fc reads the target's
    # raw residual stream (RMS ~65-85 here, against ~1 for every other input of the head), so its
    # weights are that many times smaller than the head's others and need steps that much smaller:
    # at the common lr each step rewrote fc by several times its own size and the first drafting
    # pass (the only one through fc) stalled at a validation CE of ~0.25 while passes 2-3, fed
    # the head's own output, reached 0.16.
    fc_lr_scale = 1.0
    if eagle3:
        fc_lr_scale = 1.0 / float(torch.cat([f for f, _ in feats[:64]]).float().pow(2).mean().sqrt())
        print(f"EAGLE-3 fc learning-rate scale 1/RMS(features) = {fc_lr_scale:.4f}", flush=True)
    other = [p for p in head.parameters() if p.requires_grad and p is not head.fc.weight]
    opt = torch.optim.AdamW([{"params": other, "lr_scale": 1.0}, {"params": [head.fc.weight], "lr_scale": fc_lr_scale}],
                            lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    from phalanx.demo.common import lr_at

    def batch_tensors(idx):
        L = max(len(seqs[i]) for i in idx) - 1
        B = len(idx)
        Hf = feats[idx[0]][0].shape[-1]
        tok_in = torch.zeros(B, L, dtype=torch.long)
        f0 = torch.zeros(B, L, Hf)
        f_next = torch.zeros(B, L, tcfg.hidden_size)
        lab = torch.full((B, L), -100, dtype=torch.long)
        for b, i in enumerate(idx):
            s = torch.tensor(seqs[i])
            n = len(s) - 1
            tok_in[b, :n] = s[1:]                              # e(x_{t+1})
            f0[b, :n] = feats[i][0][:n].float()                # f_t
            f_next[b, :n - 1] = feats[i][1][1:n].float()       # f_{t+1} (regression target, final hidden)
            y = s[2:].clone()                                  # x_{t+2}
            y[: max(0, starts[i] - 2)] = -100                  # loss only where x_{t+2} is in the answer
            lab[b, :n - 1] = y
        if eagle3:
            lab = torch.where(lab >= 0, tgt2draft[lab.clamp(min=0)], lab)
        pos = torch.arange(L)[None].expand(B, L)
        return tok_in, f0, f_next, lab, pos

    pass_w = [0.8 ** j for j in range(passes)]
    # EAGLE-3: the target's lm_head rows of the draft vocabulary (for its soft labels)
    keep_head = target.get_output_embeddings().weight.detach()[keep].float() if eagle3 else None

    def loss_fn(idx, train_mode=True):
        tok_in, f0, f_next, lab, pos = batch_tensors(idx)
        feat0 = head.fuse(f0)
        outs = head.unrolled(tok_in, feat0, pos, passes)
        total, parts = 0.0, []
        for j, pre in enumerate(outs):
            lg = head.logits(pre)
            lab_j = lab.clone()
            lab_j[:, :j] = -100                                # pass j needs a real chain start
            ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab_j.reshape(-1), ignore_index=-100)
            m = (lab_j >= 0).unsqueeze(-1).float()
            if eagle3:
                # soft labels over the draft vocabulary, plus the normed output regressed on the
                # target's final (normed) hidden state at t+1, which the head's lm_head (initialised
                # from the target's rows) turns into the target's own logits
                target_p = torch.softmax(f_next @ keep_head.t(), dim=-1)
                soft = -(target_p * torch.log_softmax(lg.float(), dim=-1)).sum(-1, keepdim=True)
                soft = (soft * m).sum() / m.sum()
                normed = head.norm(pre)
                reg = (F.smooth_l1_loss(normed, f_next, reduction="none") * m).sum() / (m.sum() * pre.shape[-1])
                loss = reg + 0.5 * (soft if labels == "soft" else ce)
            else:
                reg = (F.smooth_l1_loss(pre, f_next, reduction="none") * m).sum() / (m.sum() * pre.shape[-1])
                loss = reg + 0.5 * ce
            total = total + pass_w[j] * loss
            parts.append(ce.item())
        return total / sum(pass_w), parts

    offset = sum(st["steps"] for st in prior_curve["stages"])
    train_pts = [tuple(x) for x in prior_curve["train"]]
    val_pts = [tuple(x) for x in prior_curve["val"]]
    batches: list[list[int]] = []
    torch.set_num_threads(threads)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    t0 = time.time()
    bar = tqdm(range(steps), desc=name, mininterval=5)
    for step in bar:
        if not batches:
            order = tr_idx[:]
            rng.shuffle(order)
            batches = [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]
        idx = batches.pop()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=min(50, steps // 10)) * g["lr_scale"]
        with autocast:
            loss, parts = loss_fn(idx)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_pts.append((offset + step, loss.item()))
        bar.set_postfix(loss=f"{loss.item():.3f}", ce=",".join(f"{c:.2f}" for c in parts))
        if (step + 1) % 150 == 0 or step + 1 == steps:
            with torch.no_grad():
                vl, vparts = loss_fn(list(range(0, 128)))
            val_pts.append((offset + step, vl.item()))
            print(f"\nstep {step + 1}: train {loss.item():.4f} val {vl.item():.4f} val-ce/pass "
                  f"{[round(c, 3) for c in vparts]} ({time.time() - t0:.0f}s)", flush=True)
    train_time = time.time() - t0
    head.eval()
    save_head(head, cfg, MODELS_DIR / name, TOK_DIR)
    plot_curves(IMG_DIR / f"{name}-loss.png", {"train (smoothed)": smooth(train_pts), "validation": val_pts},
                f"{name} ({nparams / 1e6:.2f}M params)")
    stages = prior_curve["stages"] + [{"steps": steps, "lr": lr, "layers": layers, "labels": labels,
                                       "train_time_s": round(train_time)}]
    res = {"name": name, "params": nparams, "steps": offset + steps, "batch": batch, "passes": passes,
           "layers": layers, "stages": stages, "train_time_s": sum(st["train_time_s"] for st in stages),
           "final_val_loss": val_pts[-1][1], "seed": seed, "aux_ids": aux_ids if eagle3 else None,
           "labels": labels}
    print(json.dumps(res), flush=True)
    (WORK_DIR / "results").mkdir(parents=True, exist_ok=True)
    (WORK_DIR / "results" / f"{name}-curve.json").write_text(
        json.dumps({"train": train_pts, "val": val_pts, "stages": stages}))
    (WORK_DIR / "results" / f"{name}.json").write_text(json.dumps(res, indent=1))
    return res
