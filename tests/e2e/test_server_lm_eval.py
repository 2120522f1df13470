"""`lm_eval --model local-chat-completions` runs fully offline against `phalanx serve` (DESIGN §7)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import API_KEY, MODEL_NAME, REPO, ServerProcess

TASK_DIR = Path(__file__).parent / "lm_eval_task"


def _lm_eval() -> str:
    exe = Path(sys.executable).with_name("lm_eval")
    if exe.is_file():
        return str(exe)
    found = shutil.which("lm_eval")
    if found is None:
        pytest.skip('lm_eval is not installed (pip install "lm-eval[api]")')
    return found


@pytest.mark.slow
def test_lm_eval_local_chat_completions(server: ServerProcess, tmp_path: Path) -> None:
    out_dir = tmp_path / "results"
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "OPENAI_API_KEY": API_KEY,
    }
    model_args = (
        f"model={MODEL_NAME},base_url={server.base_url}/v1/chat/completions,num_concurrent=4,max_retries=1"
    )
    cmd = [
        _lm_eval(), "--model", "local-chat-completions", "--model_args", model_args,
        "--tasks", "phalanx_tiny", "--include_path", str(TASK_DIR.relative_to(REPO)), "--apply_chat_template",
        "--output_path", str(out_dir),
    ]  # fmt: skip
    # The timeout is a ceiling against a hang (below pytest's 300 s per test), not a speed requirement.
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    files = list(out_dir.rglob("results_*.json"))
    assert len(files) == 1, r.stderr[-2000:]
    report = json.loads(files[0].read_text())
    assert "exact_match,none" in report["results"]["phalanx_tiny"]
    assert report["n-samples"]["phalanx_tiny"]["effective"] == 6  # every question got an answer
