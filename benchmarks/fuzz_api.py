"""Fuzz the OpenAI-compatible API with schemathesis against the server's own OpenAPI schema.

Serves a model (default: the demo `phalanx-math`, two ranks, a short context so that generated
requests stay cheap), runs `schemathesis run` on /v1/chat/completions, /v1/completions, /tokenize,
/detokenize and /v1/models (coverage and fuzzing phases), and reports: requests sent, responses by
status code, check failures by check (5xx: `not_a_server_error`; our responses against our schema:
`response_schema_conformance`, `status_code_conformance`, `content_type_conformance`,
`response_headers_conformance`), `/health` after the run, and the server's RSS before and after.
The goal: 0 responses 5xx, 0 schema violations, healthy after.

`negative_data_rejection` (a request that violates the schema must get a 4xx) is reported as well,
not gated: pydantic's lax mode accepts what JSON Schema calls a type error ("5" for 5, false for 0).

    .venv/bin/python benchmarks/fuzz_api.py --max-examples 400      # >= 2,000 requests
    .venv/bin/python benchmarks/fuzz_api.py --max-examples 30 --seed 1  # what the suite runs (smaller)

`run_schemathesis` is shared with the bounded in-suite run (tests/e2e/test_fuzz_api.py).
"""

from __future__ import annotations

import argparse
import base64
import collections
import glob
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

GATED_CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
)
OPERATIONS = r"^/(v1/chat/completions|v1/completions|v1/models|tokenize|detokenize)$"


@dataclass
class FuzzSummary:
    requests: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    by_operation: dict[str, collections.Counter] = field(default_factory=dict)
    check_failures: collections.Counter = field(default_factory=collections.Counter)
    failure_examples: list[str] = field(default_factory=list)  # status + body of a few failures
    exit_code: int = 0
    seconds: float = 0.0
    output_tail: str = ""

    @property
    def num_5xx(self) -> int:
        return sum(n for status, n in self.by_status.items() if status >= 500)

    def gated_failures(self) -> int:
        return sum(self.check_failures[c] for c in GATED_CHECKS)


def run_schemathesis(
    base_url: str,
    max_examples: int,
    seed: int | None = None,
    workers: int = 1,
    checks: tuple[str, ...] = GATED_CHECKS,
    max_time_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> FuzzSummary:
    """Run the schemathesis CLI against a live server and summarise its ndjson report."""
    with tempfile.TemporaryDirectory(prefix="phalanx-fuzz-") as report_dir:
        cmd = [
            sys.executable, "-m", "schemathesis.cli", "run", f"{base_url}/openapi.json",
            "--checks", ",".join(checks),
            "--include-path-regex", OPERATIONS,
            "--phases", "coverage,fuzzing",
            "--max-examples", str(max_examples),
            "--workers", str(workers),
            "--request-timeout", "120",
            "--continue-on-failure",
            "--report", "ndjson", "--report-dir", report_dir,
            "--generation-database", "none",
        ]
        if seed is not None:
            cmd += ["--seed", str(seed)]
        if max_time_s is not None:
            cmd += ["--max-time", str(int(max_time_s))]
        for name, value in (headers or {}).items():
            cmd += ["-H", f"{name}: {value}"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        summary = FuzzSummary(exit_code=proc.returncode, seconds=time.monotonic() - t0,
                              output_tail=(proc.stdout + proc.stderr)[-4000:])
        for path in glob.glob(f"{report_dir}/*.ndjson"):
            with open(path) as f:
                for line in f:
                    _add_event(summary, json.loads(line))
    return summary


def _add_event(summary: FuzzSummary, event: dict) -> None:
    scenario = event.get("ScenarioFinished")
    if not scenario or "recorder" not in scenario:
        return
    rec = scenario["recorder"]
    label = rec.get("label", "?")
    ops = summary.by_operation.setdefault(label, collections.Counter())
    for interaction in rec.get("interactions", {}).values():
        response = interaction.get("response")
        if response is None:
            continue
        summary.requests += 1
        summary.by_status[response["status_code"]] += 1
        ops[response["status_code"]] += 1
    for case_id, checks in rec.get("checks", {}).items():
        for check in checks:
            if check.get("status") != "failure":
                continue
            summary.check_failures[check["name"]] += 1
            if len(summary.failure_examples) < 10:
                response = rec.get("interactions", {}).get(case_id, {}).get("response") or {}
                body = response.get("content", {}).get("$base64", "")
                text = base64.b64decode(body).decode(errors="replace")[:300] if body else ""
                summary.failure_examples.append(f"{label} {check['name']}: {response.get('status_code')} {text}")


def _rss_mib(pid: int) -> float:
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def main() -> int:
    import httpx

    from benchmarks.serve_util import start_server, stop_server

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="phalanx-math")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--max-examples", type=int, default=400, help="per operation and phase (schemathesis)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--also-negative", action="store_true", help="also run negative_data_rejection (reported)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/fuzz_api.json"))
    args = ap.parse_args()

    log = Path(tempfile.mkdtemp(prefix="phalanx-fuzz-")) / "server.log"
    proc, url = start_server(args.model, ["-dp", str(args.dp), "--max-model-len", str(args.max_model_len),
                                          "--served-model-name", "fuzz", "--log-stats-interval", "0"], log)
    try:
        rss_before = _rss_mib(proc.pid)
        checks = GATED_CHECKS + (("negative_data_rejection",) if args.also_negative else ())
        s = run_schemathesis(url, args.max_examples, args.seed, args.workers, checks)
        health = httpx.get(f"{url}/health", timeout=10).status_code
        rss_after = _rss_mib(proc.pid)
    finally:
        code = stop_server(proc)
    print(f"schemathesis: {s.requests} requests in {s.seconds:.0f} s ({args.model}, -dp {args.dp}, "
          f"max_model_len {args.max_model_len}, max_examples {args.max_examples}, seed {args.seed})")
    print(f"responses by status: {dict(sorted(s.by_status.items()))}")
    for op, counts in sorted(s.by_operation.items()):
        print(f"  {op}: {dict(sorted(counts.items()))}")
    print(f"5xx responses: {s.num_5xx}; gated check failures: {s.gated_failures()}; all check failures: "
          f"{dict(s.check_failures)}")
    for example in s.failure_examples:
        print("  failure:", example)
    print(f"/health after: {health}; server RSS (API + engines) {rss_before:.0f} -> {rss_after:.0f} MiB; exit {code}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": args.model, "dp": args.dp, "max_model_len": args.max_model_len, "max_examples": args.max_examples,
        "seed": args.seed, "requests": s.requests, "seconds": round(s.seconds, 1),
        "by_status": {str(k): v for k, v in sorted(s.by_status.items())},
        "by_operation": {op: {str(k): v for k, v in sorted(c.items())} for op, c in s.by_operation.items()},
        "check_failures": dict(s.check_failures), "num_5xx": s.num_5xx, "health_after": health,
        "rss_mib_before": round(rss_before), "rss_mib_after": round(rss_after), "server_exit": code,
    }, indent=1))
    ok = s.num_5xx == 0 and s.gated_failures() == 0 and health == 200 and code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
