"""Soak: mixed load for minutes with engine ranks killed (kill -9) in the middle; nothing may be lost.

Serves the demo models data-parallel with speculative decoding (`--config dense`: `phalanx-math`
-dp 2 + its EAGLE head, independent ranks; `--config moe`: `phalanx-math-moe` expert parallel -dp 2
+ its MoE draft model, lockstep) and runs `--clients` concurrent client loops for `--duration`
seconds. Each request draws: chat or completions, streamed or not, n in {1, 2, 3}, logprobs, stop
strings, greedy / seeded / unseeded sampling, max_tokens 16-96; 20 % of streams disconnect
mid-stream and 5 % of requests are aborted by a short client timeout (those count as abandoned,
not lost). At 1/3 and 2/3 of the run one rank (rank 1, then rank 0) is killed with SIGKILL.

Reported: requests sent / completed / abandoned / lost (lost: not abandoned by the client and not
completed — a non-200, an error event, a stream cut before `[DONE]`; goal 0), greedy requests whose
text differs from the first answer to the same request (goal 0: batch-invariant bf16 kernels and
exact replays), p50 / p99 end-to-end latency and time to first chunk before, during and after each
fault (by request start: "during" is from the kill until the rank serves again), the recovery times
the server logged (death -> first token of a replayed request; death -> ready again; the model's
load time), RSS of the API process and of the whole tree at start and end, KV usage once idle, and
whether any engine process outlived the server.

    .venv/bin/python benchmarks/soak.py --duration 600                    # the 10-minute soak
    .venv/bin/python benchmarks/soak.py --config moe --duration 240
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CONFIGS = {
    "dense": ("phalanx-math", ["-dp", "2", "--speculative-config",
                               '{"method": "eagle", "model": "phalanx-math-eagle", "num_speculative_tokens": 3}']),
    "moe": ("phalanx-math-moe", ["-dp", "2", "--enable-expert-parallel", "--speculative-config",
                                 '{"method": "draft_model", "model": "phalanx-math-moe-draft", '
                                 '"num_speculative_tokens": 3}']),
}
STOPS = [["= 1"], ["0\n", "9 "], ["?"]]


@dataclass
class Result:
    start: float
    kind: str
    outcome: str  # completed | abandoned | lost
    latency: float | None = None
    first_chunk: float | None = None
    detail: str = ""


@dataclass
class Soak:
    base_url: str
    rng: random.Random
    questions: list[str]
    completion_prompts: dict[str, str]  # question -> its chat-formatted prompt text (completions)
    results: list[Result] = field(default_factory=list)
    greedy_texts: dict[str, list[str]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)

    def body(self) -> tuple[str, dict, str | None, bool, bool]:
        """(path, body, greedy key or None, disconnect mid-stream, abort by timeout)."""
        rng = self.rng
        chat = rng.random() < 0.4
        stream = rng.random() < 0.65
        n = rng.choices([1, 2, 3], [70, 20, 10])[0]
        q = rng.choice(self.questions)
        b: dict = {"model": "soak", "max_tokens": rng.choice([16, 32, 48, 64, 96]), "n": n, "stream": stream}
        if chat:
            b["messages"] = [{"role": "user", "content": q}]
        else:
            b["prompt"] = self.completion_prompts[q]
        if rng.random() < 0.3:
            b["stop"] = rng.choice(STOPS)
        if rng.random() < 0.25:
            if chat:
                b.update(logprobs=True, top_logprobs=2)
            else:
                b["logprobs"] = 2
        mode = rng.choice(["greedy", "seeded", "random"])
        if mode == "greedy":
            b["temperature"] = 0.0
        else:
            b["temperature"] = 0.8
            if mode == "seeded":
                b["seed"] = rng.randrange(1000)
        key = json.dumps({k: v for k, v in b.items() if k != "stream"}, sort_keys=True) if mode == "greedy" else None
        drop = stream and rng.random() < 0.2
        abort = not stream and rng.random() < 0.05
        return ("/v1/chat/completions" if chat else "/v1/completions"), b, key, drop, abort

    async def one(self, client: httpx.AsyncClient) -> None:
        path, body, key, drop, abort = self.body()
        kind = f"{'chat' if 'messages' in body else 'cmpl'}-{'stream' if body['stream'] else 'plain'}"
        t0 = time.monotonic()
        res = Result(t0, kind, "lost")
        texts: list[str] = [""] * body["n"]
        try:
            if not body["stream"]:
                resp = await client.post(path, json=body, timeout=0.2 if abort else 300)
                if resp.status_code != 200:
                    res.detail = f"{resp.status_code} {resp.text[:200]}"
                else:
                    for c in resp.json()["choices"]:
                        texts[c["index"]] = c["text"] if "text" in c else c["message"]["content"]
                    res.outcome, res.latency = "completed", time.monotonic() - t0
            else:
                chunks, done, finished = 0, False, [False] * body["n"]
                async with client.stream("POST", path, json=body, timeout=300) as resp:
                    if resp.status_code != 200:
                        res.detail = f"{resp.status_code}"
                    else:
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            if line == "data: [DONE]":
                                done = True
                                break
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                res.detail = json.dumps(chunk)[:200]
                                break
                            chunks += 1
                            if res.first_chunk is None:
                                res.first_chunk = time.monotonic() - t0
                            for c in chunk["choices"]:
                                texts[c["index"]] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                                finished[c["index"]] |= c.get("finish_reason") is not None
                            if drop and chunks >= 2:
                                res.outcome = "abandoned"
                                break
                if res.outcome != "abandoned" and done and all(finished):
                    res.outcome, res.latency = "completed", time.monotonic() - t0
                elif res.outcome != "abandoned" and not res.detail:
                    res.detail = "stream ended before [DONE] / a finish reason"
        except httpx.TimeoutException:
            if abort:
                res.outcome = "abandoned"
            else:
                res.detail = "client timeout"
        except httpx.HTTPError as e:
            res.detail = f"{type(e).__name__}: {e}"
        self.results.append(res)
        if key is not None and res.outcome == "completed":
            seen = self.greedy_texts.setdefault(key, texts)
            if seen != texts:
                self.mismatches.append(f"{key[:120]}: {seen} != {texts}")

    async def client_loop(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.base_url) as client:
            while time.monotonic() < deadline:
                await self.one(client)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _tree_rss_mib(pid: int) -> tuple[float, float]:
    import psutil

    p = psutil.Process(pid)
    api = p.memory_info().rss
    return api / 2**20, (api + sum(c.memory_info().rss for c in p.children(recursive=True))) / 2**20


def _current_pid(log: Path, rank: int) -> int:
    return int(re.findall(rf"engine rank {rank} ready \(pid (\d+)", log.read_text())[-1])


def _metric_sum(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


async def _faults(soak: Soak, log: Path, t_start: float, duration: float, marks: list[tuple[str, float]]) -> None:
    """Kill rank 1 at 1/3 and rank 0 at 2/3 of the run; record when each rank serves again."""
    for i, rank in enumerate((1, 0)):
        await asyncio.sleep(max(0.0, t_start + duration * (i + 1) / 3 - time.monotonic()))
        pid = _current_pid(log, rank)
        deaths = await asyncio.to_thread(_metric_sum, soak.base_url, "phalanx:engine_rank_deaths_total")
        os.kill(pid, signal.SIGKILL)
        marks.append((f"kill {i + 1}", time.monotonic()))
        print(f"killed rank {rank} (pid {pid})", flush=True)
        # The death seen by the server, then every rank serving again.
        while await asyncio.to_thread(_metric_sum, soak.base_url, "phalanx:engine_rank_deaths_total") <= deaths:
            await asyncio.sleep(0.1)
        while await asyncio.to_thread(_metric_sum, soak.base_url, "phalanx:engine_rank_up") < 2:
            await asyncio.sleep(0.2)
        marks.append((f"up {i + 1}", time.monotonic()))


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.serve_util import start_server, stop_server
    from phalanx.demo.tokenizer import prompt_text

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="dense")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    model, flags = CONFIGS[args.config]
    log = Path(tempfile.mkdtemp(prefix="phalanx-soak-")) / "server.log"
    proc, url = start_server(model, [*flags, "--served-model-name", "soak", "--max-model-len", "512",
                                     "--log-stats-interval", "30"], log)
    rng = random.Random(args.seed)
    questions = [f"What is {rng.randint(2, 99)} + {rng.randint(2, 99)}?" for _ in range(40)]
    soak = Soak(url, rng, questions, {q: prompt_text(q) for q in questions})
    rss_start = _tree_rss_mib(proc.pid)
    marks: list[tuple[str, float]] = []

    async def run() -> None:
        t0 = time.monotonic()
        deadline = t0 + args.duration
        marks.append(("start", t0))
        await asyncio.gather(*(soak.client_loop(deadline) for _ in range(args.clients)),
                             _faults(soak, log, t0, args.duration, marks))
        marks.append(("end", time.monotonic()))

    try:
        asyncio.run(run())
        rss_end = _tree_rss_mib(proc.pid)
        idle_deadline = time.monotonic() + 60
        while True:
            text = httpx.get(f"{url}/metrics").text
            usage = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("phalanx:kv_cache_usage_perc")]
            if all(u == 0 for u in usage) or time.monotonic() > idle_deadline:
                break
            time.sleep(0.5)
        health = httpx.get(f"{url}/health").status_code
        engine_pids = [int(p) for p in re.findall(r"engine rank \d+ ready \(pid (\d+)", log.read_text())]
    finally:
        code = stop_server(proc)
    time.sleep(2)
    orphans = [p for p in engine_pids if os.path.exists(f"/proc/{p}")]
    server_log = log.read_text()

    # Windows by request start: before kill 1, kill 1 -> serving again, between, kill 2 -> serving, after.
    t = dict(marks)
    windows = [("before", t["start"], t["kill 1"]), ("fault 1", t["kill 1"], t["up 1"]),
               ("between", t["up 1"], t["kill 2"]), ("fault 2", t["kill 2"], t["up 2"]), ("after", t["up 2"], t["end"])]
    rows = []
    for name, lo, hi in windows:
        rs = [r for r in soak.results if lo <= r.start < hi]
        lat = [r.latency for r in rs if r.latency is not None]
        ttfc = [r.first_chunk for r in rs if r.first_chunk is not None and r.outcome == "completed"]
        rows.append({"window": name, "seconds": round(hi - lo, 1), "sent": len(rs),
                     "completed": sum(r.outcome == "completed" for r in rs),
                     "lost": sum(r.outcome == "lost" for r in rs),
                     "p50_s": _round(_pct(lat, 0.5)), "p99_s": _round(_pct(lat, 0.99)),
                     "ttfc_p50_s": _round(_pct(ttfc, 0.5)), "ttfc_p99_s": _round(_pct(ttfc, 0.99))})
    lost = [r for r in soak.results if r.outcome == "lost"]
    summary = {
        "config": args.config, "model": model, "flags": flags, "duration_s": args.duration, "clients": args.clients,
        "sent": len(soak.results), "completed": sum(r.outcome == "completed" for r in soak.results),
        "abandoned": sum(r.outcome == "abandoned" for r in soak.results), "lost": len(lost),
        "lost_examples": [f"{r.kind}: {r.detail}" for r in lost[:10]],
        "greedy_repeats_checked": sum(1 for _ in soak.greedy_texts), "greedy_mismatches": len(soak.mismatches),
        "mismatch_examples": soak.mismatches[:3], "windows": rows,
        "recovery_first_token_s": [float(x) for x in re.findall(r"first token of a replayed request ([\d.]+) s", server_log)],
        "ready_again_s": [float(x) for x in re.findall(r"ready \(pid \d+, \d+ KV blocks\) again after ([\d.]+) s", server_log)],
        "load_time_s": [float(x) for x in re.findall(r"ready \(pid \d+, \d+ KV blocks\) in ([\d.]+) s", server_log)],
        "group_reformed_s": [float(x) for x in re.findall(r"lockstep group re-formed in ([\d.]+) s", server_log)],
        "rss_mib_start": {"api": round(rss_start[0]), "tree": round(rss_start[1])},
        "rss_mib_end": {"api": round(rss_end[0]), "tree": round(rss_end[1])},
        "kv_usage_idle": usage, "health_after": health, "server_exit": code, "orphans": orphans,
    }
    print(json.dumps(summary, indent=1))
    print(f"\n{'window':<9} {'s':>6} {'sent':>5} {'done':>5} {'lost':>4} {'p50':>6} {'p99':>6} {'ttfc50':>6} {'ttfc99':>6}")
    for r in rows:
        print(f"{r['window']:<9} {r['seconds']:>6} {r['sent']:>5} {r['completed']:>5} {r['lost']:>4} "
              f"{_fmt(r['p50_s'])} {_fmt(r['p99_s'])} {_fmt(r['ttfc_p50_s'])} {_fmt(r['ttfc_p99_s'])}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
    ok = not lost and not soak.mismatches and health == 200 and code == 0 and not orphans
    return 0 if ok else 1


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _fmt(x: float | None) -> str:
    return f"{x:>6.2f}" if x is not None else f"{'-':>6}"


if __name__ == "__main__":
    sys.exit(main())
