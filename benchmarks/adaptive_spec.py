"""Adaptive draft length against plain decoding and fixed k, through `phalanx serve`.

For one model and speculative method it compares `plain` (no speculation), `k=1`, `k=2`, `k=3`
(and any other --ks), `dbs=N` with --dbs N (the largest k, drafting only in batches of at most N
requests: `phalanx serve`'s default for SmolLM2 uses 8) and `adaptive` (k = the largest of --ks,
`"adaptive": true`), driving each with greedy streamed chat requests at every concurrency of
--concurrency (one request in flight per slot, --requests-per-slot x concurrency requests, at
least --min-requests), from the model's held-out questions or --dataset.

Servers. Plain decoding and every fixed k run on ONE static server (k = the largest of --ks): a
request opted out with `"speculative": false` decodes as plain decoding does (it never feeds the
drafter), and one capped with `"num_speculative_tokens": j` drafts j tokens every step, as on a
server started with k = j. So the static modes are compared on one engine: two identical engines
differ by 2-5 % in step time on a shared 2-core VM (an A/A run in one process: memory placement),
as much as some differences measured here. `adaptive` and `dbs=N` each have their own server, and
the adaptive server is also measured with every request opted out (`plain@adaptive`): what the
adaptive server gains over plain decoding on the same engine, where drafting pays, and what it
costs where nothing should draft. Modes `k=1@adaptive`, `k=2@adaptive`, ... (given in --modes)
run fixed k on the adaptive server too: every request carries `"speculative_adaptive": false`
and `"num_speculative_tokens": j`, so it drafts j every step, out of the policy's hands. With them
and plain@adaptive the whole comparison runs on one engine, free of the difference between two
servers' engines (on a 2-core VM, plain decoding on two fresh servers of one build differed by up
to ~15 % for a whole run); the policy still learns from their steps, as a server does from any
traffic it serves. `--separate-servers` starts one server per mode instead (plain without a
drafter loaded).

It prints output tokens/s per mode and concurrency, mean TPOT, mean acceptance length and the
draft lengths the adaptive server chose, then the ratios adaptive / max(plain, best fixed k),
adaptive / best fixed k, adaptive / plain@adaptive and adaptive / the best of plain@adaptive
and k=j@adaptive, raw and paired by round, and adaptive against the one same-server mode with the
highest median, paired, with a 90 % bootstrap interval over the rounds. The mixed workload
(--mixed) sends, at the same concurrencies, half the requests with `"speculative": false` and half
with code-like repetitive prompts (which a drafter accepts often); --no-chat runs it alone. Writes
everything to --json and a plot to --plot; --from-json merges saved runs of the same modes (one per
workload or per concurrency) and prints their tables and plot without running anything. Asserts
nothing; run it on a quiet machine (the figures are ratios measured in the same run).

    python benchmarks/adaptive_spec.py --model phalanx-math \\
        --spec '{"method": "eagle", "model": "phalanx-math-eagle"}' \\
        --json benchmarks/results/adaptive_spec_phalanx_math.json --plot docs/img/adaptive_spec_phalanx_math.png
    python benchmarks/adaptive_spec.py --model smollm2-135m-instruct \\
        --spec '{"method": "eagle3", "model": "smollm2-135m-instruct-eagle3"}' --max-tokens 128 \\
        --json benchmarks/results/adaptive_spec_smollm2.json --plot docs/img/adaptive_spec_smollm2.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_util import REPO, start_server, stop_server  # noqa: E402

from phalanx.bench.metrics import RequestResult, parse_prometheus, spec_acceptance, spec_counters, summarize  # noqa: E402
from phalanx.bench.serve import client_session, send_request  # noqa: E402

DEMO_QUESTIONS = REPO / "evals/phalanx-math/phalanx_math_test.jsonl"
_NAMES = ("alpha", "beta", "gamma", "delta", "omega", "theta", "sigma", "kappa")


def questions(path: Path, limit: int) -> list[str]:
    rows = [json.loads(line) for line in path.open()]
    return [r.get("question") or r.get("prompt") or r["text"] for r in rows[:limit]]


def code_like_prompts(n: int, seed: int = 0) -> list[str]:
    """Repetitive code-like text: a table of near-identical assignments to continue."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name = rng.choice(_NAMES)
        start = rng.randint(0, 50)
        lines = [f"{name}_{j} = {name}[{j}] + {j}" for j in range(start, start + 12)]
        out.append("Continue this code:\n" + "\n".join(lines) + f"\n{name}_{start + 12} =")
    return out


def workload(prompts: list[str], code: list[str], mixed: bool, n: int) -> list[tuple[str, bool]]:
    """(prompt, speculative) per request: plain questions, or half opted-out questions and half
    code-like prompts (speculating), interleaved."""
    if not mixed:
        return [(prompts[i % len(prompts)], True) for i in range(n)]
    return [(prompts[i % len(prompts)], False) if i % 2 == 0 else (code[i % len(code)], True) for i in range(n)]


def point_key(name: str, c: int) -> str:
    """A results file's key for one workload at one concurrency ("plain/c16")."""
    return f"{name}/c{c}"


def parse_point_key(key: str) -> tuple[str, int]:
    name, c = key.rsplit("/c", 1)
    return name, int(c)


def workload_label(name: str) -> str:
    """The chat workload is stored under "plain" (every request a plain question) in results files."""
    return "chat" if name == "plain" else name


def chat_body(model: str, prompt: str, speculative: bool, max_tokens: int,
              fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """A greedy chat request for one item: opted out where the item is, else carrying the mode's
    extension `fields`."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0.0}  # fmt: skip
    if not speculative:
        body["speculative"] = False
    elif fields:
        body.update(fields)
    return body


async def run_level(base: str, model: str, items: list[tuple[str, bool]], concurrency: int, max_tokens: int,
                    timeout_s: float, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """All `items` with `concurrency` requests in flight: the summary, the acceptance and the draft
    lengths given and the requests parked (from /metrics read before and after). `fields`: extension fields every request
    carries (a mode on a shared server: `speculative`, `num_speculative_tokens`); an item's own
    opt-out comes first."""
    url = f"{base}/v1/chat/completions"
    async with client_session(timeout_s) as client:
        before = await metrics_text(client, base)
        semaphore = asyncio.Semaphore(concurrency)

        async def one(prompt: str, speculative: bool) -> RequestResult:
            body = chat_body(model, prompt, speculative, max_tokens, fields)
            body.update(stream=True, stream_options={"include_usage": True})
            async with semaphore:
                return await send_request(client, url, body, 0)

        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(one(p, s) for p, s in items)), timeout_s)
        duration = time.perf_counter() - start
        after = await metrics_text(client, base)
    summary = summarize(results, duration)
    parsed = parse_prometheus(before), parse_prometheus(after)
    counters = spec_counters(parsed[0]), spec_counters(parsed[1])
    summary["spec_decode"] = spec_acceptance(*counters) if counters[1] else None
    lengths_before, lengths_after = draft_length_counts(before), draft_length_counts(after)
    summary["draft_lengths"] = {k: v - lengths_before.get(k, 0.0) for k, v in sorted(lengths_after.items())}
    parked = "phalanx:spec_decode_num_parked_requests_total"
    summary["parked"] = parsed[1].get(parked, 0.0) - parsed[0].get(parked, 0.0)
    preempted = "phalanx:num_preemptions_total"  # requests whose KV was freed and recomputed later
    summary["preempted"] = parsed[1].get(preempted, 0.0) - parsed[0].get(preempted, 0.0)
    # perf_counter is CLOCK_MONOTONIC here as in the server: the span cuts a step log
    # (``PHALANX_DEBUG_STEP_LOG``, `step_log.py --span`) to this run's steps
    summary["span"] = [start, start + duration]
    return summary


async def prime_level(base: str, model: str, items: list[tuple[str, bool]], concurrency: int,
                      timeout_s: float) -> None:
    """Each request of the level once, untimed, one token each, as the server's own mode sends it
    (drafting where the item may): its prompt's blocks enter the prefix cache, with the drafter's
    KV where the request may draft, before any mode is timed. Without it the first mode a server
    ran at a level prefilled every prompt that the later ones found cached: on SmolLM2 (mixed
    workload, one request at a time) adaptive, the adaptive server's first, waited 36.8 ms for a
    first token where k = 3 waited 19.4, ~1.5 % of its throughput."""
    url = f"{base}/v1/chat/completions"
    async with client_session(timeout_s) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def one(prompt: str, speculative: bool) -> None:
            async with semaphore, client.post(url, json=chat_body(model, prompt, speculative, 1)) as r:
                r.raise_for_status()
                await r.read()

        await asyncio.wait_for(asyncio.gather(*(one(p, s) for p, s in dict.fromkeys(items))), timeout_s)


async def metrics_text(client: aiohttp.ClientSession, base: str) -> str:
    """The server's /metrics page."""
    async with client.get(f"{base}/metrics") as r:
        r.raise_for_status()
        return await r.text()


def draft_length_counts(text: str) -> dict[str, float]:
    """phalanx:spec_decode_draft_length_total by its `length` label, summed over ranks."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "phalanx:spec_decode_draft_length_total":
                out[s.labels["length"]] = out.get(s.labels["length"], 0.0) + s.value
    return out


AT_ADAPTIVE = "@adaptive"
PLAIN_AT_ADAPTIVE = "plain" + AT_ADAPTIVE


def static_modes(modes: list[str]) -> list[str]:
    """The fixed-k modes on the static server (or their own): k=1, k=2, ..."""
    return [m for m in modes if m.startswith("k=") and not m.endswith(AT_ADAPTIVE)]


def pinned_modes(modes: list[str]) -> list[str]:
    """The fixed-k modes on the adaptive server (k=1@adaptive, ...: `speculative_adaptive: false`)."""
    return [m for m in modes if m.startswith("k=") and m.endswith(AT_ADAPTIVE)]


def mode_server(mode: str, separate: bool) -> tuple[str, dict[str, Any]]:
    """(server, extension fields of its requests) of a mode: plain decoding and fixed k on the one
    static server (opted out, or capped at k), plain@adaptive on the adaptive server, opted out,
    k=j@adaptive there too, drafting j every step; with `separate`, every mode on its own server
    (the @adaptive ones still on the adaptive one)."""
    if mode == PLAIN_AT_ADAPTIVE:
        return "adaptive", {"speculative": False}
    if mode.startswith("k=") and mode.endswith(AT_ADAPTIVE):  # drafting k every step, out of the policy's hands
        return "adaptive", {"num_speculative_tokens": int(mode[2:-len(AT_ADAPTIVE)]), "speculative_adaptive": False}
    if separate or mode == "adaptive" or mode.startswith("dbs="):
        return mode, {}
    if mode == "plain":
        return "static", {"speculative": False}
    return "static", {"num_speculative_tokens": int(mode.split("=")[1])}


def server_flags(server: str, spec: dict[str, Any], max_k: int, extra: list[str]) -> list[str]:
    """`phalanx serve` flags of a server (`mode_server`'s names): the static one at the largest k."""
    if server == "plain":
        return extra
    cfg = dict(spec)
    if server == "adaptive":
        cfg.update(num_speculative_tokens=max_k, adaptive=True)
    elif server.startswith("dbs="):  # static k = max_k with disable_by_batch_size
        cfg.update(num_speculative_tokens=max_k, disable_by_batch_size=int(server.split("=")[1]))
    elif server == "static":
        cfg.update(num_speculative_tokens=max_k)
    else:
        cfg.update(num_speculative_tokens=int(server.split("=")[1]))
    return [*extra, "--speculative-config", json.dumps(cfg)]


def start_servers(args: argparse.Namespace, names: list[str], spec: dict, max_k: int, warm_prompts: list[str],
                  log_dir: Path) -> dict[str, tuple[Any, str]]:
    """The servers named, all up at once (idle ones only poll), each warmed by two requests."""
    servers: dict[str, tuple[Any, str]] = {}
    try:
        for name in names:
            flags = server_flags(name, spec, max_k, ["--max-num-seqs", str(max(args.concurrency)), *args.serve_args])
            proc, base = start_server(args.model, flags, log_dir / f"{name.replace('=', '')}.log")
            servers[name] = (proc, base)
            with httpx.Client(timeout=args.request_timeout) as warm:
                for prompt in warm_prompts[:2]:
                    warm.post(f"{base}/v1/chat/completions", json={
                        "model": args.model, "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": args.max_tokens, "temperature": 0.0}).raise_for_status()  # fmt: skip
    except BaseException:
        for proc, _ in servers.values():
            stop_server(proc)
        raise
    return servers


def run_all(args: argparse.Namespace, modes: list[str], servers: dict[str, tuple[Any, str]],
            work: dict[str, list[tuple[str, bool]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every workload at every concurrency (ascending: the adaptive server learns from the load it
    has seen, as a real one does); at each, every server first takes the level's prompts
    (`prime_level`), then --repeats rounds over the modes in turn, so that a machine drifting over
    the run shifts every mode alike. Each figure: the round with the median output throughput."""
    results: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in modes}
    for name, items_all in work.items():
        for c in args.concurrency:
            items = items_all[: max(args.min_requests, args.requests_per_slot * c)]
            for server in dict.fromkeys(mode_server(m, args.separate_servers)[0] for m in modes):
                asyncio.run(prime_level(servers[server][1], args.model, items, c, args.level_timeout))
            rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for rnd in range(args.repeats):
                # Every other round in reverse order: a machine drifting within a round then favours
                # neither the first mode nor the last.
                for mode in modes if rnd % 2 == 0 else modes[::-1]:
                    server, fields = mode_server(mode, args.separate_servers)
                    res = asyncio.run(run_level(servers[server][1], args.model, items, c, args.max_tokens,
                                                args.level_timeout, fields))  # fmt: skip
                    rounds[mode].append(res)
                    acc = (res["spec_decode"] or {}).get("mean_acceptance_length", float("nan"))
                    print(f"{mode:>9} {name:>6} c={c:<3} {res['output_throughput']:8.1f} tok/s  "
                          f"TPOT {res['tpot_ms'].get('mean', float('nan')):7.2f} ms  acc len {acc:.2f}  "
                          f"failed {res['failed']}  lengths {res['draft_lengths']}  parked {res['parked']:.0f}  "
                          f"preempted {res['preempted']:.0f}  "
                          f"span {res['span'][0]:.3f},{res['span'][1]:.3f}", flush=True)
            for mode in modes:
                ordered = sorted(rounds[mode], key=lambda r: r["output_throughput"])
                median = ordered[len(ordered) // 2]
                median["rounds_output_throughput"] = [r["output_throughput"] for r in rounds[mode]]
                median["rounds_span"] = [r["span"] for r in rounds[mode]]
                results[mode][point_key(name, c)] = median
    return results


def table(results: dict[str, dict[str, dict[str, Any]]], modes: list[str], name: str, levels: list[int]) -> str:
    """Medians per mode, their ratios, and the paired ratios: adaptive against the others measured
    in the same round (one round takes a minute or two, over which this kind of shared machine
    drifts by ~10 %: a ratio within a round cancels most of that), the median over the rounds; with
    plain@adaptive, adaptive against plain decoding on its own server too, paired likewise."""
    fixed, pinned = static_modes(modes), pinned_modes(modes)
    columns = ["adaptive / max(plain, best k)", "adaptive / best k", "paired: adaptive / max(plain, best k)",
               "paired: adaptive / best k"]
    same_server = PLAIN_AT_ADAPTIVE in modes
    if same_server:
        columns.append("paired: adaptive / plain@adaptive")
    if pinned:
        columns.append("paired: adaptive / max(plain@adaptive, best k@adaptive)")
        columns.append("paired: adaptive / the best mode@adaptive [90 % interval]")
    head = "| c | " + " | ".join(f"{m} tok/s" for m in modes) + " | " + " | ".join(columns) + " |"
    lines = [head, "|" + "---|" * (len(modes) + len(columns) + 1)]
    for c in levels:
        point = {m: results[m][point_key(name, c)] for m in modes}
        tput = {m: point[m]["output_throughput"] for m in modes}
        rounds = [{m: point[m]["rounds_output_throughput"][i] for m in modes}
                  for i in range(min(len(point[m]["rounds_output_throughput"]) for m in modes))]
        paired = [_ratios(r, fixed) for r in rounds]
        figures = [*_ratios(tput, fixed), *(_median([p[j] for p in paired]) for j in (0, 1))]
        if same_server:
            figures.append(_median([r["adaptive"] / r[PLAIN_AT_ADAPTIVE] for r in rounds]))
        interval = ""
        if pinned:
            same = [m for m in [PLAIN_AT_ADAPTIVE, *pinned] if m in modes]  # the adaptive server's other modes
            figures.append(_median([r["adaptive"] / max(r[m] for m in same) for r in rounds]))
            best, mid, lo, hi = best_mode_ratio(rounds, same)
            interval = f" | {mid:.3f} [{lo:.3f}, {hi:.3f}] ({best})"
        lines.append(f"| {c} | " + " | ".join(f"{tput[m]:.1f}" for m in modes)
                     + "".join(f" | {x:.3f}" for x in figures) + interval + " |")  # fmt: skip
    return "\n".join(lines)


def best_mode_ratio(rounds: list[dict[str, float]], candidates: list[str], resamples: int = 2000
                    ) -> tuple[str, float, float, float]:
    """Adaptive against the one candidate mode with the highest median over the rounds (the setting
    a user would pick), paired by round: the median ratio and its 90 % bootstrap interval (rounds
    resampled with replacement, a fixed seed). The round-by-round maximum of several close modes
    (the column before) is biased low: it takes each round's luckiest mode."""
    best = max(candidates, key=lambda m: _median([r[m] for r in rounds]))
    ratios = np.array([r["adaptive"] / r[best] for r in rounds])
    rng = np.random.default_rng(0)
    medians = np.median(ratios[rng.integers(0, len(ratios), size=(resamples, len(ratios)))], axis=1)
    return best, float(np.median(ratios)), float(np.quantile(medians, 0.05)), float(np.quantile(medians, 0.95))


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else float("nan")


def _ratios(tput: dict[str, float], fixed: list[str]) -> tuple[float, float]:
    """adaptive / max(plain, best fixed k) and adaptive / best fixed k (nan where a mode is missing)."""
    nan = float("nan")
    best_k = max((tput[m] for m in fixed), default=nan)
    better = max((x for x in (tput.get("plain", nan), best_k) if x == x), default=nan)
    ad = tput.get("adaptive", nan)
    return (ad / better if better > 0 else nan), (ad / best_k if best_k > 0 else nan)


def plot(results: dict, modes: list[str], names: list[str], levels: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        for m in modes:
            ax.plot(levels, [results[m][point_key(name, c)]["output_throughput"] for c in levels], marker="o",
                    label=m, linewidth=2.5 if m == "adaptive" else 1.2)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{title}: {workload_label(name)} workload")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="phalanx-math")
    p.add_argument("--spec", default='{"method": "eagle", "model": "phalanx-math-eagle"}',
                   help="speculative config without num_speculative_tokens (the script sets k)")
    p.add_argument("--ks", default="1,2,3", help="fixed draft lengths to compare (e.g. 1,2,3,5)")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--requests-per-slot", type=int, default=3, help="requests per concurrency slot")
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="rounds over the modes at each point (median)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dataset", default=None, help="JSONL with question/prompt/text (default: the demo questions)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="run the chat workload (every request may speculate)")
    p.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the mixed workload (half opted out, half code-like prompts)")
    p.add_argument("--modes", default=None, help="subset of modes, e.g. plain,k=1,adaptive (default: all)")
    p.add_argument("--dbs", type=int, default=None,
                   help="also a static mode with the largest k and this disable_by_batch_size (mode dbs=N)")
    p.add_argument("--separate-servers", action="store_true",
                   help="one server per mode (plain without a drafter) instead of one static server for "
                        "plain and every fixed k")
    p.add_argument("--serve-args", default="", help="extra `phalanx serve` flags, e.g. '--num-threads 2'")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--level-timeout", type=float, default=1800.0, help="ceiling per (mode, workload, c)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="run nothing: merge the results of these --json files (runs of the same modes, e.g. "
                        "one per workload or per concurrency) and print their tables and --plot")
    args = p.parse_args()
    if args.from_json:
        return report_saved([Path(f) for f in args.from_json], Path(args.plot) if args.plot else None)
    args.concurrency = sorted(int(c) for c in args.concurrency.split(","))
    args.serve_args = args.serve_args.split()
    ks = sorted(int(k) for k in args.ks.split(","))
    modes = args.modes.split(",") if args.modes else ["plain", *(f"k={k}" for k in ks), "adaptive", PLAIN_AT_ADAPTIVE]
    if args.dbs is not None:
        modes.insert(modes.index("adaptive") if "adaptive" in modes else len(modes), f"dbs={args.dbs}")
    for m in [PLAIN_AT_ADAPTIVE, *pinned_modes(modes)]:
        if m in modes and "adaptive" not in modes:
            p.error(f"mode {m} needs mode adaptive")
    if not (args.chat or args.mixed):
        p.error("--no-chat with --no-mixed leaves no workload to run")
    spec = json.loads(args.spec)
    if "num_speculative_tokens" in spec or "adaptive" in spec:
        p.error("--spec must leave out num_speculative_tokens and adaptive (the script sets them per mode)")
    n_max = max(args.min_requests, args.requests_per_slot * max(args.concurrency))
    prompts = questions(Path(args.dataset) if args.dataset else DEMO_QUESTIONS, max(n_max, 64))
    work = {"plain": workload(prompts, [], False, n_max)} if args.chat else {}
    if args.mixed:
        work["mixed"] = workload(prompts, code_like_prompts(n_max), True, n_max)
    log_dir = Path("/tmp") / f"adaptive_spec_{int(time.time())}"
    log_dir.mkdir(parents=True)
    names = list(dict.fromkeys(mode_server(m, args.separate_servers)[0] for m in modes))
    servers = start_servers(args, names, spec, max(ks), prompts, log_dir)
    try:
        results = run_all(args, modes, servers, work)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)

    print(f"\n{args.model} + {spec}, max_tokens {args.max_tokens}, greedy chat, "
          f"{platform.processor() or platform.machine()}")  # fmt: skip
    print_tables(results, modes, list(work), args.concurrency)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": args.model, "spec": spec, "ks": ks, "max_tokens": args.max_tokens,
                "concurrency": args.concurrency, "cpu": _cpu_name(), "command": " ".join(sys.argv),
                "client": f"aiohttp {aiohttp.__version__}",
                "servers": {m: mode_server(m, args.separate_servers) for m in modes}}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=str))
    if args.plot:
        plot(results, modes, list(work), args.concurrency, Path(args.plot), args.model)
    return 0 if all(r["failed"] == 0 for m in results.values() for r in m.values()) else 1


def print_tables(results: dict, modes: list[str], names: list[str], levels: list[int]) -> None:
    for name in names:
        print(f"\n{workload_label(name)} workload (output tokens/s)\n" + table(results, modes, name, levels))
    if "adaptive" in modes:
        print("\nadaptive draft lengths chosen (counts per length):")
        for name in names:
            for c in levels:
                res = results["adaptive"][point_key(name, c)]
                print(f"  {workload_label(name)} c={c}: {res['draft_lengths']}, "
                      f"requests parked {res.get('parked', 0):.0f}")


def merge_saved(docs: list[dict]) -> tuple[dict, list[str], list[str], list[int]]:
    """One results table from several --json files: their modes must agree; a (workload,
    concurrency) point measured twice is refused rather than silently overwritten."""
    modes = list(docs[0]["results"])
    merged: dict[str, dict[str, Any]] = {m: {} for m in modes}
    for doc in docs:
        if list(doc["results"]) != modes:
            raise ValueError(f"runs measured different modes: {modes} and {list(doc['results'])}")
        for m, points in doc["results"].items():
            for point, res in points.items():
                if point in merged[m]:
                    raise ValueError(f"point {point} of mode {m} is in more than one file")
                merged[m][point] = res
    points = [parse_point_key(key) for key in merged[modes[0]]]
    names = list(dict.fromkeys(name for name, _ in points))
    levels = sorted({c for _, c in points})
    for m in modes:
        missing = [point_key(n, c) for n in names for c in levels if point_key(n, c) not in merged[m]]
        if missing:
            raise ValueError(f"mode {m} lacks {missing}: the files do not cover a full grid")
    return merged, modes, names, levels


def report_saved(paths: list[Path], plot_path: Path | None) -> int:
    docs = [json.loads(path.read_text()) for path in paths]
    results, modes, names, levels = merge_saved(docs)
    for doc in docs:
        meta = doc["meta"]
        for run in meta.get("runs", [meta]):
            print(f"run: {run.get('command', '?')} ({run.get('cpu', '?')})")
    print_tables(results, modes, names, levels)
    if plot_path:
        meta = docs[0]["meta"]
        plot(results, modes, names, levels, plot_path, meta.get("model") or meta["runs"][0]["model"])
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
