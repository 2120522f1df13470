"""benchmarks/compare.py's report: tables and plots from synthetic records, written between markers."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parents[2]


def _compare_module():
    spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rec(engine: str, spec: str, dp: int, c: int, tps: float, acc: float | None = None) -> dict:
    return {"engine": engine, "spec": spec, "dp": dp, "concurrency": c, "num_prompts": 8, "input_len": 64,
            "output_len": 32, "dtype": "bfloat16", "date": "2026-11-30T06:00:00+00:00",
            "output_throughput": tps, "failed": 0, "tpot_median_ms": 10.0, "ttft_median_ms": 5.0,
            "e2el_median_ms": 300.0, "acceptance_length": acc}


def test_report_writes_tables_and_plots_between_markers(tmp_path, monkeypatch) -> None:
    compare = _compare_module()
    records = [_rec("phalanx-serve", "none", 1, 1, 10.0), _rec("phalanx-serve", "none", 1, 8, 40.0),
               _rec("phalanx-serve", "ngram", 1, 1, 25.0, 2.5), _rec("phalanx-serve", "ngram", 1, 8, 60.0, 2.5),
               _rec("transformers", "none", 1, 1, 12.0)]
    dp = [_rec("phalanx-serve", "none", 2, 1, 9.0), _rec("phalanx-serve", "none", 2, 8, 50.0)]
    (tmp_path / "r.json").write_text(json.dumps(records))
    (tmp_path / "dp.json").write_text(json.dumps(dp))
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(f"# B\nintro\n{compare.BEGIN}\nold\n{compare.END}\noutro\n")
    argv = ["compare.py", "report", "--results", str(tmp_path / "r.json"), "--dp-results", str(tmp_path / "dp.json"),
            "--doc", str(doc)]
    monkeypatch.setattr(sys, "argv", argv)
    assert compare.main() == 0
    text = doc.read_text()
    assert text.startswith("# B\nintro\n") and text.endswith("outro\n") and "old" not in text
    assert "| phalanx-serve | ngram | 25.0 (2.50×) | 60.0 (1.50×) | 2.50 |" in text
    assert "| transformers | 12.0 | – |" in text
    assert "| phalanx-serve | none | 2 | 9.0 (0.90×) | 50.0 (1.25×) |" in text
    for name in ("bench_throughput_vs_concurrency", "bench_spec_speedup", "bench_dp_scaling"):
        assert (doc.parent / "img" / f"{name}.png").stat().st_size > 1000


def test_repeated_runs_report_their_median() -> None:
    compare = _compare_module()
    runs = [_rec("vllm", "none", 1, 1, t) for t in (200.0, 180.0, 221.0)] + [_rec("vllm", "none", 1, 16, 1100.0)]
    latest = compare._latest(runs)
    assert latest[("vllm", "none", 1, 1)]["output_throughput"] == 200.0
    assert latest[("vllm", "none", 1, 1)]["runs"] == 3 and latest[("vllm", "none", 1, 16)]["runs"] == 1
    two = compare._latest([_rec("vllm", "none", 1, 1, 5.0), _rec("vllm", "none", 1, 1, 9.0)])
    assert two[("vllm", "none", 1, 1)]["output_throughput"] == 5.0  # the lower middle of an even count
