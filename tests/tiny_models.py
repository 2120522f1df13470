"""Tiny random Hugging Face checkpoints built inside the tests (no hub).

`make_model(arch, folder, **overrides)` saves a random-init model of the given architecture with
`save_pretrained` plus a byte-level BPE tokenizer (vocab 320), and returns the folder. Models are
fp32 and deterministic (seeded), small enough that building one takes well under a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tokenizer_fixtures import make_byte_bpe_tokenizer

VOCAB = 320

_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _config(arch: str, **overrides: Any):  # noqa: ANN202
    import transformers

    kw = dict(_BASE)
    if arch in ("MixtralForCausalLM",):
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False)
    if arch == "Qwen2MoeForCausalLM":
        kw.update(shared_expert_intermediate_size=80)
    if arch == "MistralForCausalLM":
        kw.update(sliding_window=None)
    kw.update(overrides)
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return cfg_cls(**kw)


def make_model(arch: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = _config(arch, **overrides)
    model = getattr(transformers, arch)(cfg).eval()
    # Random init with std 0.02 gives near-flat logits; scale the head up so argmaxes are decisive
    # and fp32 parity is not a coin flip on near-ties.
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight.mul_(8.0)
    model.save_pretrained(str(folder))
    make_byte_bpe_tokenizer(folder)
    return folder


def load_hf(folder: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
