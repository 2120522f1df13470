"""Adaptive drafting against a fixed draft length, offline, both engines in ONE process: a static
engine (k = the method's k) whose requests are capped at --cap drafts (what `k = cap` serves), the
same engine with requests opted out (plain decoding), an adaptive engine, and its requests opted
out, rounds alternating in order and reversed. Held-out chat prompts of the built-in prompt set
(never trained on), --concurrency at a time. Prints tok/s per round and the medians, and the draft
lengths the adaptive engine chose each round. Served runs (`adaptive_spec.py`) add the API
server and a process per engine; this isolates the engine and the policy.

    python benchmarks/adaptive_offline.py --concurrency 16 --rounds 4
    python benchmarks/adaptive_offline.py --concurrency 32 --rounds 2 --only adaptive   # one engine
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from phalanx import LLM, SamplingParams
from phalanx.training.prompts import builtin_prompt_set


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--spec", default='{"method": "eagle3", "model": "smollm2-135m-instruct-eagle3", '
                                      '"num_speculative_tokens": 3}')
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=None, help="requests a round (default: 2 x concurrency)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cap", type=int, default=1, help="the static engine's per-request draft length")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--only", choices=("adaptive", "static", "plain"), default=None,
                    help="one engine alone: the adaptive one, the static one capped at --cap, or one without "
                         "a drafter (to compare two builds process by process, e.g. one on PYTHONPATH)")
    args = ap.parse_args()
    spec = json.loads(args.spec)
    held = builtin_prompt_set(4000, seed=0).held_out
    n = args.prompts or 2 * args.concurrency
    if len(held) < n:
        raise SystemExit(f"only {len(held)} held-out prompts")
    msgs = [[{"role": "user", "content": c[-1]["content"]}] for c in held[:n]]
    adaptive = None
    if args.only == "plain":
        modes = {"plain": (LLM(args.model, max_num_seqs=args.concurrency), {})}
    elif args.only == "static":
        static = LLM(args.model, speculative_config=spec, max_num_seqs=args.concurrency)
        modes = {f"k={args.cap}@static": (static, {"num_speculative_tokens": args.cap})}
    else:
        adaptive = LLM(args.model, speculative_config=dict(spec, adaptive=True), max_num_seqs=args.concurrency)
        modes = {"adaptive": (adaptive, {})}
        if args.only is None:
            static = LLM(args.model, speculative_config=spec, max_num_seqs=args.concurrency)
            modes = {
                f"k={args.cap}@static": (static, {"num_speculative_tokens": args.cap}),
                "plain@static": (static, {"speculative": False}),
                "adaptive": (adaptive, {}),
                "plain@adaptive": (adaptive, {"speculative": False}),
            }
    for llm, extra in modes.values():  # warm-up
        llm.chat(msgs[:2], SamplingParams(temperature=0, max_tokens=16, **extra), use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in modes}
    seen = list(adaptive.engine.scheduler.spec_draft_lengths) if adaptive is not None else []
    chosen: list[int] | None = None
    for r in range(args.rounds):
        order = list(modes.items()) if r % 2 == 0 else list(reversed(modes.items()))
        for name, (llm, extra) in order:
            sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, **extra)
            start = time.perf_counter()
            outs = llm.chat(msgs, sp, use_tqdm=False)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
            if llm is adaptive:  # its opted-out round counts decisions of 0 too: kept apart
                now = list(adaptive.engine.scheduler.spec_draft_lengths)
                if name == "adaptive":
                    chosen = [a - b for a, b in zip(now, seen)]
                seen = now
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()) + " tok/s"
              + (f"; adaptive's draft lengths 0..k: {chosen}" if chosen is not None else ""), flush=True)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    line = "medians: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()) + " tok/s"
    if "adaptive" in medians and f"k={args.cap}@static" in medians:
        line += f"; adaptive / k={args.cap}@static {medians['adaptive'] / medians[f'k={args.cap}@static']:.3f}"
    print(line, flush=True)


if __name__ == "__main__":
    main()
