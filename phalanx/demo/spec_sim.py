"""HF-based simulation of greedy chain speculative decoding: mean acceptance length.

    python -m phalanx.demo.spec_sim --target phalanx-math --draft phalanx-math-eagle [-k 3] [--n 100]

The target's greedy continuation y of each test prompt is computed once; then,
starting after the first (prefill) token, each verification step drafts k
tokens greedily from the current context prompt + y[:p], accepts the longest
prefix that equals y[p:], and adds the target's own token.  Acceptance length =
1 + accepted drafts per verification step (the final step, when the drafts run
through <|end|>, has no bonus token).  Drafters: an HF causal LM (same
tokenizer) or an EAGLE-1 / EAGLE-3 head (``phalanx.demo.eagle``), fed with the
target's features over the verified context.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from phalanx.demo import resolve_model_path
from phalanx.demo.tokenizer import prompt_text


@torch.no_grad()
def lm_drafts(draft, ctx: list[int], k: int) -> list[int]:
    out = draft(input_ids=torch.tensor([ctx]), use_cache=True)
    res = []
    for i in range(k):
        nxt = int(out.logits[0, -1].argmax())
        res.append(nxt)
        if i + 1 < k:
            out = draft(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return res


def simulate(target, tok, questions: list[str], drafter, k: int = 3, kind: str = "lm", max_new: int = 96):
    from tqdm import tqdm

    from phalanx.demo.eagle import target_features
    from phalanx.demo.evaluate import greedy_generate

    outs = greedy_generate(target, tok, questions, batch_size=50)
    steps = tokens = 0
    hist = [0] * (k + 2)
    for q, o in tqdm(list(zip(questions, outs)), desc=f"spec-sim k={k}", mininterval=5):
        p_ids = tok(prompt_text(q), add_special_tokens=False)["input_ids"]
        y = tok(o, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        y = y[:max_new]
        s = p_ids + y
        feats = None
        if kind in ("eagle", "eagle3"):
            ids = torch.tensor([s])
            last, aux = target_features(target, ids, torch.ones_like(ids), drafter.cfg.get(
                "eagle_aux_hidden_state_layer_ids") or [])
            feats = drafter.fuse(aux[0]) if kind == "eagle3" else last[0]
        p = 1
        while p < len(y):
            L = len(p_ids) + p
            if kind == "lm":
                d = lm_drafts(drafter, s[:L], k)
            else:
                d = drafter.draft_chain(torch.tensor(s[1:L]), feats[: L - 1], k)
            a = 0
            while a < min(k, len(y) - p) and d[a] == y[p + a]:
                a += 1
            adv = a + 1 if p + a < len(y) else a
            hist[a] += 1
            p += adv
            tokens += adv
            steps += 1
    return tokens / max(1, steps), {"steps": steps, "tokens": tokens, "accepted_hist": hist}


def main(argv=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phalanx.demo.common import EVAL_TEST
    from phalanx.demo.eagle import load_head
    from phalanx.demo.evaluate import load_rows

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="phalanx-math")
    ap.add_argument("--draft", required=True)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--data", default=str(EVAL_TEST))
    ap.add_argument("--json", default=None, help="append the result as a JSON line to this file")
    a = ap.parse_args(argv)
    rows = load_rows(a.data)[: a.n]
    tpath, dpath = resolve_model_path(a.target), resolve_model_path(a.draft)
    tok = AutoTokenizer.from_pretrained(tpath)
    target = AutoModelForCausalLM.from_pretrained(tpath, dtype=torch.float32).eval()
    arch = json.loads((Path(dpath) / "config.json").read_text())["architectures"][0]
    if arch.startswith("Eagle3"):
        kind, drafter = "eagle3", load_head(dpath, target)
    elif arch.startswith("Eagle"):
        kind, drafter = "eagle", load_head(dpath, target)
    else:
        kind, drafter = "lm", AutoModelForCausalLM.from_pretrained(dpath, dtype=torch.float32).eval()
    t0 = time.time()
    mal, info = simulate(target, tok, [r["question"] for r in rows], drafter, a.k, kind)
    res = {"target": a.target, "draft": a.draft, "kind": kind, "k": a.k, "n": len(rows),
           "mean_acceptance_length": round(mal, 3), **info, "wall_s": round(time.time() - t0)}
    print(json.dumps(res))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
