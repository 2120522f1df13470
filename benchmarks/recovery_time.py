"""Recovery time after a rank's death, next to the model's load time (docs/dp-protocol.md).

For each configuration (`dense`: `phalanx-math` -dp 2 + EAGLE, independent ranks; `moe`:
`phalanx-math-moe` expert parallel -dp 2 + its MoE draft model, lockstep), serves it, streams
`--requests` greedy completions, kills rank 1 (SIGKILL) once every stream shows text, and reads
from the server's log:

* load time: each rank's first process, start -> ready ("engine rank R ready (...) in X s");
* recovery: death noticed -> first token of a replayed request ("recovered ... X s after it");
* ready again: death -> the replacement (or the re-formed group) reports ready.

It also measures from the client: kill -> the first chunk of a stream that had stopped (the longest
gap any stream saw around the kill). Repeats `--trials` times per configuration on one server (the
default restart budget allows 3). Every stream must finish with the text of its undisturbed twin.

    .venv/bin/python benchmarks/recovery_time.py --trials 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import CONFIGS  # noqa: E402 - the same served configurations as the soak


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, shown: asyncio.Event,
                  chunk_times: list[float]) -> str:
    text = ""
    body = {"model": "rec", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                chunk_times.append(time.monotonic())
                shown.set()
    return text


async def _trial(url: str, log: Path, prompts: list[str], max_tokens: int, kill: bool) -> tuple[list[str], float]:
    """Stream every prompt; with `kill`, SIGKILL rank 1 once all show text. Returns (texts, the longest
    gap between consecutive chunks of one stream that spans the kill)."""
    events = [asyncio.Event() for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        tasks = [asyncio.create_task(_stream(client, p, max_tokens, e, t)) for p, e, t in zip(prompts, events, times)]
        gap = 0.0
        if kill:
            await asyncio.gather(*(e.wait() for e in events))
            pid = int(re.findall(r"engine rank 1 ready \(pid (\d+)", log.read_text())[-1])
            t_kill = time.monotonic()
            os.kill(pid, signal.SIGKILL)
        texts = await asyncio.gather(*tasks)
        if kill:
            for ts in times:
                after = [t for t in ts if t > t_kill]
                before = [t for t in ts if t <= t_kill]
                if after and before:
                    gap = max(gap, after[0] - t_kill)
    return texts, gap


def _ranks_up(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith("phalanx:engine_rank_up"))


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.serve_util import start_server, stop_server
    from phalanx.demo.tokenizer import prompt_text

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="dense,moe")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    prompts = [prompt_text(f"What is {11 * i + 3} + {7 * i + 5}?") for i in range(args.requests)]
    report = {}
    ok = True
    for name in args.configs.split(","):
        model, flags = CONFIGS[name]
        log = Path(tempfile.mkdtemp(prefix="phalanx-rec-")) / "server.log"
        proc, url = start_server(model, [*flags, "--served-model-name", "rec", "--max-model-len", "512",
                                         "--log-stats-interval", "0"], log)
        try:
            want, _ = asyncio.run(_trial(url, log, prompts, args.max_tokens, kill=False))
            gaps = []
            for _ in range(args.trials):
                texts, gap = asyncio.run(_trial(url, log, prompts, args.max_tokens, kill=True))
                ok &= texts == want
                gaps.append(round(gap, 2))
                deadline = time.monotonic() + 300
                while _ranks_up(url) < 2 and time.monotonic() < deadline:
                    time.sleep(0.2)
        finally:
            code = stop_server(proc)
        text = log.read_text()
        report[name] = {
            "load_time_s": [float(x) for x in re.findall(r"KV blocks\) in ([\d.]+) s", text)],
            "recovery_first_token_s": [float(x) for x in re.findall(r"replayed request ([\d.]+) s after", text)],
            "ready_again_s": [float(x) for x in re.findall(r"again after ([\d.]+) s", text)],
            "client_gap_after_kill_s": gaps,
            "texts_equal_undisturbed": ok,
            "server_exit": code,
        }
        r = report[name]
        load = max(r["load_time_s"]) if r["load_time_s"] else float("nan")
        print(f"{name}: load {r['load_time_s']} s; recovery (death -> first token) {r['recovery_first_token_s']} s "
              f"= {[round(x / load, 2) for x in r['recovery_first_token_s']]} x load; ready again {r['ready_again_s']} s; "
              f"client gap after kill {gaps} s; texts equal: {ok}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
