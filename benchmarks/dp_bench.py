"""Data-parallel benchmarks (issue: DP serving): the lockstep vote's cost per step, and DP 2 vs DP 1
throughput at 32 concurrent requests (one thread per rank). Prints figures; asserts nothing.

    python benchmarks/dp_bench.py vote [--ranks 2] [--votes 2000]
    python benchmarks/dp_bench.py scaling [--model phalanx-math] [--dp 1,2] [--num-prompts 96] [...extra serve flags]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_util import start_server, stop_server  # noqa: E402

from phalanx.net import free_port  # noqa: E402


def _vote_rank(rank: int, size: int, port: int, votes: int, check: bool, out: mp.Queue) -> None:
    import torch

    torch.set_num_threads(1)
    from phalanx.distributed.group import DPGroup
    from phalanx.distributed.vote import decide, local_row

    group = DPGroup(rank, size, f"tcp://127.0.0.1:{port}", 60.0, check)
    times = []
    for step in range(votes):
        t = time.perf_counter()
        table = group.vote(local_row(True, 32, 32, 32, False, step, deeper=(32, 32)))
        decide(table, 3, True)
        group.step += 1
        times.append(time.perf_counter() - t)
    group.close()
    out.put((rank, times[votes // 10 :]))  # drop warm-up


def bench_vote(ranks: int, votes: int) -> None:
    for check in (False, True):
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_vote_rank, args=(r, ranks, port, votes, check, q)) for r in range(ranks)]
        for p in procs:
            p.start()
        results = [q.get(timeout=300) for _ in procs]
        for p in procs:
            p.join()
        times = sorted(t for _, ts in results for t in ts)
        label = "vote + decide" + (" (with collective check)" if check else "")
        print(
            f"{label}, {ranks} ranks, gloo: mean {statistics.mean(times) * 1e3:.3f} ms, "
            f"p50 {times[len(times) // 2] * 1e3:.3f} ms, p99 {times[int(len(times) * 0.99)] * 1e3:.3f} ms"
        )


def bench_scaling(model: str, dps: list[int], num_prompts: int, concurrency: int, extra: list[str]) -> None:
    results = {}
    tmp = Path(tempfile.mkdtemp(prefix="phalanx-dp-bench-"))
    for dp in dps:
        proc, url = start_server(model, ["-dp", str(dp), "--log-level", "warning", *extra], tmp / f"serve-dp{dp}.log")
        try:
            out = tmp / f"dp{dp}.json"
            subprocess.run(
                [sys.executable, "-m", "phalanx.bench", "serve", "--base-url", url,
                 "--model", model, "--endpoint", "chat", "--dataset", str(_dataset()), "--num-prompts",
                 str(num_prompts), "--max-concurrency", str(concurrency), "--temperature", "0",
                 "--num-warmups", "2", "--json", str(out), "--disable-tqdm"],
                cwd=REPO, check=True, timeout=1800,
            )
            results[dp] = json.loads(out.read_text())
        finally:
            stop_server(proc)
    base = results[dps[0]]["output_throughput"]
    for dp, r in results.items():
        print(f"-dp {dp}: {r['output_throughput']:.1f} output tok/s ({r['output_throughput'] / base:.2f}x of -dp {dps[0]}), "
              f"{r.get('request_throughput', 0):.2f} req/s")


def _dataset() -> Path:
    found = sorted((REPO / "evals").rglob("*test*.jsonl"))
    if not found:
        raise FileNotFoundError("no evals/**/*test*.jsonl dataset found")
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vote")
    v.add_argument("--ranks", type=int, default=2)
    v.add_argument("--votes", type=int, default=2000)
    s = sub.add_parser("scaling")
    s.add_argument("--model", default="phalanx-math")
    s.add_argument("--dp", default="1,2")
    s.add_argument("--num-prompts", type=int, default=96)
    s.add_argument("--max-concurrency", type=int, default=32)
    args, extra = parser.parse_known_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.cmd == "vote":
        bench_vote(args.ranks, args.votes)
    else:
        bench_scaling(args.model, [int(x) for x in args.dp.split(",")], args.num_prompts, args.max_concurrency, extra)


if __name__ == "__main__":
    main()
