"""`phalanx bench latency | throughput` end to end through the CLI on a tiny model: they run the
engine, generate exactly the tokens they claim, and report figures consistent with their own
measurements (the figures themselves are not asserted: timing belongs in benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.tiny_models import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("LlamaForCausalLM", tmp_path_factory.mktemp("bench_llama"))


def _phalanx(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    from phalanx.entrypoints.cli import main

    code = main(list(args))
    return code, capsys.readouterr().out


def test_bench_latency(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "latency.json"
    threads = torch.get_num_threads()
    try:
        code, text = _phalanx(capsys, "bench", "latency", "--model", str(model_dir), "--dtype", "float32",
                              "--batch-size", "3", "--input-len", "10", "--output-len", "5", "--num-iters-warmup", "1",
                              "--num-iters", "2", "--kv-cache-space", "0.05", "--threads", "1", "--json", str(out),
                              "--label", "tiny")  # fmt: skip
        assert torch.get_num_threads() == 1  # --threads took effect
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "latency" and res["label"] == "tiny"
    assert res["config"]["batch_size"] == 3 and res["config"]["model"] == str(model_dir)
    latencies = res["latencies_s"]
    assert len(latencies) == 2 and all(t > 0 for t in latencies)
    assert res["avg_latency_s"] == pytest.approx(sum(latencies) / 2)
    assert res["output_throughput"] == pytest.approx(3 * 5 / res["avg_latency_s"])
    assert set(res["percentiles_s"]) == {"p10", "p25", "p50", "p75", "p90", "p99"}
    assert res["spec_decode"] is None
    assert f"Avg latency: {res['avg_latency_s']:.4f} s  (batch 3, 10 in / 5 out, 2 iterations)" in text


def test_bench_throughput_with_a_drafter(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A self-draft (the model drafts for itself) accepts every draft: the reported acceptance is exact."""
    out = tmp_path / "throughput.json"
    spec = json.dumps({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 2})
    code, text = _phalanx(capsys, "bench", "throughput", "--model", str(model_dir), "--dtype", "float32",
                          "--num-prompts", "6", "--input-len", "12", "--output-len", "7", "--kv-cache-space", "0.05",
                          "--speculative-config", spec, "--json", str(out))  # fmt: skip
    assert code == 0
    res = json.loads(out.read_text())
    assert (res["num_requests"], res["total_input_tokens"], res["total_output_tokens"]) == (6, 6 * 12, 6 * 7)
    assert res["output_throughput"] == pytest.approx(6 * 7 / res["elapsed_s"])
    assert res["total_token_throughput"] == pytest.approx(6 * (12 + 7) / res["elapsed_s"])
    spec_stats = res["spec_decode"]
    assert spec_stats["num_drafts"] > 0 and spec_stats["acceptance_rate"] == 1.0
    assert spec_stats["num_accepted_tokens"] == spec_stats["num_draft_tokens"]
    assert "Speculative decoding: mean acceptance length" in text and "(6 requests," in text


def test_bench_throughput_on_a_dataset(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"what is {i} + {i}?"}) + "\n" for i in range(3)))
    code, _ = _phalanx(capsys, "bench", "throughput", "--model", str(model_dir), "--dtype", "float32",
                       "--dataset", str(data), "--num-prompts", "5", "--output-len", "4", "--kv-cache-space", "0.05",
                       "--json", str(tmp_path / "out.json"))  # fmt: skip
    assert code == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert (res["num_requests"], res["total_output_tokens"]) == (5, 5 * 4)  # the 3 rows cycled to 5 prompts
    code, _ = _phalanx(capsys, "bench", "throughput", "--model", str(model_dir), "--num-prompts", "0")
    assert code == 2
