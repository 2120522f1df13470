"""Byte-level BPE tokenizer for the phalanx-math demo models.

Digits are always split into single tokens (so the arithmetic is learnable
digit by digit); the rest is byte-level BPE trained on the generated data.
The result is wrapped in ``transformers.PreTrainedTokenizerFast`` with a Jinja
chat template and saved with ``save_pretrained``.

    python -m phalanx.demo.tokenizer --data DIR --out DIR [--vocab 1024]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PAD, END, SYSTEM, USER, ASSISTANT = "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, END, SYSTEM, USER, ASSISTANT]

# <|role|>content<|end|> for every message; the generation prompt is <|assistant|>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('phalanx-math: unknown role ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def prompt_text(question: str, system: str | None = None) -> str:
    """The rendered chat prompt for one user question (same as the template)."""
    s = f"{SYSTEM}{system}{END}" if system else ""
    return f"{s}{USER}{question}{END}{ASSISTANT}"


def train_tokenizer(texts, vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build(data_dir: Path, out: Path, vocab_size: int = 1024):
    rows = [json.loads(line) for line in open(Path(data_dir) / "train.jsonl")]
    texts = [r["question"] for r in rows] + [r["answer"] for r in rows]
    hf = wrap(train_tokenizer(texts, vocab_size))
    hf.save_pretrained(out)
    return hf


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=1024)
    a = ap.parse_args(argv)
    t0 = time.time()
    hf = build(Path(a.data), Path(a.out), a.vocab)
    print(f"vocab {len(hf)} -> {a.out} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
