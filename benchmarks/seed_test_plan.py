"""The accuracy test plan, end to end: serve a model (optionally -dp 2 with a drafter), drive it with
`lm_eval --model local-chat-completions ... num_concurrent=32` on the demo math task, and report
exact_match next to the dp 1 run without speculation, plus the acceptance read from /metrics.

    python benchmarks/seed_test_plan.py [--limit N] [--only 0,1] [--json OUT]

Each configuration is (label, model, extra `phalanx serve` flags). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_util import start_server, stop_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EAGLE = '{"method":"eagle","model":"phalanx-math-eagle","num_speculative_tokens":3}'
MOE_DRAFT = '{"method":"draft_model","model":"phalanx-math-moe-draft","num_speculative_tokens":3}'
CONFIGS = [
    ("dense dp1, no speculation", "phalanx-math", []),
    ("dense dp2 + EAGLE k=3", "phalanx-math", ["-dp", "2", "--speculative-config", EAGLE]),
    ("MoE dp1, no speculation", "phalanx-math-moe", []),
    ("MoE EP dp2 + MoE draft k=3", "phalanx-math-moe",
     ["-dp", "2", "--enable-expert-parallel", "--speculative-config", MOE_DRAFT]),
]


def _spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        pat = re.compile(rf"^phalanx:spec_decode_{name}_total(\{{[^}}]*\}})? ([0-9.e+]+)$", re.M)
        out[name] = sum(float(m.group(2)) for m in pat.finditer(text))
    return out


def run_one(label: str, model: str, flags: list[str], limit: int | None, work: Path) -> dict:
    log = work / f"{re.sub(r'[^a-z0-9]+', '-', label.lower())}.log"
    proc, url = start_server(model, flags, log)
    try:
        out_dir = work / "results" / log.stem
        model_args = (f"model={model},base_url={url}/v1/chat/completions,num_concurrent=32,max_retries=3,"
                      "tokenized_requests=False")
        cmd = [str(Path(sys.executable).with_name("lm_eval")), "--model", "local-chat-completions",
               "--model_args", model_args, "--tasks", "phalanx_math", "--include_path", "evals/phalanx-math",
               "--apply_chat_template", "--output_path", str(out_dir)]
        if limit:
            cmd += ["--limit", str(limit)]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "none"}
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=7200, stdout=subprocess.DEVNULL)
        wall = time.monotonic() - t0
        result_file = sorted(out_dir.rglob("results_*.json"))[-1]
        res = json.loads(result_file.read_text())["results"]["phalanx_math"]
        em = res.get("exact_match,strict-match")
        spec = _spec_counters(url)
    finally:
        code = stop_server(proc)
    mal = 1 + spec["num_accepted_tokens"] / spec["num_drafts"] if spec["num_drafts"] else None
    return {"label": label, "model": model, "flags": " ".join(flags), "exact_match": em, "wall_s": wall,
            "mean_acceptance_length": mal, "server_exit": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=None, help="questions per run (default: the whole split)")
    parser.add_argument("--only", default=None, help="comma-separated config indices to run")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="phalanx-seed-plan-"))
    rows = []
    chosen = [CONFIGS[int(i)] for i in args.only.split(",")] if args.only else CONFIGS
    for label, model, flags in chosen:
        row = run_one(label, model, flags, args.limit, work)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| configuration | exact_match | mean acceptance length | lm_eval wall time | server exit |")
    print("|---|---|---|---|---|")
    for r in rows:
        mal = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "–"
        print(f"| {r['label']} | {r['exact_match']:.3f} | {mal} | {r['wall_s']:.0f} s | {r['server_exit']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
