"""`phalanx bench serve` end to end against a running `phalanx serve`: every request completes, the
token counts are exactly the ones asked for, and the report's figures are consistent with each other
(the figures themselves are not asserted: timing belongs in benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import API_KEY, MODEL_NAME, ServerProcess


def _bench(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    from phalanx.entrypoints.cli import main

    code = main(["bench", "serve", *args])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve(endpoint: str, server: ServerProcess, tiny_model: Path, tmp_path: Path,
                     capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    out = tmp_path / "serve.json"
    code, text = _bench(capsys, "--base-url", f"{server.base_url}/v1", "--endpoint", endpoint, "--model", MODEL_NAME,
                        "--api-key", API_KEY, "--tokenizer", str(tiny_model), "--num-prompts", "8", "--input-len", "16",
                        "--output-len", "6", "--ignore-eos", "--max-concurrency", "4", "--num-warmups", "1",
                        "--request-rate", "50", "--save-detailed", "--disable-tqdm", "--json", str(out))  # fmt: skip
    assert code == 0, text
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"], res["errors"]) == (8, 0, [])
    assert res["total_output_tokens"] == 8 * 6
    if endpoint == "completions":  # token-id prompts of exactly --input-len (chat adds its template)
        assert res["total_input_tokens"] == 8 * 16
    assert res["request_throughput"] == pytest.approx(8 / res["duration_s"])
    assert res["output_throughput"] == pytest.approx(8 * 6 / res["duration_s"])
    assert len(res["requests"]) == 8
    for r in res["requests"]:
        assert r["success"] and r["output_tokens"] == 6
    assert 0 < res["ttft_ms"]["mean"] <= res["e2el_ms"]["mean"]
    assert "api_key" not in res["config"]
    assert "Successful requests:" in text and "Total generated tokens:" in text
