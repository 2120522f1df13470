"""The demo family's build, training and evaluation scripts run end to end, tiny and fast: a couple of
steps on a few hundred generated problems, through each script's command line (`main(argv)`, what
`python -m phalanx.demo.X ...` runs).

The scripts write next to the package (phalanx/demo/models, build/demo, docs/img, evals/), so they run
in a copy of the checkout in a temp dir, in one child interpreter (one torch import for all of them);
the checkout's own committed models are checked to be untouched. What comes out must be usable: the
trained target and draft load in phalanx and generate, the draft drafting.

Not run here: `train eagle` / `train eagle3`. They cannot run tiny through their command line: they
keep the first 256 distilled sequences for validation (so they need >= 288 train problems for one
batch) and first generate the target's answers to all of them, minutes of CPU on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COPIED = ["phalanx", "csrc", "evals", "pyproject.toml"]
TRAINED = ["phalanx-math", "phalanx-math-draft", "phalanx-math-moe", "phalanx-math-moe-draft"]

# Runs inside the copy: the build script's data stage (the full 60k problems and the tokenizer: the
# committed ones, bit for bit), the drafters' acceptance simulated on the committed models, then small
# splits for two training steps of each model, then their evaluation.
DRIVER = """
from phalanx.demo import build_all, data, evaluate, spec_sim, tokenizer, train

build_all.main(["--only", "data"])
for draft in ["phalanx-math-eagle", "phalanx-math-eagle3", "phalanx-math-draft"]:
    spec_sim.main(["--target", "phalanx-math", "--draft", draft, "-k", "2", "--n", "3",
                   "--json", "build/demo/acceptance.jsonl"])
data.main(["--out", "build/demo/data", "--train", "100", "--val", "6", "--test", "6"])
tokenizer.main(["--data", "build/demo/data", "--out", "build/demo/tokenizer-small"])
for what in ["target", "draft", "moe", "moe-draft"]:
    train.main([what, "--steps", "2"])
evaluate.main(["phalanx-math", "--split", "validation", "--limit", "4", "--show", "0"])
evaluate.main(["phalanx-math-moe", "--split", "build/demo/data/test.jsonl", "--limit", "3", "--show", "0"])
print("DRIVER DONE")
"""


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("demo_copy")
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, root / name)
    (root / "evals" / "phalanx-math" / "phalanx_math_test.jsonl").unlink()  # the build script writes it
    committed = _digest(REPO / "phalanx" / "demo" / "models")
    env = {**os.environ, "PYTHONPATH": str(root), "TQDM_DISABLE": "1"}
    r = subprocess.run([sys.executable, "-c", DRIVER], cwd=root, env=env, capture_output=True, text=True,
                       timeout=270, check=False)  # a ceiling against a hang (pytest's is 300 s)
    log = r.stdout + r.stderr
    assert r.returncode == 0 and "DRIVER DONE" in r.stdout, log[-6000:]
    assert _digest(REPO / "phalanx" / "demo" / "models") == committed  # the checkout's models untouched
    return root, r.stdout


@pytest.mark.slow
def test_build_data_stage_reproduces_the_committed_tokenizer_and_eval_file(built: tuple[Path, str]) -> None:
    from transformers import AutoTokenizer

    root, _ = built
    rebuilt = root / "evals" / "phalanx-math" / "phalanx_math_test.jsonl"
    assert rebuilt.read_bytes() == (REPO / "evals" / "phalanx-math" / "phalanx_math_test.jsonl").read_bytes()
    vocab = AutoTokenizer.from_pretrained(root / "build/demo/tokenizer").get_vocab()
    assert vocab == AutoTokenizer.from_pretrained(REPO / "phalanx/demo/models/phalanx-math").get_vocab()
    assert len((root / "build/demo/data/train.jsonl").read_text().splitlines()) == 100  # the small rerun
    assert len(AutoTokenizer.from_pretrained(root / "build/demo/tokenizer-small")) > 256  # bytes + merges


@pytest.mark.slow
def test_training_writes_every_model_and_its_record(built: tuple[Path, str]) -> None:
    root, _ = built
    for name in TRAINED:
        folder = root / "phalanx" / "demo" / "models" / name
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["vocab_size"] == 925 and cfg["dtype"] == "bfloat16", name
        assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file(), name
        assert (folder / "model.safetensors").read_bytes() != (REPO / "phalanx/demo/models" / name / "model.safetensors").read_bytes()
        record = json.loads((root / "build/demo/results" / f"{name}.json").read_text())
        assert record["name"] == name and record["stages"][0]["steps"] == 2, name
        assert 0.0 <= record["val_accuracy"] <= 1.0 and record["final_val_loss"] > 0, name
        assert (root / "docs" / "img" / f"{name}-loss.png").is_file(), name


@pytest.mark.slow
def test_evaluation_scripts_report(built: tuple[Path, str]) -> None:
    root, out = built
    assert "phalanx-math: greedy exact match" in out and "on 4 problems (validation.jsonl, float32)" in out
    assert "phalanx-math-moe: greedy exact match" in out and "on 3 problems (test.jsonl, float32)" in out
    results = [json.loads(line) for line in (root / "build/demo/acceptance.jsonl").read_text().splitlines()]
    assert [(r["draft"], r["kind"], r["k"], r["n"]) for r in results] == [
        ("phalanx-math-eagle", "eagle", 2, 3), ("phalanx-math-eagle3", "eagle3", 2, 3), ("phalanx-math-draft", "lm", 2, 3)]
    # The committed drafters on the committed target: most of their k = 2 drafts are accepted.
    assert all(2.0 <= r["mean_acceptance_length"] <= 3.0 and r["steps"] > 0 for r in results), results


@pytest.mark.slow
def test_trained_models_serve_in_phalanx(built: tuple[Path, str]) -> None:
    """The scripts' output is what phalanx loads: the target generates, the draft model drafts for it."""
    from phalanx import LLM, SamplingParams

    root, _ = built
    models = root / "phalanx" / "demo" / "models"
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [[{"role": "user", "content": "What is 2 + 3?"}]]
    plain = LLM(str(models / "phalanx-math"), dtype="float32").chat(prompt, params, use_tqdm=False)
    llm = LLM(str(models / "phalanx-math"), dtype="float32",
              speculative_config={"model": str(models / "phalanx-math-draft"), "num_speculative_tokens": 2})
    out = llm.chat(prompt, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.get_metrics()["spec_num_drafts"] > 0
