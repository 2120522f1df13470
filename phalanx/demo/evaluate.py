"""Greedy exact-match accuracy of a phalanx-math model with plain HF generate.

    python -m phalanx.demo.evaluate phalanx-math [--split test|validation] [--limit N]

The user's question is the only chat message; the answer is the number after
``####`` in the generated text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from phalanx.demo import resolve_model_path
from phalanx.demo.data import extract_answer
from phalanx.demo.tokenizer import prompt_text


@torch.no_grad()
def greedy_generate(model, tok, questions: list[str], batch_size: int = 50, max_new_tokens: int = 96,
                    desc: str | None = None) -> list[str]:
    from tqdm import tqdm

    tok.padding_side = "left"
    outs: list[str] = []
    it = range(0, len(questions), batch_size)
    if desc:
        it = tqdm(it, desc=desc, leave=False)
    model.eval()
    for s in it:
        enc = tok([prompt_text(q) for q in questions[s:s + batch_size]], return_tensors="pt", padding=True,
                  add_special_tokens=False)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for row in gen[:, enc["input_ids"].shape[1]:]:
            outs.append(tok.decode(row, skip_special_tokens=True))
    return outs


def accuracy(model, tok, rows: list[dict], batch_size: int = 50, desc: str | None = None) -> tuple[float, list[str]]:
    outs = greedy_generate(model, tok, [r["question"] for r in rows], batch_size, desc=desc)
    ok = sum(extract_answer(o) == extract_answer(r["answer"]) for o, r in zip(outs, rows))
    return ok / max(1, len(rows)), outs


def load_rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phalanx.demo.common import DATA_DIR, EVAL_TEST

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--split", default="test", help="test (evals/ JSONL), validation, or a JSONL path")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--show", type=int, default=3)
    a = ap.parse_args(argv)
    path = EVAL_TEST if a.split == "test" else (DATA_DIR / f"{a.split}.jsonl" if a.split == "validation" else Path(a.split))
    rows = load_rows(path)
    if a.limit:
        rows = rows[:a.limit]
    mp = resolve_model_path(a.model)
    tok = AutoTokenizer.from_pretrained(mp)
    model = AutoModelForCausalLM.from_pretrained(mp, dtype=getattr(torch, a.dtype))
    t0 = time.time()
    acc, outs = accuracy(model, tok, rows, desc="eval")
    for r, o in list(zip(rows, outs))[:a.show]:
        print("Q:", r["question"], "\nA:", o, "\n")
    print(f"{a.model}: greedy exact match {acc * 100:.1f}% on {len(rows)} problems ({path.name}, {a.dtype}) "
          f"in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
