"""One set of end-of-sequence ids, used both to stop requests and to ban EOS before `min_tokens`.

Regression: the tokenizer's EOS ids used to reach only the runner's ban list (`min_tokens`), while
stopping read the checkpoint's config alone, so an EOS that only the tokenizer knew was banned but
never stopped a request.
"""

from __future__ import annotations

import json
from pathlib import Path

from phalanx import LLM, SamplingParams
from tests.tiny_models import make_model


def _llm(folder: Path) -> LLM:
    return LLM(str(folder), dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_an_eos_only_the_tokenizer_knows_stops_and_is_banned_before_min_tokens(tmp_path: Path) -> None:
    folder = make_model("LlamaForCausalLM", tmp_path / "m")
    prompt = {"prompt_token_ids": [5, 9, 33, 100, 7]}
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = _llm(folder).generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    assert first not in (0,)  # the config's eos id; pick another seed if this ever changes

    # The tokenizer (not config.json / generation_config.json) says `first` is its EOS token.
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tokens = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tokens["model"]["vocab"].items()} | {t["id"]: t["content"] for t in tokens["added_tokens"]}
    tok_cfg["eos_token"] = by_id[first]
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))

    llm = _llm(folder)
    assert first in llm.config.model.eos_token_ids and 0 in llm.config.model.eos_token_ids
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    # Before min_tokens the same id is banned (it is the same set), so it cannot appear early.
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:3] and len(out.token_ids) >= 3
