"""SmolLM2-135M-Instruct served with and without speculation: output tok/s vs concurrency for plain
phalanx, n-gram (k = 3), the committed EAGLE-3 head (k = 3) and, when its venv is given, llama.cpp
serving a bf16 GGUF of the same weights. Every system is measured in the same run, round-robin per
repeat (the machine is shared: compare ratios within a run), with `phalanx bench serve` sending greedy
chat requests: the held-out conversations of the head's built-in prompt set (6,000 prompts, seed 0;
never trained on), each sent whole (its system message too, where it has one). Also reads
the acceptance per draft position from each speculative server's /metrics. Writes a JSON file and a
plot; asserts nothing.

    python benchmarks/eagle_smollm2_bench.py --out benchmarks/results/eagle_smollm2 \\
        [--concurrency 1,4,16] [--repeats 2] [--max-tokens 128] [--threads 2] \\
        [--llamacpp-venv /tmp/llamacpp/venv --llamacpp-gguf /tmp/smollm2-bf16.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_util import start_server, stop_server  # noqa: E402

from phalanx.net import free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"
HEAD = "smollm2-135m-instruct-eagle3"
SYSTEMS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "eagle3": {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 3},
}


def write_prompts(path: Path, n: int) -> None:
    from phalanx.training.prompts import builtin_prompt_set

    held = builtin_prompt_set(6000, seed=0).held_out
    if len(held) < n:
        raise SystemExit(f"only {len(held)} held-out prompts")
    with open(path, "w") as f:
        for conv in held[:n]:
            f.write(json.dumps({"messages": conv}) + "\n")


def per_position(url: str) -> list[float]:
    """Accepted tokens per draft position so far (phalanx's per-position counter)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "phalanx:spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(s.labels.get("position", 0))
                out[pos] = out.get(pos, 0.0) + s.value
    return [out[i] for i in sorted(out)]


def drafts(url: str) -> float:
    import httpx

    from phalanx.bench.metrics import parse_prometheus, spec_counters

    c = spec_counters(parse_prometheus(httpx.get(f"{url}/metrics", timeout=30).text))
    return c["num_drafts"] if c else 0.0


def bench(url: str, model: str, prompts: Path, concurrency: int, num: int, max_tokens: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "phalanx.entrypoints.cli", "bench", "serve", "--base-url", url, "--model", model,
           "--endpoint", "chat", "--dataset", str(prompts), "--num-prompts", str(num), "--output-len",
           str(max_tokens), "--max-concurrency", str(concurrency), "--num-warmups", "2", "--disable-tqdm",
           "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def start_llamacpp(venv: Path, gguf: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(threads), "--n_ctx", "4096", "--model_alias", MODEL,
           "--interrupt_requests", "False"]  # its default cancels the running request when another arrives
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"llama.cpp did not start:\n{log.read_text()[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON results and the plot")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompts-per-client", type=int, default=8, help="requests per concurrent client")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="engine threads (phalanx) / n_threads (llama.cpp)")
    ap.add_argument("--systems", default="plain,ngram,eagle3")
    ap.add_argument("--spec-extra", default=None,
                    help="JSON merged into the eagle3 speculative config (e.g. disable_by_batch_size)")
    ap.add_argument("--llamacpp-venv", type=Path, default=None)
    ap.add_argument("--llamacpp-gguf", type=Path, default=None)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    conc = [int(c) for c in a.concurrency.split(",")]
    num = {c: max(8, c * a.prompts_per_client) for c in conc}
    prompts = a.out / "prompts.jsonl"
    write_prompts(prompts, max(num.values()))
    systems = a.systems.split(",")
    if a.llamacpp_venv is not None:
        systems.append("llama.cpp")
    results: list[dict] = []
    for rep in range(a.repeats):
        for name in systems:
            log = a.out / f"{name}-{rep}.log"
            if name == "llama.cpp":
                proc, url = start_llamacpp(a.llamacpp_venv, a.llamacpp_gguf, a.threads, log)
            else:
                spec = SYSTEMS[name]
                if name == "eagle3" and a.spec_extra:
                    spec = {**spec, **json.loads(a.spec_extra)}
                flags = ["--dtype", "bfloat16", "--max-model-len", "2048", "--num-threads", str(a.threads),
                         "--served-model-name", MODEL, "--log-stats-interval", "0"]
                if spec is not None:
                    flags += ["--speculative-config", json.dumps(spec)]
                proc, url = start_server(MODEL, flags, log)
            try:
                for c in conc:
                    before_pos = per_position(url) if name in ("ngram", "eagle3") else []
                    before_drafts = drafts(url) if name in ("ngram", "eagle3") else 0.0
                    r = bench(url, MODEL, prompts, c, num[c], a.max_tokens, a.out / f"{name}-c{c}-{rep}.json")
                    row = {"system": name, "repeat": rep, "concurrency": c, "num_prompts": num[c],
                           "output_tok_s": r["output_throughput"], "tpot_ms": r["tpot_ms"]["mean"],
                           "output_tokens": r["total_output_tokens"], "load_avg_1m": os.getloadavg()[0]}
                    if name in ("ngram", "eagle3"):
                        pos = per_position(url)
                        n = drafts(url) - before_drafts
                        acc = [(p - q) / n for p, q in zip(pos, before_pos + [0.0] * len(pos))] if n else []
                        row["acceptance_per_position"] = [round(x, 4) for x in acc]
                        row["mean_acceptance_length"] = round(1 + sum(acc), 4)
                    results.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                if name == "llama.cpp":
                    proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                else:
                    stop_server(proc)
            time.sleep(2)
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, a.out / "tok_s_vs_concurrency.png")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name in dict.fromkeys(r["system"] for r in results):
        cs = sorted({r["concurrency"] for r in results if r["system"] == name})
        means = [sum(r["output_tok_s"] for r in results if r["system"] == name and r["concurrency"] == c) /
                 max(1, sum(1 for r in results if r["system"] == name and r["concurrency"] == c)) for c in cs]
        ax.plot(cs, means, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M-Instruct, greedy chat, 2 cores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
