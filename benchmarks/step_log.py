"""Summarise engine step logs (``PHALANX_DEBUG_STEP_LOG=PATH`` writes PATH.<pid>, one JSON line
per step): where each engine's time went, by batch shape.

    PHALANX_DEBUG_STEP_LOG=/tmp/steps phalanx serve ...   # or benchmarks/adaptive_spec.py, offline LLM
    python benchmarks/step_log.py /tmp/steps.* [--reqs 16] [--skip 4] [--span START,END]

Per log: tokens per second over all steps (steps' own time, without idle gaps), then by the number
of requests in the step (prompt-chunk steps apart), then the steps of exactly `--reqs` requests
decoding (no prompt rows) grouped by (draft rows verified, drafter passes): mean step, forward and
drafter milliseconds and tokens per step. The same batch shape taking different time under two
configurations, or a shape that costs more than its rows suggest, shows here first. With the
adaptive policy, last, how it decided (`decision`: static, fresh, reused, explore, wide, quiet) and how
many of the steps that verified drafts each kind of decision gave their drafts (a decision is
taken in one step's scheduling, its drafts verified in the next step). --span keeps one run's
steps: `adaptive_spec.py` prints each run's span (the same clock) and records them per round.
--calibrate replays the log and prints, by batch size, what its decode steps took over what the
cost model priced them at just before (without drafts and with): whether the policy's prices held.
--price R,M replays the log (up to the span's end) into a fresh cost model on the engine's own
profile (the log's first line) and prints what it prices R requests decoding at, without drafts
and with M draft rows: what the policy's model made of those steps, to hold against what the
steps of that shape took (above).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from phalanx.spec_decode.adaptive import StepCostModel

# A step followed by the next within this many seconds: the engine went straight on (requests in
# flight), and timed the step to the next one's start (``EngineCore._observe_step``).
WENT_ON_GAP = 0.005


def _decoding(step: dict) -> bool:
    """No prompt rows: every row is a request's next token or a draft it verifies."""
    return step["rows"] == step["reqs"] + step["drafts"]


def summarise(path: Path, reqs: int, skip: int, span: tuple[float, float] | None = None) -> str:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [s for s in lines if "t0" in s][skip:]  # (an adaptive engine's first line: its profile)
    if span is not None:
        steps = [s for s in steps if span[0] <= s["t0"] and s["t1"] <= span[1]]
    if not steps:
        return f"{path}: no steps"
    out = []
    total = sum(s["t1"] - s["t0"] for s in steps)
    tokens = sum(s["tokens"] for s in steps)
    wall = steps[-1]["t1"] - steps[0]["t0"]
    out.append(f"{path}: {len(steps)} steps, {total:.2f} s in steps ({wall:.2f} s from the first's start to the "
               f"last's end), {tokens} tokens, {tokens / total:.1f} tok/s")
    by_size: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    for s in steps:
        key = f"{s['reqs']:>3} reqs" if _decoding(s) else "prompt rows"
        agg = by_size[key]
        agg[0] += 1
        agg[1] += s["t1"] - s["t0"]
        agg[2] += s["tokens"]
        agg[3] += s["drafts"]
    out.append("  by batch: steps, seconds, tok/s, drafts per step")
    for key in sorted(by_size):
        n, sec, tok, drafts = by_size[key]
        out.append(f"    {key:>11}: {n:5d} {sec:7.2f} {tok / sec:8.1f} {drafts / n:6.1f}")
    shapes: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for s in steps:
        if s["reqs"] == reqs and _decoding(s):
            shapes[(s["drafts"], s["passes"])].append(s)
    if shapes:
        out.append(f"  {reqs} requests decoding, by (draft rows, drafter passes): steps, step / forward / drafter ms, "
                   "tokens per step")
        for (drafts, passes), group in sorted(shapes.items(), key=lambda kv: -len(kv[1]))[:12]:
            n = len(group)
            step = 1e3 * sum(s["t1"] - s["t0"] for s in group) / n
            fwd = 1e3 * sum(s["forward"] for s in group) / n
            dft = 1e3 * sum(s["drafter"] for s in group) / n
            out.append(f"    ({drafts:3d}, {passes}): {n:5d} {step:6.1f} {fwd:6.1f} {dft:5.1f} "
                       f"{sum(s['tokens'] for s in group) / n:6.2f}")
    decisions: dict[str, int] = defaultdict(int)
    drafting: dict[str, int] = defaultdict(int)
    for s, after in zip(steps, steps[1:] + [None]):
        kind = s.get("decision")
        if kind:
            decisions[kind] += 1
            if after is not None and after["drafts"]:
                drafting[kind] += 1
    if decisions:
        out.append("  adaptive decisions: " + ", ".join(f"{k} {n}" for k, n in sorted(decisions.items()))
                   + "; of them gave the next step drafts: " + ", ".join(f"{k} {n}" for k, n in sorted(drafting.items())))
    predicted = [s["predicted"] for s in steps if s.get("predicted")]
    if predicted:
        out.append("  fresh decisions, predicted tokens/s against drafting nothing (chosen / none, every cap / "
                   "none), by draft rows chosen: decisions, median ratios; then the median predicted time of "
                   "the chosen lengths in ms, in parts (step without drafts + rows + first pass + later passes "
                   "+ drafting requests), where the log has them")
        by_rows: dict[int, list[dict]] = defaultdict(list)
        for pr in predicted:
            by_rows[pr["draft_rows"]].append(pr)
        parts = ("ms_step", "ms_rows", "ms_first", "ms_passes", "ms_requests")
        for rows, group in sorted(by_rows.items()):
            chosen = sorted(pr["chosen"] / pr["none"] for pr in group)
            caps = sorted(pr["caps"] / pr["none"] for pr in group)
            line = f"    {rows:3d} draft rows: {len(group):5d}  {chosen[len(chosen) // 2]:.3f}  {caps[len(caps) // 2]:.3f}"
            if all(k in group[0] for k in parts):
                line += "  " + " + ".join(f"{statistics.median(pr[k] for pr in group):.2f}" for k in parts)
            out.append(line)
    return "\n".join(out)


def _replay(path: Path, until: float | None = None,
            predict: Callable[[StepCostModel, dict, float], None] | None = None) -> StepCostModel:
    """A fresh cost model fed the log's steps up to `until` as the engine fed its own (`cost_model`);
    `predict(costs, step, took)` is called with each step before the model sees it."""
    from phalanx.engine.engine_core import MIN_CPU_SHARE  # (here: summing a log up needs no torch)
    from phalanx.spec_decode.adaptive import StepCostModel, StepProfile

    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    head = next((x for x in lines if "profile" in x), None)
    if head is None:
        raise ValueError(f"{path} holds no profile: not the step log of an adaptive engine")
    costs = StepCostModel(logit_share=head["logit_share"], feeds_every_row=head["feeds_every_row"])
    costs.set_profile(*StepProfile(**head["profile"]))
    steps = [s for s in lines if "t0" in s and (until is None or s["t1"] <= until)]
    for s, after in zip(steps, steps[1:]):
        wall = s["t1"] - s["t0"]
        if s["cpu"] < MIN_CPU_SHARE * wall:
            continue
        went_on = after["t0"] - s["t1"] < WENT_ON_GAP
        took = (after["t0"] if went_on else s["t1"]) - s["t0"]
        if predict is not None and costs.measured:
            predict(costs, s, took)
        costs.observe(s["rows"], took, s["drafter"], s["passes"], s["logit_rows"], s["drafts"], s["drafter_rows"],
                      s["forward"], s["drafter_pass_rows"], s["drafting"])
    return costs


def calibration(path: Path, span: tuple[float, float] | None = None, bucket: int = 8) -> str:
    """How well the cost model priced the log's steps as they came: the log replayed into a fresh
    model, each decode step (no prompt rows, no drafter catch-up; `span`: within it) priced just
    before the model sees it (`step_cost` at its requests with its draft rows, plus its first pass,
    later passes and drafting requests where it drafted), and the median of what it took over that
    price, for steps without drafts and with, by batch size (`bucket` requests a line). The
    policy's decisions hang on the second over the first (`rel`): below 1 drafting was priced high
    against decoding without drafts, above 1 low. Steps jitter by 10-30 % on a shared machine, and
    a round's throughput with them; this ratio, over hundreds of steps of one run, does not hang
    on which rounds a spell fell in."""
    from phalanx.spec_decode.adaptive import BULK_FEED

    ratios: dict[tuple[int, bool], list[float]] = defaultdict(list)

    def predict(costs: StepCostModel, s: dict, took: float) -> None:
        reqs, drafts = s["reqs"], s["drafts"]
        if (s["rows"] != reqs + drafts or s["logit_rows"] != s["rows"] or s["drafter_rows"] - s["rows"] >= BULK_FEED
                or (span is not None and not span[0] <= s["t0"] <= span[1])):
            return
        priced = step_price(costs, reqs, drafts, s["passes"], s["drafting"])
        ratios[reqs // bucket * bucket, drafts > 0].append(took / priced)

    _replay(path, span[1] if span else None, predict)
    out = ["  what decode steps took over what the cost model priced them at just before, medians "
           "(steps without drafts, with drafts, rel = the second over the first), by requests:"]
    for lo in sorted({b for b, _ in ratios}):
        plain, drafting = ratios.get((lo, False), []), ratios.get((lo, True), [])
        p = statistics.median(plain) if plain else math.nan
        d = statistics.median(drafting) if drafting else math.nan
        out.append(f"    {lo:3d}-{lo + bucket - 1:<3d} without {len(plain):5d} steps {p:.3f}   with {len(drafting):5d} "
                   f"steps {d:.3f}   rel {d / p:.3f}")
    return "\n".join(out)


def cost_model(path: Path, until: float | None = None) -> StepCostModel:
    """A fresh cost model fed the log's steps up to `until` (perf_counter seconds; None: all) as the
    engine fed its own (each timed to the next one's start where the engine went straight on, a
    preempted one left out), on the profile the log starts with (ValueError: none, not an adaptive
    engine's log)."""
    return _replay(path, until)


def step_price(costs: StepCostModel, reqs: int, drafts: int, passes: int, drafting: int) -> float:
    """What `costs` prices a step of `reqs` requests decoding at, with `drafts` draft rows from
    `passes` drafter passes for `drafting` requests (no drafts: the step alone)."""
    curve, first, per_pass = costs.step_cost(reqs, drafts, reqs)
    if not drafts:
        return curve[0]
    return curve[drafts] + first + per_pass * max(passes - 1, 0) + drafting * costs.request_cost(reqs)


def price(costs: StepCostModel, reqs: int, drafts: int) -> str:
    """What `costs` prices `reqs` requests decoding at, without drafts and with `drafts` draft rows
    spread evenly (depth: drafts / reqs rounded up), every request drafting."""
    depth = math.ceil(drafts / reqs) if drafts else 0
    alone, drafted = step_price(costs, reqs, 0, 0, 0), step_price(costs, reqs, drafts, depth, reqs)
    return (f"  priced: {reqs} requests decoding {1e3 * alone:.2f} ms without drafts, {1e3 * drafted:.2f} ms "
            f"with {drafts} draft rows")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--reqs", type=int, default=16, help="batch size whose decode steps are broken down by shape")
    p.add_argument("--skip", type=int, default=4, help="leading steps to leave out (the warm-up requests)")
    p.add_argument("--span", default=None,
                   help="START,END: only the steps within this perf_counter span (adaptive_spec.py prints "
                        "each run's and records them as rounds_span)")
    p.add_argument("--calibrate", action="store_true",
                   help="replay the log and print what its decode steps took over what the cost model priced "
                        "them at just before, without drafts and with, by batch size (within --span)")
    p.add_argument("--price", default=None,
                   help="R,M: replay the log (to the span's end) into a fresh cost model and print what it "
                        "prices R requests decoding at, without drafts and with M draft rows")
    args = p.parse_args()
    span = tuple(float(x) for x in args.span.split(",")) if args.span else None
    for path in args.logs:
        print(summarise(path, args.reqs, 0 if span else args.skip, span))
        if args.calibrate:
            print(calibration(path, span))
        if args.price:
            reqs, drafts = (int(x) for x in args.price.split(","))
            print(price(cost_model(path, span[1] if span else None), reqs, drafts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
