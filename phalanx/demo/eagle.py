"""EAGLE-1 and EAGLE-3 heads for phalanx-math: the committed heads' recipes and their trainer.

Owns: `HEAD_STAGES` (the committed heads' stages), `train` (one stage: the target's greedy answers
to train questions, its features from the Hugging Face model kept in memory, then the shared loop),
`target_features` (a target's hidden states from transformers, the reference the engine's aux
layers are tested against) and `head_config` for an HF target.
Does not own: the head module and its on-disk format (``phalanx.training.head``, re-exported here),
the objective with the training-time test (``phalanx.training.objective``) or the loop
(``phalanx.training.loop``) — the same ones `phalanx train-eagle` uses for any target.

Training: target-generated text (greedy answers of the target to train questions), target features
computed once, "training-time test" unrolling of ``passes`` drafting steps (see
``phalanx.training.objective``). EAGLE-1: smooth-L1 regression of ``out`` on the target's final
hidden state at t+1, + 0.5 x token CE. EAGLE-3: soft labels (the target's distribution over the
draft vocabulary) or hard ones + the same regression applied to ``norm(pre)``, with ``fc``
initialised so that the fused feature starts at RMS 1 and its learning rate scaled by 1/RMS(features).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from phalanx.demo import MODELS_DIR
from phalanx.training.head import (  # noqa: F401 - re-exported: the demo's public names
    MLP,
    Attention,
    DecoderLayer,
    EagleHead,
    RMSNorm,
    grow_from,
    load_head,
    rope_cos_sin,
    rotate_half,
    save_head,
    state_dict_on_disk,
)
from phalanx.training.head import head_config as _head_config
from phalanx.training.objective import IGNORE, EagleBatch, Objective

TARGET = "phalanx-math"


def head_config(target_cfg, eagle3: bool, draft_vocab: int | None, aux_ids: list[int] | None,
                num_layers: int = 1) -> dict:
    """The head's config.json for a transformers target config (the target's layer shapes)."""
    return _head_config(target_cfg.to_dict(), eagle3, draft_vocab, aux_ids, num_layers)


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
    from transformers import AutoModelForCausalLM

    from phalanx.demo.common import IMG_DIR, TOK_DIR, WORK_DIR, load_tokenizer, plot_curves, setup, smooth
    from phalanx.demo.train import N_DISTILL, distill_rows
    from phalanx.training.loop import LoopConfig, LoopState, TrainLoop

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
    seqs, starts = _sequences(tok, rows)
    keep = _draft_vocab(seqs, starts, tcfg.vocab_size, draft_vocab) if eagle3 else None

    layers = layers or HEAD_LAYERS[kind]
    cfg = head_config(tcfg, eagle3, draft_vocab if eagle3 else None, aux_ids if eagle3 else None, layers)
    lm_head = target.get_output_embeddings().weight
    head = EagleHead(cfg, eagle3, target.get_input_embeddings().weight, lm_head)
    if eagle3:
        head.d2t.copy_(keep - torch.arange(draft_vocab))
        head.t2d.copy_(torch.zeros(tcfg.vocab_size, dtype=torch.bool).index_fill_(0, keep, True))
        with torch.no_grad():
            head.lm_head.weight.copy_(lm_head[keep])
            head.norm.weight.copy_(target.model.norm.weight)
    nparams = sum(p.numel() for p in head.parameters())
    print(f"{name}: {nparams / 1e6:.3f}M parameters, {len(seqs)} target-generated sequences, "
          f"{steps} steps x batch {batch}, {passes} unrolled passes", flush=True)
    feats = _features(target, tok, seqs, aux_ids, eagle3)

    prior_curve = {"train": [], "val": [], "stages": []}
    if init_from is not None:
        grow_from(head, load_head(init_from, target), init_from)
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

    objective = Objective(passes=passes, labels=labels)
    teacher_rows = lm_head.detach()[keep].float() if eagle3 else None
    to_draft = None
    if eagle3:
        to_draft = torch.full((tcfg.vocab_size,), IGNORE, dtype=torch.long)
        to_draft[keep] = torch.arange(draft_vocab)
    val_n = 256
    next_batch = _shuffled_batches(list(range(val_n, len(seqs))), batch, random.Random(seed))

    def make(idx: list[int]) -> EagleBatch:
        return _batch(seqs, starts, feats, idx, tcfg.hidden_size)

    def loss_fn(b: EagleBatch) -> tuple[torch.Tensor, str]:
        loss, stats = objective(head, b, teacher_rows, to_draft)
        return loss, "ce " + ",".join(f"{p.mean_ce:.2f}" for p in stats.passes)

    offset = sum(st["steps"] for st in prior_curve["stages"])
    state = LoopState(0, [tuple(x) for x in prior_curve["train"]], [tuple(x) for x in prior_curve["val"]])
    t0 = time.time()

    def eval_fn(step: int) -> float:
        vl, vstats = objective(head, make(list(range(0, 128))), teacher_rows, to_draft)
        print(f"\nstep {step + 1}: train {state.train_curve[-1][1]:.4f} val {float(vl):.4f} val-ce/pass "
              f"{[round(p.mean_ce, 3) for p in vstats.passes]} ({time.time() - t0:.0f}s)", flush=True)
        return float(vl)

    loop = TrainLoop(LoopConfig(steps=steps, lr=lr, warmup=min(50, steps // 10), bf16=bf16, threads=threads,
                                eval_every=150, desc=name, curve_offset=offset),
                     head, opt, lambda step: make(next_batch()), loss_fn, eval_fn)
    state = loop.run(state)
    train_time = time.time() - t0
    head.eval()
    save_head(head, cfg, MODELS_DIR / name, TOK_DIR)
    plot_curves(IMG_DIR / f"{name}-loss.png", {"train (smoothed)": smooth(state.train_curve),
                                               "validation": state.val_curve},
                f"{name} ({nparams / 1e6:.2f}M params)")
    stages = prior_curve["stages"] + [{"steps": steps, "lr": lr, "layers": layers, "labels": labels,
                                       "train_time_s": round(train_time)}]
    res = {"name": name, "params": nparams, "steps": offset + steps, "batch": batch, "passes": passes,
           "layers": layers, "stages": stages, "train_time_s": sum(st["train_time_s"] for st in stages),
           "final_val_loss": state.val_curve[-1][1], "seed": seed, "aux_ids": aux_ids if eagle3 else None,
           "labels": labels}
    print(json.dumps(res), flush=True)
    (WORK_DIR / "results").mkdir(parents=True, exist_ok=True)
    (WORK_DIR / "results" / f"{name}-curve.json").write_text(
        json.dumps({"train": state.train_curve, "val": state.val_curve, "stages": stages}))
    (WORK_DIR / "results" / f"{name}.json").write_text(json.dumps(res, indent=1))
    return res


# ---- the steps of `train` -----------------------------------------------------------------------
def _sequences(tok, rows: list[dict]) -> tuple[list[list[int]], list[int]]:
    """prompt + target answer + <|end|> per row, and where each answer starts (the loss mask)."""
    from phalanx.demo.tokenizer import prompt_text

    seqs, starts = [], []
    for r in rows:
        p = tok(prompt_text(r["question"]), add_special_tokens=False)["input_ids"]
        a = tok(r["answer"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        seqs.append(p + a)
        starts.append(len(p))
    return seqs, starts


def _draft_vocab(seqs: list[list[int]], starts: list[int], vocab: int, size: int) -> torch.Tensor:
    """EAGLE-3's draft vocabulary: the `size` most frequent target tokens in the answers, sorted."""
    from phalanx.training.eagle import draft_vocabulary

    cnt = torch.zeros(vocab, dtype=torch.long)
    for s, st in zip(seqs, starts):
        cnt += torch.bincount(torch.tensor(s[st:]), minlength=vocab)
    dv = draft_vocabulary(cnt, size)
    print(f"draft vocab {size}/{vocab}: covers {dv.coverage * 100:.2f}% of answer tokens", flush=True)
    return dv.keep


def _features(target, tok, seqs: list[list[int]], aux_ids: list[int], eagle3: bool
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(pass-0 feature, final hidden state) per sequence, bf16, computed once with transformers."""
    from tqdm import tqdm

    from phalanx.demo.common import Timer, collate

    feats = []
    with Timer("target features"):
        for s in tqdm(range(0, len(seqs), 64), desc="features", mininterval=5):
            chunk = seqs[s:s + 64]
            ids, att, _ = collate(chunk, None, tok.pad_token_id)
            last, aux = target_features(target, ids, att, aux_ids)
            for i, sq in enumerate(chunk):
                f = aux[i, :len(sq)] if eagle3 else last[i, :len(sq)]
                feats.append((f.to(torch.bfloat16), last[i, :len(sq)].to(torch.bfloat16)))
    return feats


def _shuffled_batches(indices: list[int], batch: int, rng: random.Random):
    """A function returning the next batch of indices: each epoch a new shuffle, the last partial
    batch dropped."""
    batches: list[list[int]] = []

    def nxt() -> list[int]:
        if not batches:
            order = indices[:]
            rng.shuffle(order)
            batches.extend(order[i:i + batch] for i in range(0, len(order) - batch + 1, batch))
        return batches.pop()

    return nxt


def _batch(seqs: list[list[int]], starts: list[int], feats: list, idx: list[int], hidden: int) -> EagleBatch:
    """Position t is fed e(x_{t+1}) and f_t and learns x_{t+2} where that is an answer token."""
    L = max(len(seqs[i]) for i in idx) - 1
    B = len(idx)
    Hf = feats[idx[0]][0].shape[-1]
    tok_in = torch.zeros(B, L, dtype=torch.long)
    f0 = torch.zeros(B, L, Hf)
    f_next = torch.zeros(B, L, hidden)
    lab = torch.full((B, L), IGNORE, dtype=torch.long)
    for b, i in enumerate(idx):
        s = torch.tensor(seqs[i])
        n = len(s) - 1
        tok_in[b, :n] = s[1:]                              # e(x_{t+1})
        f0[b, :n] = feats[i][0][:n].float()                # f_t
        f_next[b, :n - 1] = feats[i][1][1:n].float()       # f_{t+1} (regression target, final hidden)
        y = s[2:].clone()                                  # x_{t+2}
        y[: max(0, starts[i] - 2)] = IGNORE                # loss only where x_{t+2} is in the answer
        lab[b, :n - 1] = y
    pos = torch.arange(L)[None].expand(B, L)
    first = torch.tensor([max(0, starts[i] - 1) for i in idx], dtype=torch.int64)  # the engine's first chain
    return EagleBatch(tok_in, f0, f_next, lab, pos, first)


__all__ = ["EagleHead", "default_aux_ids", "grow_from", "head_config", "load_head", "save_head",
           "target_features", "train", "train_committed"]
