"""Build the 40M random Llama of docs/benchmarks.md: a random-weight Llama with a trained byte-level BPE tokenizer.

hidden 512, intermediate 1408, 8 layers, 8 heads / 4 KV heads, tied embeddings, vocab 32000,
max_position_embeddings 4096, bf16; tokenizer trained with `tokenizers` on generated pseudo-text.
Optionally also a draft model: the target's first 2 layers (`--draft-dir`; a cheap draft that shares
the target's embeddings; acceptance on random weights is whatever it is, and is reported).

    python benchmarks/make_random_llama.py OUT_DIR [--seed 0] [--draft-dir DIR]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

VOCAB_SIZE = 32000
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "st", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
_CODAS = ["", "n", "r", "s", "t", "l", "m", "ng", "st", "ck"]


def corpus(num_lines: int, seed: int) -> list[str]:
    """Pseudo-English lines: words of 1-4 random syllables, some digits and punctuation."""
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 4)))

    lines = []
    for _ in range(num_lines):
        words = [word() if rng.random() > 0.08 else str(rng.randint(0, 9999)) for _ in range(rng.randint(6, 24))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", ".", "?", "!", ","]))
    return lines


def train_tokenizer(out: Path, seed: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(200_000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    return fast


def build(out: Path, seed: int, num_layers: int = 8) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out, seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    print(f"saved {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"tokenizer vocab {len(tok)}, model vocab {VOCAB_SIZE})")


def truncate(target: Path, out: Path, num_layers: int) -> None:
    """The target's first `num_layers` layers with its embeddings and final norm."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    print(f"saved {out} ({num_layers}-layer truncation of {target})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-dir", type=Path, default=None, help="also save a 2-layer truncation here")
    args = p.parse_args()
    build(args.out, args.seed)
    if args.draft_dir:
        truncate(args.out, args.draft_dir, 2)


if __name__ == "__main__":
    main()
