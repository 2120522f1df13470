"""`phalanx bench serve`: load-test any OpenAI-compatible server (phalanx, vLLM, ...) over HTTP.

Owns: the request schedule (Poisson arrivals at `--request-rate`, capped by `--max-concurrency`),
streaming each request over SSE with aiohttp and timing its chunks, reading speculative-decoding
counters from `/metrics` before and after the run, the printed report and `--json` output.
Does not own: the metric definitions (``metrics``) or prompt generation (``datasets``).

Output tokens are counted from the final `usage` chunk (`stream_options.include_usage`), which
phalanx and vLLM both send; a server that does not gets one token per content chunk.

The client is aiohttp, as in vLLM's benchmark: it runs on the server's machine, so what it spends
per chunk is taken from the server. httpx's streaming client cost ~4x as much CPU per chunk, enough
to starve a small model's server at high concurrency (docs/benchmarks.md, "The load generator").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from phalanx.bench.datasets import BenchPrompt, load_jsonl, random_prompts
from phalanx.bench.metrics import (
    RequestResult,
    parse_prometheus,
    result_to_dict,
    spec_acceptance,
    spec_counters,
    summarize,
)

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


# ---- schedule -----------------------------------------------------------------------------------
def arrival_delays(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process) of mean 1/rate.

    rate = inf -> all zeros (everything at once). The first request also waits one gap, as in vLLM.
    """
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    return rng.exponential(1.0 / request_rate, size=num_requests).tolist()


def base_url_of(url: str) -> str:
    """'http://h:p/v1/' -> 'http://h:p' (the OpenAI paths and /metrics are added to this)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def request_body(args: argparse.Namespace, prompt: BenchPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if prompt.output_len is not None:
        body["max_tokens"] = prompt.output_len
    if args.ignore_eos:
        body["ignore_eos"] = True  # a vLLM/phalanx extension; plain OpenAI would reject it
    if args.request_seed is not None:
        body["seed"] = args.request_seed
    if args.endpoint == "chat":
        body["messages"] = list(prompt.messages) if prompt.messages else [{"role": "user", "content": prompt.prompt}]
    elif prompt.messages:
        raise ValueError("a dataset row with 'messages' is a chat conversation: send it with --endpoint chat")
    else:
        body["prompt"] = prompt.prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        if "delta" in choice:
            parts.append((choice["delta"] or {}).get("content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


def client_session(request_timeout_s: float, api_key: str | None = None) -> aiohttp.ClientSession:
    """The benchmark's HTTP client (call inside the event loop): no cap on connections (the
    concurrency is the caller's), `request_timeout_s` the most seconds a request may wait for its
    next bytes, 30 s to connect."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=request_timeout_s),
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
    )


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines (without the newline), however the bytes arrive and however long a line."""
    pending = b""
    async for data in content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line
    if pending:
        yield pending


async def send_request(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], prompt_len: int
) -> RequestResult:
    """Stream one request (headers, such as the API key, are the client's: `client_session`);
    never raises (failures are recorded in the result)."""
    result = RequestResult(prompt_len=prompt_len, start=time.perf_counter())
    usage_tokens: int | None = None
    num_chunks = 0
    try:
        async with client.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            done = False
            async for line in _lines(response.content):
                # After [DONE] read on to the end of the body: a response left unread closes its
                # connection, and the next request would open a new one.
                if done or not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                if _chunk_text(chunk):
                    result.chunk_times.append(now)
                    num_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    result.prompt_len = usage.get("prompt_tokens") or prompt_len
        result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        result.success = result.output_tokens > 0 or num_chunks > 0
        if not result.success:
            result.error = "no output"
    except Exception as e:  # noqa: BLE001 - a benchmark counts failures, it does not stop on them
        result.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        result.end = time.perf_counter()
    return result


async def read_metrics(client: aiohttp.ClientSession, base: str) -> dict[str, float] | None:
    try:
        async with client.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=10.0)) as r:
            return parse_prometheus(await r.text()) if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


# ---- the run ------------------------------------------------------------------------------------
def build_prompts(args: argparse.Namespace) -> list[BenchPrompt]:
    tokenizer = None
    if args.tokenizer:
        from phalanx.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    if args.dataset:
        prompts = load_jsonl(args.dataset, args.num_prompts, args.output_len, tokenizer=tokenizer)
        if args.endpoint != "chat" and any(p.messages for p in prompts):
            raise ValueError(f"{args.dataset} has rows with 'messages' (chat conversations): use --endpoint chat")
        return prompts
    as_ids = args.endpoint == "completions" and not args.text_prompts
    return random_prompts(
        args.num_prompts,
        args.input_len,
        args.output_len if args.output_len is not None else 128,
        args.range_ratio,
        args.seed,
        as_ids=as_ids,
        vocab_size=args.vocab_size,
        tokenizer=tokenizer,
    )


async def run_benchmark(args: argparse.Namespace, prompts: list[BenchPrompt]) -> dict[str, Any]:
    base = base_url_of(args.base_url)
    url = base + ENDPOINT_PATHS[args.endpoint]
    async with client_session(args.request_timeout, args.api_key) as client:
        for i in range(args.num_warmups):
            warm = await send_request(client, url, request_body(args, prompts[i % len(prompts)]), 0)
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        before = await read_metrics(client, base)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(prompts))
        bar = tqdm(total=len(prompts), desc="requests", disable=args.disable_tqdm, dynamic_ncols=True)

        async def one(prompt: BenchPrompt) -> RequestResult:
            async with semaphore:
                r = await send_request(client, url, request_body(args, prompt), prompt.prompt_len)
            bar.update(1)
            return r

        tasks = []
        start = time.perf_counter()
        for prompt, delay in zip(prompts, arrival_delays(len(prompts), args.request_rate, args.seed)):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        after = await read_metrics(client, base)
    summary = summarize(results, duration, args.percentiles)
    summary["spec_decode"] = spec_acceptance(
        spec_counters(before) if before else None, spec_counters(after) if after else None
    )
    out: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "label": args.label,
        "client": f"aiohttp {aiohttp.__version__}",
        "config": {
            k: ("inf" if isinstance(v, float) and math.isinf(v) else v)
            for k, v in vars(args).items()
            if k not in ("func", "api_key")
        },
        **summary,
    }
    if args.save_detailed:
        out["requests"] = [result_to_dict(r) for r in results]
    return out


def format_report(res: dict[str, Any]) -> str:
    lines = [f"{' Serving Benchmark Result ':=^60}"]

    def row(name: str, value: Any, fmt: str = "{:.2f}") -> None:
        text = fmt.format(value) if isinstance(value, float) else str(value)
        lines.append(f"{name:<44}{text:>16}")

    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    row("Benchmark duration (s):", res["duration_s"])
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"])
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Total token throughput (tok/s):", res["total_token_throughput"])
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{' ' + title + ' ':-^60}")
        short = key.split("_")[0].upper()
        for stat, value in res[key].items():
            if stat not in ("std", "p50"):  # p50 == median
                row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {short} (ms):", value)
    spec = res.get("spec_decode")
    if spec:
        lines.append(f"{' Speculative Decoding ':-^60}")
        row("Acceptance rate (%):", spec["acceptance_rate"] * 100)
        row("Mean acceptance length:", spec["mean_acceptance_length"])
        row("Drafts:", int(spec["num_drafts"]))
        row("Draft tokens:", int(spec["num_draft_tokens"]))
        row("Accepted tokens:", int(spec["num_accepted_tokens"]))
    if res["errors"]:
        lines.append("errors: " + "; ".join(res["errors"]))
    lines.append("=" * 60)
    return "\n".join(lines)


# ---- CLI ----------------------------------------------------------------------------------------
def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--request-rate must be > 0 or inf, got {text}")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)")
    p.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    p.add_argument("--model", required=True, help="the model name the server expects in requests")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--label", default=None, help="a name for this run, stored in --json output")
    g = p.add_argument_group("prompts")
    g.add_argument("--dataset", default=None, help="JSONL with a question/prompt/text field or a chat 'messages' list (default: random)")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128, help="random prompts: tokens per prompt")
    g.add_argument("--output-len", type=int, default=None,
                   help="max_tokens per request (random default 128; dataset default: the server's)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±ratio)")
    g.add_argument("--tokenizer", default=None, help="tokenizer (a model folder, .gguf, built-in name or hub id): exact-length random text/ids")
    g.add_argument("--vocab-size", type=int, default=1000, help="random ids come from [0, N) without --tokenizer")
    g.add_argument("--text-prompts", action="store_true", help="completions: send random text, not ids")
    g = p.add_argument_group("load")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: all)")
    g.add_argument("--request-rate", type=_rate, default=math.inf, help="Poisson arrivals per second")
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent (one at a time) before timing")
    g.add_argument("--request-timeout", type=float, default=600.0, help="most seconds a request waits for its next bytes")
    g = p.add_argument_group("sampling")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    g.add_argument("--request-seed", type=int, default=None, help="'seed' sent with every request")
    g = p.add_argument_group("output")
    g.add_argument("--percentiles", type=lambda s: [float(x) for x in s.split(",")], default=[50.0, 90.0, 99.0],
                   help="comma-separated, e.g. 50,90,99")
    g.add_argument("--json", default=None, metavar="OUT", help="write all results to this file")
    g.add_argument("--save-detailed", action="store_true", help="include per-request timings in --json")
    g.add_argument("--disable-tqdm", action="store_true")


def run_serve(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        print(f"--num-prompts must be >= 1, got {args.num_prompts}", file=sys.stderr)
        return 2
    prompts = build_prompts(args)
    res = asyncio.run(run_benchmark(args, prompts))
    print(format_report(res))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2, default=str)
    return 0 if res["completed"] > 0 else 1

