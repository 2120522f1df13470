"""What the adaptive policy's own work costs the engine, offline: an adaptive engine serves a set of
prompts (`--concurrency` at a time, `--rounds` times after a warm-up), its scheduler's and policy's
entry points timed with perf_counter around every call, and each one's time printed as a share of
the engine's step time (with its mean per call and its calls), by round. A static engine's run
(`--static`: the method's k for every request) gives the scheduler's own share to hold it against.
Where two rounds' throughputs differ by the machine's spells, these shares do not: they are the
policy's work against the steps it ran in.

    python benchmarks/policy_overhead.py --model phalanx-math \\
        --spec '{"method": "eagle", "model": "phalanx-math-eagle", "num_speculative_tokens": 3}' \\
        --questions evals/phalanx-math/phalanx_math_test.jsonl --concurrency 16 --rounds 3
    python benchmarks/policy_overhead.py ... --static   # the same without the policy

Asserts nothing; the timers add ~1 us a call.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (module path, class name or None for a module-level function, attribute names)
TIMED = (
    ("phalanx.core.scheduler", "Scheduler", ("_draft_lengths",)),
    ("phalanx.engine.engine_core", "EngineCore", ("step",)),
    ("phalanx.spec_decode.adaptive", "AdaptiveDrafting", ("choose", "_reuse")),
    ("phalanx.spec_decode.adaptive", "StepCostModel", ("step_cost", "fit", "drafted_near", "request_cost")),
    ("phalanx.spec_decode.adaptive", "AcceptanceStats", ("rate_rows",)),
    # the policy module's functions, as the adaptive module calls them
    ("phalanx.spec_decode.adaptive", None, ("choose_draft_lengths_small", "prefer_uniform", "uniform_rates")),
)


def install_timers(seconds: dict[str, float], calls: dict[str, int]) -> list[tuple[Any, str, Any]]:
    """Wrap every entry point of TIMED so that each call adds its seconds and one call under its
    name; returns (owner, name, original) for each, to put them back."""
    import importlib

    def timed(f: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
                calls[name] = calls.get(name, 0) + 1
        return wrapper

    originals = []
    for module_name, owner_name, names in TIMED:
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name)
        for name in names:
            original = getattr(owner, name)
            originals.append((owner, name, original))
            setattr(owner, name, timed(original, name))
    return originals


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="phalanx-math")
    p.add_argument("--spec", default='{"method": "eagle", "model": "phalanx-math-eagle", "num_speculative_tokens": 3}')
    p.add_argument("--questions", default="evals/phalanx-math/phalanx_math_test.jsonl",
                   help="JSONL with a `question`, `prompt` or `text` per row")
    p.add_argument("--prompts", type=int, default=128, help="prompts a round")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--static", action="store_true", help="the method's k for every request, no policy")
    args = p.parse_args()

    seconds: dict[str, float] = {}
    calls: dict[str, int] = {}
    install_timers(seconds, calls)
    from adaptive_spec import questions  # (run as a script: benchmarks/ is on the path)

    from phalanx import LLM, SamplingParams

    prompts = questions(Path(args.questions), args.prompts)
    spec = {**json.loads(args.spec), "adaptive": not args.static}
    llm = LLM(args.model, speculative_config=spec, max_num_seqs=args.concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[: args.concurrency], params, use_tqdm=False)  # warm-up
    print(f"{'static' if args.static else 'adaptive'} engine, {args.model}, {args.concurrency} at a time, "
          f"{len(prompts)} prompts a round; each entry point's share of the engine's step time "
          "(mean per call, calls)")
    for r in range(args.rounds):
        seconds.clear()
        calls.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        step = seconds.get("step", 0.0)
        parts = sorted(((k, v) for k, v in seconds.items() if k != "step"), key=lambda kv: -kv[1])
        print(f"round {r}: {tokens / wall:.0f} tok/s, {calls.get('step', 0)} steps, "
              f"{1e3 * step / max(calls.get('step', 1), 1):.2f} ms a step")
        for name, s in parts:
            print(f"    {name:28s} {100 * s / step:5.2f} %  ({1e6 * s / calls[name]:6.0f} us x {calls[name]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
