"""Regenerate the whole phalanx-math demo family from scratch (CPU; each stage sets its threads).

    python -m phalanx.demo.build_all [--seed 0] [--only data,target,draft,eagle,eagle3,moe,moe-draft,eval]

Steps (in order): data splits + tokenizer (build/demo/), the evals/ test JSONL,
target, draft (distilled on target outputs), EAGLE-1 head, EAGLE-3 head, MoE
target, MoE draft, then accuracy and acceptance-length measurements written to
build/demo/results/.  Each step prints its wall time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

STEPS = ["data", "target", "draft", "eagle", "eagle3", "moe", "moe-draft", "eval"]


def run_eval(seed: int) -> None:
    from phalanx.demo import evaluate, spec_sim
    from phalanx.demo.common import WORK_DIR

    res = WORK_DIR / "results"
    res.mkdir(parents=True, exist_ok=True)
    for m in ["phalanx-math", "phalanx-math-draft", "phalanx-math-moe", "phalanx-math-moe-draft"]:
        evaluate.main([m, "--split", "test"])
    for tgt, drf in [("phalanx-math", "phalanx-math-eagle"), ("phalanx-math", "phalanx-math-eagle3"),
                     ("phalanx-math", "phalanx-math-draft"), ("phalanx-math-moe", "phalanx-math-moe-draft")]:
        spec_sim.main(["--target", tgt, "--draft", drf, "-k", "3", "--n", "100", "--json", str(res / "acceptance.jsonl")])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=",".join(STEPS))
    a = ap.parse_args(argv)
    todo = [s for s in STEPS if s in a.only.split(",")]
    import torch

    torch.set_num_threads(1)
    from phalanx.demo import data, tokenizer
    from phalanx.demo.common import DATA_DIR, EVAL_TEST, TOK_DIR, Timer
    from phalanx.demo.train import main as train_main

    times = {}
    t_all = time.time()
    for step in todo:
        with Timer(step) as t:
            if step == "data":
                data.main(["--out", str(DATA_DIR), "--seed", str(a.seed)])
                tokenizer.main(["--data", str(DATA_DIR), "--out", str(TOK_DIR)])
                EVAL_TEST.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(DATA_DIR / "test.jsonl", EVAL_TEST)
            elif step == "eval":
                run_eval(a.seed)
            else:  # (the target's cached answers are keyed by its weights: see train.distill_rows)
                train_main([step, "--seed", str(a.seed)])
        times[step] = round(t.elapsed)
    print(json.dumps({"wall_s": times, "total_s": round(time.time() - t_all)}))


if __name__ == "__main__":
    main()
