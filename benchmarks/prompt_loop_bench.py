"""Do long prompts stall the other streams? Streaming ITL at concurrency 16 with a few long chat
prompts mixed in, and how long the API server's event loop takes to answer /health meanwhile.

Starts `phalanx serve MODEL` from `--repo` (default: this checkout; point it at a `git worktree` of
another commit to compare versions), runs `--concurrency` workers that stream short chat requests
(`--num-short` in all) and, spread over the run, `--num-long` chat requests whose user message is
`--long-tokens` tokens of random words (different words each, so no prefix-cache hit). A probe
GETs /health every `--probe-interval` seconds: its latency is the event loop's responsiveness.

Prints, for the short streams only: inter-chunk latency (ITL) p50 / p99 / max, and the /health
probe's p50 / p99 / max. With `--long-endpoint tokenize` the long prompts go to /tokenize instead
(chat template + tokenization, no generation), which isolates the API process's prompt work from
the engine's prefill of those prompts.

    .venv/bin/python benchmarks/prompt_loop_bench.py --model /tmp/smollm2-hf
    .venv/bin/python benchmarks/prompt_loop_bench.py --model /tmp/smollm2-hf --repo /tmp/older-worktree
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_util import REPO, start_server, stop_server  # noqa: E402
from phalanx.bench.serve import client_session, send_request  # noqa: E402

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her all she there would their we him been has when who will more no if out "
    "so said what up its about into than them can only other new some could time these two may then do "
    "first any my now such like our over man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right used take"
).split()


def long_text(tokenizer: object, num_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(num_tokens)]
    while len(tokenizer(" ".join(words)).input_ids) > num_tokens:  # type: ignore[operator]
        words = words[: int(len(words) * 0.97)]
    return " ".join(words)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


async def run(args: argparse.Namespace, base: str, long_prompts: list[str]) -> dict[str, list[float]]:
    url = f"{base}/v1/chat/completions"
    async with client_session(600.0) as client:

        def body(content: str, max_tokens: int) -> dict:
            return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}

        for _ in range(2):  # warm-up
            await send_request(client, url, body("Hello there, how are you?", 4), 0)
        probes: list[float] = []
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                async with client.get(f"{base}/health") as r:
                    await r.read()
                probes.append(time.perf_counter() - t0)
                await asyncio.sleep(args.probe_interval)

        semaphore = asyncio.Semaphore(args.concurrency)
        long_at = {(j + 1) * args.num_short // (len(long_prompts) + 1): p for j, p in enumerate(long_prompts)}
        short_results = []
        long_tasks = []

        async def tokenize(content: str) -> None:
            async with client.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": content}]}) as r:
                r.raise_for_status()
                await r.read()

        def send_long(content: str) -> asyncio.Task:
            if args.long_endpoint == "tokenize":
                return asyncio.create_task(tokenize(content))
            return asyncio.create_task(send_request(client, url, body(content, args.long_output), 0))

        async def short(i: int) -> None:
            async with semaphore:
                if i in long_at:
                    long_tasks.append(send_long(long_at[i]))
                r = await send_request(client, url, body(f"Tell me a short story about the number {i}.", args.short_output), 0)
                short_results.append(r)

        probe_task = asyncio.create_task(probe())
        await asyncio.gather(*(short(i) for i in range(args.num_short)))
        long_results = await asyncio.gather(*long_tasks)
        done.set()
        await probe_task
    failures = [r.error for r in [*short_results, *long_results] if r is not None and not r.success]
    if failures:
        raise RuntimeError(f"{len(failures)} request(s) failed, e.g. {failures[0]}")
    itl = [b - a for r in short_results for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {"itl": itl, "probe": probes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/smollm2-hf")
    ap.add_argument("--repo", default=str(REPO), help="the checkout whose phalanx serves (default: this one)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-short", type=int, default=64)
    ap.add_argument("--short-output", type=int, default=48)
    ap.add_argument("--num-long", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=2048)
    ap.add_argument("--long-output", type=int, default=8)
    ap.add_argument("--long-endpoint", choices=["chat", "tokenize"], default="chat",
                    help="where the long prompts go: chat completions, or /tokenize (the API process's "
                         "prompt work alone, without the engine's prefill)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--probe-interval", type=float, default=0.05)
    ap.add_argument("--serve-flags", default="", help="extra flags for phalanx serve")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    long_prompts = [long_text(tokenizer, args.long_tokens, seed) for seed in range(args.num_long)]
    flags = ["--max-model-len", str(args.max_model_len), "--served-model-name", "m", *args.serve_flags.split()]
    log = Path(tempfile.mkdtemp(prefix="prompt-loop-")) / "server.log"
    proc, base = start_server(args.model, flags, log, cwd=Path(args.repo))
    try:
        result = asyncio.run(run(args, base, long_prompts))
    finally:
        stop_server(proc)
    itl, probe = result["itl"], result["probe"]
    print(f"server code: {args.repo}")
    print(f"short streams: {args.num_short} at concurrency {args.concurrency}, {args.short_output} tokens each; "
          f"{args.num_long} long prompts of {args.long_tokens} tokens mixed in ({args.long_endpoint})")
    print(f"ITL (ms)          p50 {pct(itl, 50):8.1f}  p99 {pct(itl, 99):8.1f}  max {pct(itl, 100):8.1f}  ({len(itl)} gaps)")
    print(f"/health (ms)      p50 {pct(probe, 50):8.1f}  p99 {pct(probe, 99):8.1f}  max {pct(probe, 100):8.1f}  "
          f"({len(probe)} probes)")


if __name__ == "__main__":
    main()
