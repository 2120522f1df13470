"""The real SmolLM2-135M-Instruct weights: loaded from the GGUF and from a dequantized Hugging Face
folder, fp32 greedy equals transformers' on real chat prompts, and n-gram speculation on it equals
plain decoding.

Reference: transformers loading the same GGUF itself (its own dequantization and q/k un-permutation),
fp32. Criterion: tokens equal until the first divergence; a divergence is allowed only at a genuine
near-tie of the reference (its logits for the two tokens within 1e-3), after which the sequences are
not compared further. The reference reads phalanx's answer in one teacher-forced forward per prompt:
up to the first divergence its logits are those its own greedy decoding computes step by step (same
tokens before each position), so the comparison is the same as against `generate`, without 32
sequential reference steps per prompt.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from phalanx import LLM, SamplingParams
from tests.real_model import CHAT_PROMPTS, messages, smollm2_gguf

NEW_TOKENS = 32
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def reference(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """transformers' fp32 model from the GGUF, and the same weights saved as a safetensors folder."""
    import functools

    import gguf
    import numpy as np
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers' own load, made cheaper without changing what it computes (the same weights bit
    # for bit, ~10 s instead of ~39 s here): it parses the GGUF's header once for the config, once
    # for the tokenizer and once for the weights (mostly the 49,152-entry vocabulary and merges): one
    # reader serves all three and the metadata-only parse is kept; the reader's file mapping is a
    # plain array view (numpy's memmap subclass runs Python code on every slice the parse takes); and
    # gguf's tensor-name map, which transformers builds again for each of the model's ~400 modules,
    # is built once.
    real_memmap = np.memmap

    def memmap(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return real_memmap(path, *args, **kwargs).view(np.ndarray)

    def once_per_path(real, plain):  # noqa: ANN001, ANN202
        """`real(path, ...)`, computed once per path for the calls `plain(args, kwargs)` accepts."""
        memo: dict[str, object] = {}

        def call(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if not plain(args, kwargs):
                return real(path, *args, **kwargs)
            if str(path) not in memo:
                memo[str(path)] = real(path, *args, **kwargs)
            return memo[str(path)]
        return call

    reader = once_per_path(gguf.GGUFReader, lambda args, kwargs: not args and not kwargs)
    # load_gguf_checkpoint(path, return_tensors=False): the metadata-only parse
    load = once_per_path(gguf_utils.load_gguf_checkpoint,
                         lambda args, kwargs: not any(args) and set(kwargs) <= {"return_tensors"}
                         and not kwargs.get("return_tensors"))

    with (mock.patch.object(gguf.gguf_reader.np, "memmap", memmap), mock.patch.object(gguf, "GGUFReader", reader),
          mock.patch.object(gguf_utils, "load_gguf_checkpoint", load),
          mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))):
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    folder = tmp_path_factory.mktemp("smollm2-hf")
    model.hf_quantizer = None  # dequantized in memory: save it as a plain checkpoint
    model.config.quantization_config = None
    del model.config.quantization_config
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return model, tok, folder


def _reference_logits(model, prompt_ids: list[int], answer: list[int]) -> torch.Tensor:  # noqa: ANN001
    """The reference's logits for each answer position, given the prompt and the answer before it
    (teacher forcing): row i predicts answer[i]."""
    ids = torch.tensor([prompt_ids + answer])
    with torch.no_grad():
        # An explicit mask: the pad id (2, <|im_end|>) occurs inside chat prompts.
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(answer)]


def test_smollm2_fp32_greedy_equals_transformers(reference, smollm2_fp32) -> None:  # noqa: ANN001
    model, tok, folder = reference
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outs = smollm2_fp32.chat([messages(p) for p in CHAT_PROMPTS], params, use_tqdm=False)
    compared = 0
    for prompt, out in zip(CHAT_PROMPTS, outs, strict=True):
        want_ids = tok.apply_chat_template(messages(prompt), tokenize=True, add_generation_prompt=True,
                                           return_dict=False)
        assert out.prompt_token_ids == want_ids, prompt  # the GGUF's chat template, rendered the same
        got = list(out.outputs[0].token_ids)
        ref_logits = _reference_logits(model, want_ids, got)
        for i, a in enumerate(got):
            b = int(ref_logits[i].argmax())
            if a != b:
                gap = float(ref_logits[i][b] - ref_logits[i][a])
                assert gap <= NEAR_TIE, f"{prompt!r}: token {i} differs ({a} vs {b}) with a reference gap of {gap}"
                break
            compared += 1
    assert compared >= len(CHAT_PROMPTS) * NEW_TOKENS * 3 // 4  # near-ties are rare, not the rule
    assert "Paris" in outs[0].outputs[0].text

    # The dequantized Hugging Face folder loads to bitwise the same outputs as the GGUF itself (the
    # same weights: the first tokens of the same batch show it, prefix caching off in both engines;
    # with ignore_eos every step of both runs has the same four rows, so they compare step for step).
    folder_llm = LLM(str(folder), dtype="float32", max_model_len=512, enable_prefix_caching=False)
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    again = folder_llm.chat([messages(p) for p in CHAT_PROMPTS], short, use_tqdm=False)
    for a, b in zip(outs, again, strict=True):
        got = a.outputs[0].token_ids[:8]
        assert got == b.outputs[0].token_ids
        assert [lp[t].logprob for t, lp in zip(got, a.outputs[0].logprobs[:8], strict=True)] == [
            lp[t].logprob for t, lp in zip(b.outputs[0].token_ids, b.outputs[0].logprobs, strict=True)
        ]


def test_smollm2_ngram_speculation_equals_plain(gguf_path: Path, smollm2_fp32) -> None:  # noqa: ANN001
    """fp32: n-gram k = 3 on real chat text drafts, accepts some drafts, and changes no token."""
    params = SamplingParams(temperature=0, max_tokens=48)
    prompts = [messages(p) for p in CHAT_PROMPTS[:2]] + [messages(
        "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.")]
    plain = smollm2_fp32.chat(prompts, params, use_tqdm=False)
    spec_llm = LLM(str(gguf_path), dtype="float32", max_model_len=512,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 2})
    spec = spec_llm.chat(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    metrics = spec_llm.get_metrics()
    assert metrics["spec_num_draft_tokens"] > 0 and metrics["spec_num_accepted_tokens"] > 0
