"""Is the adaptive policy's acceptance estimate calibrated? Offline, one adaptive engine in this
process: before every verification that drafted, the request's estimated first-draft acceptance
(``AcceptanceStats.rates_of``, what the next decision would price it at) is recorded with whether
its first draft was then accepted; printed: the mean estimate against the share accepted, over
all verifications and binned by the request's own tests so far and by the estimate. A calibrated
estimate reads the same in both columns; one biased low makes the policy under-draft at a
break-even point. Asserts nothing.

    python benchmarks/acceptance_calibration.py --concurrency 32
"""

from __future__ import annotations

import argparse
import json

import phalanx.spec_decode.adaptive as adaptive
from phalanx import LLM, SamplingParams
from phalanx.training.prompts import builtin_prompt_set


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--spec", default='{"method": "eagle3", "model": "smollm2-135m-instruct-eagle3", '
                                      '"num_speculative_tokens": 3}')
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=None, help="held-out chat prompts (default: 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()

    seen: list[tuple[float, bool, float]] = []  # (estimate, accepted, the request's own tests before)
    observe_all = adaptive.AcceptanceStats.observe_all

    def recording(self: adaptive.AcceptanceStats, verified: list[tuple[str, int, int]]) -> None:
        curve = self.curve()
        for req_id, num_drafts, num_accepted in verified:
            if num_drafts >= 1:
                counts = self._counts.get(req_id)
                seen.append((self.rates_of(req_id, curve)[0], num_accepted >= 1,
                             0.0 if counts is None else counts[0][0]))
        observe_all(self, verified)

    adaptive.AcceptanceStats.observe_all = recording  # type: ignore[method-assign]
    n = args.prompts or 2 * args.concurrency
    prompts = [c[-1]["content"] for c in builtin_prompt_set(4000, seed=0).held_out[:n]]
    llm = LLM(args.model, speculative_config=dict(json.loads(args.spec), adaptive=True),
              max_num_seqs=args.concurrency)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(msgs, [SamplingParams(temperature=0, max_tokens=args.max_tokens) for _ in msgs], use_tqdm=False)

    def line(label: str, rows: list[tuple[float, bool, float]]) -> str:
        return (f"{label:32s} {len(rows):6d}  estimate {_mean([r[0] for r in rows]):.3f}  "
                f"accepted {_mean([float(r[1]) for r in rows]):.3f}")

    print(line("every verification that drafted", seen))
    for lo, hi in ((0, 0.5), (0.5, 3), (3, 6), (6, 9), (9, 11)):
        print(line(f"  own tests in [{lo}, {hi})", [r for r in seen if lo <= r[2] < hi]))
    for lo, hi in ((0, 0.4), (0.4, 0.55), (0.55, 0.7), (0.7, 0.85), (0.85, 1.01)):
        print(line(f"  estimate in [{lo}, {hi})", [r for r in seen if lo <= r[0] < hi]))


if __name__ == "__main__":
    main()
