"""phalanx greedy == Hugging Face transformers greedy (fp32, token for token) per architecture.

phalanx runs all prompts together in one batch (mixed lengths, chunked by a small token budget);
the reference runs each prompt alone through `generate`, so no padding differences enter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx import LLM, SamplingParams
from tests.tiny_models import VOCAB, load_hf, make_model

PROMPT_LENS = [1, 3, 7, 12, 20, 33, 41, 64]
MAX_NEW = 12

CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-tied-llama3-rope": (
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3-explicit-head-dim": ("Qwen3ForCausalLM", dict(head_dim=32)),
    "mixtral": ("MixtralForCausalLM", {}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {}),
}


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:  # noqa: ANN001
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers(case: str, tmp_path: Path) -> None:
    arch, overrides = CASES[case]
    folder = make_model(arch, tmp_path / case, **overrides)
    hf = load_hf(folder)
    llm = LLM(str(folder), dtype="float32", block_size=8, max_num_batched_tokens=48, max_model_len=256)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = _hf_greedy(hf, prompt)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"{case}: prompt of {len(prompt)} tokens diverged"
        got_logprobs = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_logprobs, ref_logprobs)) < 1e-4


def test_sharded_checkpoint_and_bf16(tmp_path: Path) -> None:
    """A multi-shard checkpoint (model.safetensors.index.json) loads; bf16 runs and mostly agrees."""
    import transformers

    folder = make_model("LlamaForCausalLM", tmp_path / "one")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / f).write_bytes((folder / f).read_bytes())
    prompts = [{"prompt_token_ids": p} for p in _prompts(1)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = LLM(str(folder), dtype="float32").generate(prompts, params, use_tqdm=False)
    b = LLM(str(sharded), dtype="float32").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    c = LLM(str(folder), dtype="bfloat16").generate(prompts, params, use_tqdm=False)
    first_tokens_equal = sum(x.outputs[0].token_ids[0] == y.outputs[0].token_ids[0] for x, y in zip(a, c))
    assert first_tokens_equal >= len(prompts) // 2
