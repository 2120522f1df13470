"""The plots of docs/benchmarks.md, one per workload, drawn from the committed result files.

Owns: reading `benchmarks/results/` (the records `compare.py run`, `engine_vs_transformers.py
--json` and `spec_bench.py` wrote), printing the figures each plot shows (so the doc's tables can be
checked against them), and writing one PNG per workload under `docs/img/`. Measures nothing and
never edits the doc's text.

    python benchmarks/plot_results.py [--results benchmarks/results] [--img docs/img]
    python benchmarks/plot_results.py --smollm2 benchmarks/results/FILE.json   # a compare.py record file

Workloads and their files:
  phalanx-math  spec_bench_phalanx_math.txt (spec_bench.py's output: medians over rounds)
                -> bench_phalanx_math.png: tok/s vs concurrency per method; acceptance length per method
  llama40m      compare_llama40m_vllm.json (phalanx serve and vLLM, paired runs) and
                engine_vs_transformers_llama40m.json -> bench_llama40m.png
  smollm2       a compare.py record file given with --smollm2 (any engines and methods)
                -> bench_smollm2.png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LABELS = {"phalanx-serve": "phalanx serve", "phalanx-offline": "phalanx LLM", "vllm": "vLLM CPU",
          "llamacpp": "llama.cpp", "transformers": "transformers"}


def _compare_module() -> Any:
    """compare.py's report helpers (its median-run rule), without duplicating them here."""
    spec = importlib.util.spec_from_file_location("bench_compare", REPO / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spec_bench_table(path: Path) -> dict[str, dict[str, Any]]:
    """The median table spec_bench.py prints last: method -> tok/s at c = 1 and 16, acceptance."""
    rows: dict[str, dict[str, Any]] = {}
    text = path.read_text(encoding="utf-8")
    table = text.split("medians of", 1)[1]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not re.match(r"^[\d.]+$", cells[1]):
            continue
        acc = None if cells[9] == "–" else float(cells[9].split("/")[0])
        rows[cells[0]] = {"tok_s": {1: float(cells[1]), 16: float(cells[5])},
                          "tpot_ms": {1: float(cells[3]), 16: float(cells[7])}, "acceptance": acc}
    if "none" not in rows:
        raise ValueError(f"{path}: no median table with a 'none' row")
    return rows


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _throughput_axes(ax: Any, series: dict[str, dict[int, float]], title: str) -> None:
    cs = sorted({c for pts in series.values() for c in pts})
    for i, (label, pts) in enumerate(series.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[c] for c in xs], marker="o", color=f"C{i}", label=label)
    ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="output tok/s (log)", title=title)
    ax.set_xticks(cs, [str(c) for c in cs], minor=False)
    ax.set_xticks([], minor=True)
    ax.legend(fontsize=8)


def _acceptance_axes(ax: Any, acceptance: dict[str, float], k: int, title: str) -> None:
    names = list(acceptance)
    ax.bar(range(len(names)), [acceptance[n] for n in names], color=[f"C{i + 1}" for i in range(len(names))])
    for i, n in enumerate(names):
        ax.text(i, acceptance[n], f"{acceptance[n]:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(k + 1, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set(ylim=(0, k + 1.4), ylabel=f"mean acceptance length (max {k + 1})", title=title)


def plot_phalanx_math(results: Path, img: Path) -> Path:
    rows = spec_bench_table(results / "spec_bench_phalanx_math.txt")
    for method, r in rows.items():
        print(f"phalanx-math {method:>12}: c=1 {r['tok_s'][1]:7.1f}  c=16 {r['tok_s'][16]:7.1f}  "
              f"acceptance {r['acceptance']}")
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    _throughput_axes(left, {m: r["tok_s"] for m, r in rows.items()}, "phalanx-math, offline LLM, k = 3")
    _acceptance_axes(right, {m: r["acceptance"] for m, r in rows.items() if r["acceptance"]}, 3,
                     "Acceptance length per method (k = 3)")
    fig.tight_layout()
    out = img / "bench_phalanx_math.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _runs_by_key(records: list[dict]) -> dict[tuple, list[float]]:
    runs: dict[tuple, list[float]] = {}
    for r in records:
        runs.setdefault((r["engine"], r["spec"], r["dp"], r["concurrency"]), []).append(r["output_throughput"])
    return runs


def plot_llama40m(results: Path, img: Path) -> Path:
    records = json.loads((results / "compare_llama40m_vllm.json").read_text())
    latest = _compare_module()._latest(records)
    for key, runs in sorted(_runs_by_key(records).items()):
        print(f"llama40m {key[0]:>14} c={key[3]:<3} runs {[round(t, 1) for t in runs]}  "
              f"plotted {latest[key]['output_throughput']:.1f}")
    series: dict[str, dict[int, float]] = {}
    for (engine, spec, dp, c), r in latest.items():
        if spec == "none" and dp == 1:
            series.setdefault(LABELS.get(engine, engine), {})[c] = r["output_throughput"]
    evt = json.loads((results / "engine_vs_transformers_llama40m.json").read_text())
    bars = {name: (evt[name]["phalanx"]["tok_s_median"], evt[name]["transformers"]["tok_s_median"])
            for name in ("b1", "mixed")}
    for name, (ph, hf) in bars.items():
        print(f"llama40m vs transformers {name:>5}: phalanx {ph:.1f}  transformers {hf:.1f}  ratio {ph / hf:.2f}")
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    _throughput_axes(left, series, "40M Llama, served: 128 in / 128 out")
    labels = ["batch 1\n32 in / 128 out", "32 mixed requests\n16-256 in / 32-128 out"]
    for j, (who, color) in enumerate((("phalanx (LLM)", "C0"), ("transformers generate", "C2"))):
        vals = [bars["b1"][j], bars["mixed"][j]]
        ax_x = [i + j * 0.38 for i in range(2)]
        right.bar(ax_x, vals, 0.38, color=color, label=who)
        for x, v in zip(ax_x, vals):
            right.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    right.set_xticks([i + 0.19 for i in range(2)], labels, fontsize=8)
    right.set(ylabel="output tok/s (median of runs)", title="40M Llama, offline vs transformers")
    right.legend(fontsize=8)
    fig.tight_layout()
    out = img / "bench_llama40m.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_smollm2(path: Path, img: Path) -> Path:
    """Any compare.py record file: one line per (engine, method) at dp 1; acceptance per method."""
    records = json.loads(path.read_text())
    latest = _compare_module()._latest(records)
    series: dict[str, dict[int, float]] = {}
    acceptance: dict[str, float] = {}
    for (engine, spec, dp, c), r in sorted(latest.items()):
        if dp != 1:
            continue
        label = LABELS.get(engine, engine) + ("" if spec == "none" else f" {spec}")
        series.setdefault(label, {})[c] = r["output_throughput"]
        if r.get("acceptance_length"):
            acceptance[label] = r["acceptance_length"]
        print(f"smollm2 {label:>24} c={c:<3} {r['output_throughput']:8.1f} tok/s  runs {r['runs']}")
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if acceptance else 1, figsize=(10 if acceptance else 5.5, 4), squeeze=False)
    _throughput_axes(axes[0][0], series, "SmolLM2-135M-Instruct, bf16, served")
    if acceptance:
        _acceptance_axes(axes[0][1], acceptance, 3, "Acceptance length per method")
    fig.tight_layout()
    out = img / "bench_smollm2.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--img", type=Path, default=REPO / "docs" / "img")
    p.add_argument("--smollm2", type=Path, default=None, help="a compare.py record file of SmolLM2 runs")
    args = p.parse_args()
    args.img.mkdir(parents=True, exist_ok=True)
    outs = [plot_phalanx_math(args.results, args.img), plot_llama40m(args.results, args.img)]
    if args.smollm2:
        outs.append(plot_smollm2(args.smollm2, args.img))
    for out in outs:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
