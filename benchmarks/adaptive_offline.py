"""Adaptive drafting against fixed draft lengths, offline, both engines in ONE process: a static
engine (k = the method's k) whose requests are capped at each --cap (what `k = cap` serves), the
same engine with requests opted out (plain decoding), an adaptive engine, and its requests opted
out, rounds alternating in order and reversed. Held-out chat prompts of the built-in prompt set
(never trained on), --concurrency at a time. Prints tok/s per round and the medians, the draft
lengths the adaptive engine chose each round, and the acceptance per draft position: what the
static engine's requests accepted at the largest cap (every request drafting alike), the rates
the adaptive engine prices a request without counts of its own at (``AcceptanceStats.engine_rates``)
and what its deep drafts, drafted for the requests it chose, accepted (the positions' own tests,
pooled). Served runs (`adaptive_spec.py`) add the API server and a process per engine; this
isolates the engine and the policy. --mixed runs `adaptive_spec.py`'s mixed workload instead:
every other request opted out (`speculative: false`, in every mode), the rest code-like
repetitive prompts; --questions takes the prompts from a JSONL file (`question`, `prompt` or
`text` per row) instead of the built-in set.

    python benchmarks/adaptive_offline.py --concurrency 16 --rounds 4
    python benchmarks/adaptive_offline.py --concurrency 32 --rounds 4 --cap 1,2,3
    python benchmarks/adaptive_offline.py --concurrency 32 --rounds 2 --only adaptive   # one engine
    python benchmarks/adaptive_offline.py --mixed --concurrency 16 --prompts 128 --rounds 4 --only pair
    python benchmarks/adaptive_offline.py --model phalanx-math --spec '{"method": "eagle", "model": \
        "phalanx-math-eagle", "num_speculative_tokens": 3}' --questions evals/phalanx-math/phalanx_math_test.jsonl \
        --mixed --concurrency 16 --rounds 6 --prompts 128 --cap 1,3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from adaptive_spec import code_like_prompts, questions, workload

from phalanx import LLM, SamplingParams
from phalanx.training.prompts import builtin_prompt_set


def engine_work(llm: LLM) -> tuple[int, float, float, float]:
    """The engine's steps so far, and its seconds in the target's forward, in the drafter and in
    its steps (`EngineCore.step`) in all."""
    engine = llm.engine
    return engine.num_steps, engine.runner.forward_seconds, engine.runner.drafter_seconds, engine.step_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--spec", default='{"method": "eagle3", "model": "smollm2-135m-instruct-eagle3", '
                                      '"num_speculative_tokens": 3}')
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=None, help="requests a round (default: 2 x concurrency)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cap", default="1", help="the static engine's per-request draft lengths (e.g. 1,2,3)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--only", choices=("adaptive", "static", "plain", "pair"), default=None,
                    help="one engine alone: the adaptive one, the static one capped at --cap, or one without "
                         "a drafter (to compare two builds process by process, e.g. one on PYTHONPATH); "
                         "pair: the adaptive engine and its requests opted out, each round's steps, "
                         "forward and drafter seconds printed")
    ap.add_argument("--mixed", action="store_true",
                    help="every other request opted out, the rest code-like repetitive prompts")
    ap.add_argument("--questions", type=Path, default=None,
                    help="JSONL of prompts (question / prompt / text) instead of the built-in held-out set")
    args = ap.parse_args()
    spec = json.loads(args.spec)
    caps = [int(c) for c in args.cap.split(",")]
    n = args.prompts or 2 * args.concurrency
    if args.questions is not None:
        prompts = questions(args.questions, n)
    else:
        prompts = [c[-1]["content"] for c in builtin_prompt_set(4000, seed=0).held_out[:n]]
    if len(prompts) < n:
        raise SystemExit(f"only {len(prompts)} prompts, {n} wanted")
    items = workload(prompts, code_like_prompts(n), args.mixed, n)  # (prompt, may speculate)
    msgs = [[{"role": "user", "content": p}] for p, _ in items]
    adaptive = None
    if args.only == "plain":
        modes = {"plain": (LLM(args.model, max_num_seqs=args.concurrency), {})}
    elif args.only == "static":
        static = LLM(args.model, speculative_config=spec, max_num_seqs=args.concurrency)
        modes = {f"k={c}@static": (static, {"num_speculative_tokens": c}) for c in caps}
    else:
        adaptive = LLM(args.model, speculative_config=dict(spec, adaptive=True), max_num_seqs=args.concurrency)
        modes = {"adaptive": (adaptive, {})}
        if args.only == "pair":
            modes["plain@adaptive"] = (adaptive, {"speculative": False})
        if args.only is None:
            static = LLM(args.model, speculative_config=spec, max_num_seqs=args.concurrency)
            modes = {
                **{f"k={c}@static": (static, {"num_speculative_tokens": c}) for c in caps},
                "plain@static": (static, {"speculative": False}),
                "adaptive": (adaptive, {}),
                "plain@adaptive": (adaptive, {"speculative": False}),
            }

    def params(extra: dict, max_tokens: int) -> list[SamplingParams]:  # an opted-out item stays out
        return [SamplingParams(temperature=0, max_tokens=max_tokens, **(extra if ok else {"speculative": False}))
                for _, ok in items]

    for llm, extra in modes.values():  # warm-up
        llm.chat(msgs[:2], params(extra, 16)[:2], use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in modes}
    seen = list(adaptive.engine.scheduler.spec_draft_lengths) if adaptive is not None else []
    parked_before = adaptive.engine.scheduler.spec_num_parked if adaptive is not None else 0
    chosen: list[int] | None = None
    parked = 0
    deepest = f"k={max(caps)}@static"
    verified, accepted = 0, [0] * max(caps)  # the deepest cap's verifications, accepted per position
    for r in range(args.rounds):
        order = list(modes.items()) if r % 2 == 0 else list(reversed(modes.items()))
        for name, (llm, extra) in order:
            before = llm.engine.stats()
            work = engine_work(llm)
            start = time.perf_counter()
            outs = llm.chat(msgs, params(extra, args.max_tokens), use_tqdm=False)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
            if args.only == "pair":  # where the round's time went
                steps, fwd, drafter, stepped = (b - a for a, b in zip(work, engine_work(llm)))
                print(f"  {name}: {steps} steps, forward {fwd:.3f} s, drafter {drafter:.3f} s, "
                      f"rest of the steps {stepped - fwd - drafter:.3f} s", flush=True)
            if name == deepest:
                after = llm.engine.stats()
                verified += after.spec_num_drafts - before.spec_num_drafts
                for j in range(len(accepted)):
                    accepted[j] += after.spec_accepted_per_pos[j] - before.spec_accepted_per_pos[j]
            if llm is adaptive:  # its opted-out round counts decisions of 0 too: kept apart
                now = list(adaptive.engine.scheduler.spec_draft_lengths)
                if name == "adaptive":
                    chosen = [a - b for a, b in zip(now, seen)]
                    parked = adaptive.engine.scheduler.spec_num_parked - parked_before
                seen, parked_before = now, adaptive.engine.scheduler.spec_num_parked
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()) + " tok/s"
              + (f"; adaptive's draft lengths 0..k: {chosen}, requests parked {parked}" if chosen is not None else ""),
              flush=True)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    line = "medians: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()) + " tok/s"
    others = [k for k in medians if k.endswith("@static")]
    if "adaptive" in medians and others:
        best = max(others, key=lambda k: medians[k])
        paired = statistics.median(a / max(rates[k][i] for k in others) for i, a in enumerate(rates["adaptive"]))
        line += f"; adaptive / {best} {medians['adaptive'] / medians[best]:.3f}, paired by round {paired:.3f}"
    if "plain@adaptive" in medians:
        paired = statistics.median(a / p for a, p in zip(rates["adaptive"], rates["plain@adaptive"]))
        line += f"; adaptive / plain@adaptive {medians['adaptive'] / medians['plain@adaptive']:.3f}, paired {paired:.3f}"
    print(line, flush=True)
    if verified:  # conditional rate at j: accepted at j over accepted at j - 1 (all drafted the cap)
        conditional = [a / (accepted[j - 1] if j else verified) for j, a in enumerate(accepted) if (accepted[j - 1] if j else verified)]
        print(f"{deepest}: acceptance per position, every request drafting {max(caps)}: "
              + " / ".join(f"{x:.3f}" for x in conditional), flush=True)
    if adaptive is not None and adaptive.engine.adaptive is not None:
        stats = adaptive.engine.adaptive.acceptance
        print("adaptive: a request without counts of its own priced at "
              + " / ".join(f"{x:.3f}" for x in stats.engine_rates()) + "; its drafts' own tests, pooled per "
              "position: " + " / ".join(f"{x:.3f}" for x in stats.pooled_rates()), flush=True)


if __name__ == "__main__":
    main()
