"""Fast checks of the built-in phalanx-math demo family (no training)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.demo import BUILTIN_MODELS, MODELS_DIR, resolve_model_path
from phalanx.demo.data import TEMPLATES, extract_answer, generate, make_splits

REPO = Path(__file__).resolve().parents[2]
EVAL_DIR = REPO / "evals" / "phalanx-math"
TARGET = MODELS_DIR / "phalanx-math"


# ----------------------------------------------------------------------------- data
def test_generator_is_deterministic():
    a = generate(300, seed=7)
    b = generate(300, seed=7)
    c = generate(300, seed=8)
    assert a == b
    assert [p["question"] for p in a] != [p["question"] for p in c]


def test_generator_uses_many_templates():
    used = {p["template"] for p in generate(2000, seed=0)}
    assert len(used) == len(TEMPLATES) >= 15


def test_splits_are_disjoint():
    s = make_splits(3000, 200, 200, seed=3)
    q = {k: {p["question"] for p in v} for k, v in s.items()}
    assert len(q["train"]) == 3000 and len(q["validation"]) == 200 and len(q["test"]) == 200
    assert not (q["train"] & q["test"]) and not (q["train"] & q["validation"]) and not (q["validation"] & q["test"])


_EXPR = re.compile(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)")


def test_answers_are_worked_solutions_ending_in_the_value():
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}
    for p in generate(3000, seed=11):
        ans = p["answer"]
        assert re.search(r" #### \d+$", ans), ans
        assert extract_answer(ans) == str(p["value"])
        assert 0 <= p["value"] < 1000
        exprs = _EXPR.findall(ans)
        assert exprs, ans
        for a, op, b, c in exprs:
            assert ops[op](int(a), int(b)) == int(c), ans
        assert int(exprs[-1][3]) == p["value"], ans


def test_extract_answer():
    assert extract_answer("so 3 * 4 = 12. #### 12") == "12"
    assert extract_answer("#### 1,234") == "1234"
    assert extract_answer("no number") is None


def test_committed_test_split_matches_generator_and_is_held_out():
    rows = [json.loads(line) for line in open(EVAL_DIR / "phalanx_math_test.jsonl")]
    assert 250 <= len(rows) <= 500
    assert all(set(r) == {"question", "answer"} for r in rows)
    s = make_splits(seed=0)          # the default splits build_all uses
    assert [r["question"] for r in rows] == [p["question"] for p in s["test"]]
    train_q = {p["question"] for p in s["train"]}
    assert not any(r["question"] in train_q for r in rows)


def test_lm_eval_task_yaml():
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load(open(EVAL_DIR / "phalanx_math.yaml"))
    assert cfg["task"] == "phalanx_math" and cfg["output_type"] == "generate_until"
    assert cfg["dataset_path"] == "json"
    assert (REPO / cfg["dataset_kwargs"]["data_files"]["test"]).exists()
    pat = cfg["filter_list"][0]["filter"][0]["regex_pattern"]
    assert re.search(pat, "... so 7. #### 7").group(1) == "7"
    assert cfg["metric_list"][0]["metric"] == "exact_match"
    assert cfg["generation_kwargs"]["max_gen_toks"] > 0 and cfg["generation_kwargs"]["until"]


# ----------------------------------------------------------------------------- paths
def test_resolve_model_path():
    assert set(BUILTIN_MODELS) == {"phalanx-math", "phalanx-math-eagle", "phalanx-math-eagle3", "phalanx-math-draft",
                                   "phalanx-math-moe", "phalanx-math-moe-draft"}
    for name, path in BUILTIN_MODELS.items():
        assert resolve_model_path(name) == str(path)
        assert Path(path).is_dir(), path
    assert resolve_model_path("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert resolve_model_path("/some/dir") == "/some/dir"


def test_demo_package_imports_without_torch():
    # phalanx/demo/__init__.py itself must not need torch (the parent package may import it).
    init = REPO / "phalanx" / "demo" / "__init__.py"
    code = ("import sys, importlib.util; sys.modules['torch'] = None; "
            f"spec = importlib.util.spec_from_file_location('demo_standalone', {str(init)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.resolve_model_path('phalanx-math'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("phalanx-math")


def test_models_fit_size_budget():
    total = sum(f.stat().st_size for f in MODELS_DIR.rglob("*") if f.is_file())
    assert total <= 40 * 1024 * 1024, total


# ----------------------------------------------------------------------------- tokenizer
@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TARGET))


def test_tokenizer_round_trip_and_digits(tok):
    text = "Tom has 3 boxes of 12 apples, so 3 * 12 = 36 apples. #### 36"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    pieces = [tok.decode([i]) for i in tok("1234567890", add_special_tokens=False)["input_ids"]]
    assert pieces == list("1234567890")
    assert 256 < len(tok) <= 2048


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    s = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert s == "<|system|>Be brief.<|end|><|user|>What is 2 + 3?<|end|><|assistant|>"
    s2 = tok.apply_chat_template(msgs[1:] + [{"role": "assistant", "content": "2 + 3 = 5. #### 5"}], tokenize=False)
    assert s2 == "<|user|>What is 2 + 3?<|end|><|assistant|>2 + 3 = 5. #### 5<|end|>"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    for t in ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]:
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1
    assert tok.eos_token == "<|end|>" and tok.pad_token == "<|pad|>"
    assert (TARGET / "chat_template.jinja").exists()


# ----------------------------------------------------------------------------- committed models
@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_committed_model_folders_load(name, tok):
    from transformers import AutoConfig, AutoTokenizer

    path = BUILTIN_MODELS[name]
    cfg = AutoConfig.from_pretrained(str(path))
    assert (path / "model.safetensors").exists()
    t = AutoTokenizer.from_pretrained(str(path))
    assert t.eos_token_id == tok.eos_token_id and len(t) == len(tok)
    raw = json.loads((path / "config.json").read_text())
    assert raw.get("dtype", raw.get("torch_dtype")) == "bfloat16"
    assert cfg.eos_token_id == tok.eos_token_id
    if "eagle" not in name:
        gen = json.loads((path / "generation_config.json").read_text())
        eos = gen["eos_token_id"]
        assert eos == tok.eos_token_id or eos == [tok.eos_token_id]
        assert cfg.architectures[0] == ("MixtralForCausalLM" if "moe" in name else "LlamaForCausalLM")


def _tensor_shapes(path: Path) -> dict[str, tuple]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_eagle_head_format():
    tcfg = json.loads((TARGET / "config.json").read_text())
    H = tcfg["hidden_size"]
    p = BUILTIN_MODELS["phalanx-math-eagle"]
    cfg = json.loads((p / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert cfg["hidden_size"] == H
    shapes = _tensor_shapes(p)
    assert shapes["fc.weight"] == (H, 2 * H)
    for n in ["q_proj", "k_proj", "v_proj", "o_proj"]:
        assert f"layers.0.self_attn.{n}.weight" in shapes
    assert shapes["layers.0.self_attn.q_proj.weight"][1] == H
    for n in ["gate_proj", "up_proj", "down_proj"]:
        assert f"layers.0.mlp.{n}.weight" in shapes
    assert "layers.0.post_attention_layernorm.weight" in shapes
    assert not any(k.startswith(("embed_tokens", "lm_head", "norm", "model.")) or "input_layernorm" in k
                   for k in shapes)


def test_eagle3_head_format():
    import torch
    from safetensors.torch import load_file

    tcfg = json.loads((TARGET / "config.json").read_text())
    H, V = tcfg["hidden_size"], tcfg["vocab_size"]
    p = BUILTIN_MODELS["phalanx-math-eagle3"]
    cfg = json.loads((p / "config.json").read_text())
    # one layer (saved as `midlayer.`, the reference spelling) reading the low / middle target layers
    # and the last layer's output (id num_hidden_layers, vLLM's convention; docs/demo-models.md)
    assert cfg["architectures"] == ["Eagle3LlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    ids = cfg["eagle_aux_hidden_state_layer_ids"]
    assert len(ids) == 3 and ids == sorted(set(ids)) and ids[-1] == tcfg["num_hidden_layers"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    dv = cfg["draft_vocab_size"]
    shapes = _tensor_shapes(p)
    assert shapes["fc.weight"] == (H, 3 * H)
    for n in ["q_proj", "k_proj", "v_proj"]:
        assert shapes[f"midlayer.self_attn.{n}.weight"][1] == 2 * H
    for n in ["input_layernorm", "hidden_norm", "post_attention_layernorm"]:
        assert shapes[f"midlayer.{n}.weight"] == (H,)
    assert not any(k.startswith("layers.") for k in shapes)
    assert shapes["norm.weight"] == (H,) and shapes["lm_head.weight"] == (dv, H)
    sd = load_file(str(p / "model.safetensors"))
    d2t, t2d = sd["d2t"], sd["t2d"]
    assert d2t.shape == (dv,) and t2d.shape == (V,) and t2d.dtype == torch.bool
    tgt_ids = torch.arange(dv) + d2t
    assert int(t2d.sum()) == dv and bool(t2d[tgt_ids].all())
    assert bool((tgt_ids[1:] > tgt_ids[:-1]).all())


def test_target_greedy_generate(tok):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    assert 3e6 <= n <= 10e6
    q = "Tom has 3 boxes of apples. Each of the boxes holds 4 apples. He gives away 5 apples. How many apples does Tom have left?"
    enc = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=64, do_sample=False)
    gen = out[0, enc["input_ids"].shape[1]:]
    text = tok.decode(gen, skip_special_tokens=True)
    # format and copying only: accuracy is measured by phalanx.demo.evaluate, not here
    assert "3 * 4 = 12" in text and extract_answer(text) is not None, text
    assert int(gen[-1]) == tok.eos_token_id
