"""The API server process never imports torch (~240 MB of its resident memory): its modules, its
start-up (the configuration check, the tokenizer, a GGUF's conversion) and a request's way through
it (chat template, tokenization, detokenization, streaming) run in a fresh interpreter that must end
without torch in `sys.modules`. tests/e2e/test_server_lifecycle.py checks a served process's memory
maps the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEXT = "Héllo wörld 12 + 7 <|im_end|>  tabs\t"  # encoded, and its ids decoded backwards
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]

# What `phalanx serve` runs in its own process before and while serving, short of spawning the engine
# ranks: the CLI's parsing, `serve.run`'s configuration check, the tokenizer, the model size the CPU
# placement reads, and the real app (on tests/fake_engine.py) answering chat and completion requests.
FRONT_END = r"""
import asyncio, json, sys

from phalanx.config import ModelConfig
from phalanx.entrypoints import serve
from phalanx.entrypoints.cli import build_parser, serve_config_from_args
from tests.fake_engine import fake_app

text, messages = json.loads(sys.argv[3])

cfg = serve_config_from_args(build_parser().parse_args(json.loads(sys.argv[1])))
serve.check_config(cfg)
args, tokenizer = serve.with_tokenizer(cfg)
model = ModelConfig.from_hf(args.model, args.dtype, resolve_dtype=False)
assert model.active_parameters() > 0
assert model.dtype == sys.argv[2], model.dtype


async def main() -> None:
    chat = {"messages": messages, "max_tokens": 3}
    async with fake_app(tokenizer, vocab_size=model.vocab_size, max_model_len=256) as (http, engine, _):
        r = await http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        r = await http.post("/v1/chat/completions", json={**chat, "stream": True, "logprobs": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        r = await http.post("/v1/completions", json={"prompt": "1 + 1 =", "max_tokens": 2, "stop": ["x"]})
        assert r.status_code == 200, r.text
        assert len(engine.added) == 3


asyncio.run(main())
print(json.dumps({
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "tokenizer": type(tokenizer).__name__,
    "ids": tokenizer(text)["input_ids"],
    "text": tokenizer.decode(tokenizer(text)["input_ids"][::-1]),
    "chat": tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
    "eos": args.extra_eos_token_ids,
}))
"""


def _run_front_end(argv: list[str], dtype: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", FRONT_END, json.dumps(["serve", *argv]), dtype, json.dumps([TEXT, MESSAGES])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_front_end_modules_import_no_torch() -> None:
    modules = [
        "phalanx.entrypoints.cli",
        "phalanx.entrypoints.serve",
        "phalanx.entrypoints.async_llm",
        "phalanx.entrypoints.openai.server",
        "phalanx.engine.core_client",
        "phalanx.engine.core_process",
        "phalanx.engine.protocol",
        "phalanx.engine.output_processor",
        "phalanx.engine.tokenizer",
        "phalanx.checkpoint",
        "phalanx.config",
        "phalanx.spec_decode.config",
    ]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False", "importing the API server's modules imports torch"


def test_serve_start_up_and_requests_import_no_torch() -> None:
    spec = {"method": "eagle3", "model": "phalanx-math-eagle3", "num_speculative_tokens": 3}
    argv = ["phalanx-math", "--dtype", "bfloat16", "--speculative-config", json.dumps(spec)]
    front_end = _run_front_end(argv, "bfloat16")
    assert front_end["torch"] == []
    _assert_same_tokenizer(front_end, "phalanx-math")


def _assert_same_tokenizer(front_end: dict, model: str, env: dict[str, str] | None = None) -> None:
    """The tokenizer the API process loads without torch behaves as the one loaded with it."""
    code = (
        "import json, sys, torch\n"
        "from phalanx.engine.tokenizer import eos_token_ids_of, load_tokenizer\n"
        "t = load_tokenizer(sys.argv[1])\n"
        "text, messages = json.loads(sys.argv[2])\n"
        "print(json.dumps({'tokenizer': type(t).__name__, 'ids': t(text)['input_ids'],"
        " 'text': t.decode(t(text)['input_ids'][::-1]),"
        " 'chat': t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),"
        " 'eos': eos_token_ids_of(t)}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, model, json.dumps([TEXT, MESSAGES])], cwd=REPO,
                          capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    with_torch = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k: front_end[k] for k in with_torch} == with_torch


def test_gguf_start_up_imports_no_torch(tmp_path: Path) -> None:
    """A GGUF file whose config and tokenizer are not converted yet (a fresh cache): the API process
    converts them at start-up."""
    from tests.gguf_fixtures import write_gguf
    from tests.tiny_models import make_model

    gguf, _ = write_gguf(make_model("LlamaForCausalLM", tmp_path / "hf"), "LlamaForCausalLM", "Q8_0", tmp_path / "q")
    env = {"PHALANX_CACHE": str(tmp_path / "cache")}
    front_end = _run_front_end([str(gguf)], "bfloat16", env=env)
    assert front_end["torch"] == []
    assert list((tmp_path / "cache" / "gguf").glob("*/config.json")), "the conversion was not cached"
    _assert_same_tokenizer(front_end, str(gguf), env=env)


def test_dtype_names_match_the_torch_dtypes() -> None:
    """The configuration check's dtype (a name, no torch) is the engine's (a torch.dtype), errors
    included."""
    import torch

    from phalanx.config import dtype_name, parse_dtype

    cases = [("auto", None), ("auto", "bfloat16"), ("auto", "torch.float16"), ("auto", "float64"), ("bf16", None),
             ("half", "float32"), ("float", None), (torch.bfloat16, None), (torch.float16, "float32")]
    for dtype, config_dtype in cases:
        assert parse_dtype(dtype, config_dtype) == getattr(torch, dtype_name(dtype, config_dtype))
    for bad in ("int8", torch.int8, torch.float64):
        with pytest.raises(ValueError) as by_name:
            dtype_name(bad, None)
        with pytest.raises(ValueError) as by_torch:
            parse_dtype(bad, None)
        assert str(by_name.value) == str(by_torch.value)
