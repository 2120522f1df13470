"""Speculative decoding on the demo model: output tokens/s with and without each method at
concurrency 1 and 16 (offline `LLM`, greedy chat requests from the held-out math split), the mean
time per output token after the first (TPOT: the decode phase alone) and the mean acceptance
length. Prints a markdown table; asserts nothing.

    python benchmarks/spec_bench.py [--threads 2] [--num-prompts 64] [--max-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from phalanx import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2},
    "draft_model": {"method": "draft_model", "model": "phalanx-math-draft", "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "model": "phalanx-math-eagle", "num_speculative_tokens": 3},
    "eagle3": {"method": "eagle3", "model": "phalanx-math-eagle3", "num_speculative_tokens": 3},
}


def run(method: str, concurrency: int, chats: list, max_tokens: int) -> tuple[float, float, float | None]:
    """(output tok/s over the whole run, mean TPOT in ms, mean acceptance length). TPOT of a request:
    (last token time - first token time) / (tokens - 1), from RequestOutput.metrics: the decode
    phase alone, without the prompt's prefill and the request's set-up."""
    llm = LLM("phalanx-math", speculative_config=METHODS[method], max_num_seqs=concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(chats[:2], params, use_tqdm=False)  # warm-up
    before = llm.get_metrics()
    t = time.perf_counter()
    n = 0
    tpots = []
    for i in range(0, len(chats), concurrency):
        outs = llm.chat(chats[i : i + concurrency], params, use_tqdm=False)
        n += sum(len(o.outputs[0].token_ids) for o in outs)
        tpots += [(o.metrics["last_token_time"] - o.metrics["first_token_time"]) / (len(o.outputs[0].token_ids) - 1)
                  for o in outs if len(o.outputs[0].token_ids) > 1]
    dt = time.perf_counter() - t
    after = llm.get_metrics()
    drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    return n / dt, 1e3 * sum(tpots) / len(tpots), (1 + accepted / drafts) if drafts else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--c1-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over all methods (the machine drifts: each figure is the median over rounds)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in (REPO / "evals/phalanx-math/phalanx_math_test.jsonl").open()]
    chats = [[{"role": "user", "content": r["question"]}] for r in rows[: args.num_prompts]]
    runs: dict[str, list] = {m: [] for m in METHODS}
    for _ in range(args.repeats):
        for method in METHODS:
            c1 = run(method, 1, chats[: args.c1_prompts], args.max_tokens)
            c16 = run(method, 16, chats, args.max_tokens)
            runs[method].append((c1, c16))
            print(method, c1, c16, flush=True)

    def median(method: str, c: int, i: int) -> float:
        return statistics.median(r[c][i] for r in runs[method])

    base1, tpot1, base16, tpot16 = median("none", 0, 0), median("none", 0, 1), median("none", 1, 0), median("none", 1, 1)
    print(f"\nmedians of {args.repeats} round(s)")
    print("| method (k = 3) | tok/s c = 1 | speed-up | TPOT c = 1 (ms) | TPOT speed-up | tok/s c = 16 | speed-up "
          "| TPOT c = 16 (ms) | TPOT speed-up | acceptance length (c=1 / c=16) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for method, r in runs.items():
        t1, p1, t16, p16 = median(method, 0, 0), median(method, 0, 1), median(method, 1, 0), median(method, 1, 1)
        a1, a16 = r[0][0][2], r[0][1][2]
        acc = "–" if a1 is None else f"{a1:.2f} / {a16:.2f}"
        print(f"| {method} | {t1:.1f} | {t1 / base1:.2f}× | {p1:.3f} | {tpot1 / p1:.2f}× | {t16:.1f} | {t16 / base16:.2f}× "
              f"| {p16:.3f} | {tpot16 / p16:.2f}× | {acc} |")

if __name__ == "__main__":
    main()
