"""Bad input raises a clear error naming the value and what is valid, and leaves the engine usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx import LLM, SamplingParams
from tests.tiny_models import VOCAB, make_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(str(make_model("LlamaForCausalLM", tmp_path_factory.mktemp("m"))), dtype="float32", max_model_len=64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-3), "top_k must be"),
        (dict(n=0), "n must be an integer >= 1"),
        (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(stop=[""]), "non-empty strings"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_bad_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_keeps_working(llm: LLM) -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt has 64 tokens but max_model_len is 64"):
        llm.generate({"prompt_token_ids": [5] * 64}, use_tqdm=False)
    with pytest.raises(ValueError, match=f"token id {VOCAB + 7} is outside the vocabulary; valid ids are 0..{VOCAB - 1}"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [VOCAB + 7]}], use_tqdm=False)
    with pytest.raises(ValueError, match="token id -1"):
        llm.generate({"prompt_token_ids": [-1]}, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    # Nothing was queued by the failed calls; the engine still answers.
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture_and_sliding_window(tmp_path: Path) -> None:
    folder = make_model("LlamaForCausalLM", tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*supported: LlamaForCausalLM"):
        LLM(str(folder))
    (folder / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "sliding_window": 32}))
    with pytest.raises(ValueError, match=r"sliding-window attention \(sliding_window=32\).*max_model_len <= 32"):
        LLM(str(folder), max_model_len=64)
    LLM(str(folder), max_model_len=32)  # a window as long as the context is full attention


def test_bad_engine_arguments(tmp_path: Path) -> None:
    folder = make_model("LlamaForCausalLM", tmp_path / "m")
    with pytest.raises(ValueError, match="dtype 'float8'"):
        LLM(str(folder), dtype="float8")
    with pytest.raises(ValueError, match="block_size must be"):
        LLM(str(folder), block_size=3)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(str(folder), max_model_len=256, num_kv_blocks=2)
