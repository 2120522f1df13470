"""Train the phalanx-math demo models (CPU; each stage on the shared loop, ``phalanx.training.loop``).

    python -m phalanx.demo.train target     [--seed 0]   # LlamaForCausalLM, the target
    python -m phalanx.demo.train draft      [--seed 0]   # small Llama draft, distilled on target outputs
    python -m phalanx.demo.train eagle      [--seed 0]   # EAGLE-1 head on target hidden states
    python -m phalanx.demo.train eagle3     [--seed 0]   # EAGLE-3 head on target hidden states
    python -m phalanx.demo.train moe        [--seed 0]   # MixtralForCausalLM (4 experts, top-2)
    python -m phalanx.demo.train moe-draft  [--seed 0]   # small Mixtral draft

Data and tokenizer come from ``build/demo`` (``python -m phalanx.demo.build_all``
creates them). Models are written to ``phalanx/demo/models/<name>/`` in bfloat16,
loss curves to ``docs/img/``.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from phalanx.demo import MODELS_DIR
from phalanx.demo.common import (
    DATA_DIR,
    IMG_DIR,
    WORK_DIR,
    Timer,
    collate,
    encode_example,
    length_batches,
    load_rows,
    load_tokenizer,
    plot_curves,
    save_hf,
    setup,
    smooth,
)
from phalanx.training.loop import LoopConfig, LoopState, TrainLoop

N_DISTILL = 8000  # train questions answered by the target (draft distillation, EAGLE training text)

# name -> (architecture, config kwargs, training kwargs)
SPECS = {
    # stage 0 ran in fp32 on one thread; stage 1 uses bf16 autocast (AVX-512-BF16) on both cores,
    # 2.5x the steps per second (0.37 vs 0.92 s/step at batch 32)
    "phalanx-math": ("llama", dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2),
                     dict(stages=[dict(steps=2000, batch=32, lr=2e-3),
                                  dict(steps=6000, batch=32, lr=1.5e-3, bf16=True, threads=2)])),
    # stage 0 learns the task from the data, stage 1 distils the target's own greedy answers
    "phalanx-math-draft": ("llama", dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1),
                           dict(stages=[dict(steps=1000, batch=32, lr=3e-3),
                                        dict(steps=1500, batch=32, lr=2e-3, bf16=True, threads=1,
                                             data="distill", n_distill=N_DISTILL)])),
    "phalanx-math-moe": ("mixtral", dict(hidden_size=192, intermediate_size=384, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         num_local_experts=4, num_experts_per_tok=2),
                         dict(stages=[dict(steps=700, batch=32, lr=2e-3), dict(steps=600, batch=32, lr=1.5e-3)])),
    "phalanx-math-moe-draft": ("mixtral", dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                                               num_attention_heads=2, num_key_value_heads=1,
                                               num_local_experts=4, num_experts_per_tok=2),
                               dict(steps=600, batch=32, lr=3e-3)),
}


def make_model(arch: str, vocab: int, tok, **kw):
    common = dict(vocab_size=vocab, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
                  rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common, **kw))
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**common, **kw, output_router_logits=False, router_aux_loss_coef=0.02, sliding_window=None)
    return MixtralForCausalLM(cfg)


def _stages(tr: dict) -> list[dict]:
    return tr.get("stages") or [dict(steps=tr["steps"], lr=tr["lr"], batch=tr["batch"])]


def train_lm(name: str, seed: int, rows: list[dict], steps: int | None = None, note: str = "",
             resume_stage: int = 0) -> dict:
    """Train one causal LM from SPECS[name] on chat-formatted rows (loss on the answer).

    A stage may set ``bf16=True`` (bfloat16 autocast for the forward; fp32 master weights and
    optimizer state), ``threads=N`` (torch threads; default 1) and ``data="distill"`` with
    ``n_distill=N`` (train on the target's greedy answers to N train questions instead of the data).

    Training runs in stages (``SPECS[name][2]["stages"]``); each stage starts from the
    previous stage's weights rounded to bfloat16 (exactly what ``save_pretrained`` stores),
    with a fresh AdamW, its own warm-up + cosine schedule and its own data-order seed, so a
    stage can be resumed from the saved folder (``--resume-stage``) with the same result.
    """
    from phalanx.demo.evaluate import accuracy

    arch, cfg_kw, tr = SPECS[name]
    stages = _stages(tr)
    if steps:
        stages = [dict(stages[0], steps=steps)]
    setup(seed)
    tok = load_tokenizer()
    model = make_model(arch, len(tok), tok, **cfg_kw)
    out_dir = MODELS_DIR / name
    curve_file = WORK_DIR / "results" / f"{name}-curve.json"
    train_pts, val_pts, train_time = [], [], 0.0
    if resume_stage:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        if curve_file.exists():   # earlier stages' curve (build/demo is not committed)
            prev = json.loads(curve_file.read_text())
            train_pts, val_pts = [tuple(x) for x in prev["train"]], [tuple(x) for x in prev["val"]]
            train_time = prev["time"]
    nparams = sum(p.numel() for p in model.parameters())
    print(f"{name}: {arch}, {nparams / 1e6:.2f}M parameters, stages {stages} {note}", flush=True)

    def encoded(stage: dict) -> list[tuple[list[int], list[int]]]:
        # a stage with data="distill" trains on the target's own greedy answers
        src = distill_rows(seed, stage["n_distill"]) if stage.get("data") == "distill" else rows
        return [encode_example(tok, r["question"], r["answer"]) for r in src]

    val = load_rows("validation")
    venc = [encode_example(tok, r["question"], r["answer"]) for r in val[:256]]
    vids, vatt, vlab = collate([e[0] for e in venc], [e[1] for e in venc], tok.pad_token_id)
    if arch == "mixtral":
        model.config.output_router_logits = True

    offset = sum(st["steps"] for st in stages[:resume_stage])
    for si in range(resume_stage, len(stages)):
        st = stages[si]
        if si > 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        state = _train_stage(model, tok, st, encoded(st), seed * 1000 + si, offset, (vids, vatt, vlab),
                             f"{name} stage {si}", LoopState(0, train_pts, val_pts))
        train_pts, val_pts = state.train_curve, state.val_curve
        train_time += state.seconds
        offset += st["steps"]
        if arch == "mixtral":
            model.config.output_router_logits = False
        model.eval()
        save_hf(model, tok, out_dir, tok.eos_token_id)     # casts to bf16
        model = model.float()
        if arch == "mixtral":
            model.config.output_router_logits = True
        curve_file.parent.mkdir(parents=True, exist_ok=True)
        curve_file.write_text(json.dumps({"train": train_pts, "val": val_pts, "time": train_time}))
        print(f"stage {si} saved ({train_time:.0f}s training so far)", flush=True)
    if arch == "mixtral":
        model.config.output_router_logits = False
    plot_curves(IMG_DIR / f"{name}-loss.png", {"train (smoothed)": smooth(train_pts), "validation": val_pts},
                f"{name} ({nparams / 1e6:.1f}M params)")
    # accuracy of the saved (bf16) weights, computed in fp32
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    with Timer(f"{name} validation accuracy"):
        acc, _ = accuracy(saved, tok, val, desc="val-acc")
    res = {"name": name, "params": nparams, "stages": stages, "train_time_s": round(train_time),
           "final_train_loss": sum(v for _, v in train_pts[-50:]) / len(train_pts[-50:]),
           "final_val_loss": val_pts[-1][1], "val_accuracy": acc, "seed": seed}
    print(json.dumps(res), flush=True)
    (WORK_DIR / "results").mkdir(parents=True, exist_ok=True)
    (WORK_DIR / "results" / f"{name}.json").write_text(json.dumps(res, indent=1))
    return res


def _train_stage(model, tok, st: dict, enc: list[tuple[list[int], list[int]]], data_seed: int, offset: int,
                 val: tuple[torch.Tensor, torch.Tensor, torch.Tensor], desc: str, state: LoopState) -> LoopState:
    """One stage on the shared loop: length-bucketed batches of the encoded rows, AdamW (decay on
    matrices only), warm-up + cosine, validation loss every 200 steps."""
    lengths = [len(e[0]) for e in enc]
    rng = random.Random(data_seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=st["lr"], betas=(0.9, 0.95))
    batches: list[list[int]] = []
    t0 = time.time()

    def next_batch(step: int) -> list[int]:
        if not batches:
            batches.extend(length_batches(lengths, st["batch"], rng))
        return batches.pop()

    def loss_fn(b: list[int]) -> tuple[torch.Tensor, str]:
        ids, att, lab = collate([enc[i][0] for i in b], [enc[i][1] for i in b], tok.pad_token_id)
        return model(input_ids=ids, attention_mask=att, labels=lab).loss, ""

    def eval_fn(step: int) -> float:
        vl = model(input_ids=val[0], attention_mask=val[1], labels=val[2]).loss.item()
        last = state.train_curve[-50:]
        print(f"\nstep {offset + step + 1}: train {sum(v for _, v in last) / len(last):.4f} "
              f"val {vl:.4f} ({time.time() - t0:.0f}s)", flush=True)
        return vl

    cfg = LoopConfig(steps=st["steps"], lr=st["lr"], warmup=min(100, st["steps"] // 10), bf16=st.get("bf16", False),
                     threads=st.get("threads", 1), eval_every=200, desc=desc, curve_offset=offset)
    return TrainLoop(cfg, model, opt, next_batch, loss_fn, eval_fn).run(state)


def distill_rows(seed: int, n: int) -> list[dict]:
    """Train questions answered by the target's own greedy outputs (cached in build/demo)."""
    import hashlib

    from transformers import AutoModelForCausalLM

    from phalanx.demo.evaluate import greedy_generate

    # keyed by the target's weights: a retrained target must not reuse the old target's answers
    digest = hashlib.sha256((MODELS_DIR / "phalanx-math" / "model.safetensors").read_bytes()).hexdigest()[:12]
    cache = WORK_DIR / f"target_outputs-{digest}.jsonl"
    rows = load_rows("train")[:n]
    have = []
    if cache.exists():
        have = [json.loads(line) for line in open(cache)]
    if len(have) < n:
        setup(seed)
        torch.set_num_threads(2)  # batched greedy generation uses both cores
        tok = load_tokenizer()
        model = AutoModelForCausalLM.from_pretrained(MODELS_DIR / "phalanx-math", dtype=torch.float32)
        todo = rows[len(have):]
        with Timer(f"target greedy outputs for {len(todo)} train questions"):
            outs = greedy_generate(model, tok, [r["question"] for r in todo], batch_size=64, desc="target-gen")
        with open(cache, "a") as f:
            for r, o in zip(todo, outs):
                f.write(json.dumps({"question": r["question"], "answer": o.strip()}) + "\n")
        have = [json.loads(line) for line in open(cache)]
    return have[:n]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["target", "draft", "eagle", "eagle3", "moe", "moe-draft"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="override: one stage of this many steps")
    ap.add_argument("--resume-stage", type=int, default=0,
                    help="continue from the saved folder with this stage (target / draft / moe / EAGLE heads)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of an EAGLE head's training loop")
    ap.add_argument("--head-layers", type=int, default=None, help="decoder layers of an EAGLE head (experiments)")
    ap.add_argument("--out-name", default=None, help="output folder name of an EAGLE head (experiments)")
    ap.add_argument("--init-from", default=None, help="EAGLE head folder to continue training from (a next stage)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate of an EAGLE head stage")
    ap.add_argument("--labels", choices=["soft", "hard"], default=None,
                    help="EAGLE-3 token loss: soft (the target's distribution, default) or hard (its greedy token)")
    ap.add_argument("--aux-ids", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="EAGLE-3 target layer ids, comma-separated (experiments; default low, middle, top)")
    a = ap.parse_args(argv)
    if not (DATA_DIR / "train.jsonl").exists():
        raise SystemExit("no data: run `python -m phalanx.demo.build_all --only data` first")
    t0 = time.time()
    if a.what == "target":
        train_lm("phalanx-math", a.seed, load_rows("train"), a.steps, resume_stage=a.resume_stage)
    elif a.what == "moe":
        train_lm("phalanx-math-moe", a.seed, load_rows("train"), a.steps, resume_stage=a.resume_stage)
    elif a.what == "draft":
        train_lm("phalanx-math-draft", a.seed, load_rows("train"), a.steps, resume_stage=a.resume_stage)
    elif a.what == "moe-draft":
        train_lm("phalanx-math-moe-draft", a.seed, load_rows("train"), a.steps)
    else:
        from phalanx.demo import eagle

        if (a.steps, a.head_layers, a.out_name, a.init_from, a.lr, a.aux_ids, a.labels) == (None,) * 7:
            eagle.train_committed(a.what, a.seed, threads=a.threads, resume_stage=a.resume_stage)
        else:  # one experimental stage
            extra = {"lr": a.lr} if a.lr is not None else {}
            eagle.train(a.what, a.seed, a.steps, threads=a.threads, layers=a.head_layers, out_name=a.out_name,
                        init_from=a.init_from, aux_ids=a.aux_ids, labels=a.labels, **extra)
    print(f"total wall time {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
