"""Shared helpers for training / evaluating the phalanx-math demo models."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from phalanx.demo import MODELS_DIR
from phalanx.demo.tokenizer import END, prompt_text
from phalanx.training.loop import lr_at  # noqa: F401 - the demo scripts' name for the shared schedule

REPO_ROOT = Path(__file__).resolve().parents[2]
WORK_DIR = REPO_ROOT / "build" / "demo"          # regenerated data, tokenizer, intermediate files
DATA_DIR = WORK_DIR / "data"
TOK_DIR = WORK_DIR / "tokenizer"
IMG_DIR = REPO_ROOT / "docs" / "img"
EVAL_TEST = REPO_ROOT / "evals" / "phalanx-math" / "phalanx_math_test.jsonl"


def setup(seed: int) -> None:
    torch.set_num_threads(1)
    random.seed(seed)
    torch.manual_seed(seed)


def load_rows(split: str) -> list[dict]:
    with open(DATA_DIR / f"{split}.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_tokenizer(path=None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or TOK_DIR))


def encode_example(tok, question: str, answer: str) -> tuple[list[int], list[int]]:
    """ids of prompt+answer+<|end|> and labels (-100 on the prompt)."""
    p = tok(prompt_text(question), add_special_tokens=False)["input_ids"]
    a = tok(answer + END, add_special_tokens=False)["input_ids"]
    return p + a, [-100] * len(p) + a


def length_batches(lengths: list[int], batch_size: int, rng: random.Random, chunk: int = 64) -> list[list[int]]:
    """Shuffled batches of indices with similar lengths (little padding)."""
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    batches = []
    span = batch_size * chunk
    for s in range(0, len(idx), span):
        part = sorted(idx[s:s + span], key=lambda i: lengths[i])
        batches += [part[j:j + batch_size] for j in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(seqs: list[list[int]], labels: list[list[int]] | None = None, pad_id: int = 0):
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), n), dtype=torch.long)
    lab = torch.full((len(seqs), n), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        att[i, :len(s)] = 1
        if labels is not None:
            lab[i, :len(s)] = torch.tensor(labels[i])
    return ids, att, lab


def plot_curves(path: Path, curves: dict[str, list[tuple[int, float]]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, pts in curves.items():
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def smooth(pts: list[tuple[int, float]], k: int = 20) -> list[tuple[int, float]]:
    """Moving average over the last k consecutive steps (sparse points, e.g. a stage's curve
    reconstructed from its log, are left as they are)."""
    out: list[tuple[int, float]] = []
    acc: list[float] = []
    prev = None
    for s, v in pts:
        if prev is not None and s - prev > 1:
            acc.clear()
        prev = s
        acc.append(v)
        if len(acc) > k:
            acc.pop(0)
        out.append((s, sum(acc) / len(acc)))
    return out


def save_hf(model, tok, out: Path, gen_eos: int) -> None:
    """Save a complete HF folder in bfloat16 (config dtype bfloat16) with tokenizer files."""
    from transformers import GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(
        eos_token_id=gen_eos, pad_token_id=tok.pad_token_id, do_sample=False, max_new_tokens=128,
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)


class Timer:
    def __init__(self, label: str):
        self.label = label

    def __enter__(self):
        self.t0 = time.time()
        print(f"[{time.strftime('%H:%M:%S')}] {self.label} ...", flush=True)
        return self

    def __exit__(self, *exc):
        self.elapsed = time.time() - self.t0
        print(f"[{time.strftime('%H:%M:%S')}] {self.label} done in {self.elapsed:.1f}s", flush=True)


def models_dir() -> Path:
    return MODELS_DIR
