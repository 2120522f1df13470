"""Tiny tokenizers built in memory for tests (no hub, a few milliseconds, deterministic).

``make_byte_bpe_tokenizer``: byte-level BPE (GPT-2 / Llama-3 / Qwen style) with a small vocabulary, so
multi-byte characters (CJK, emoji, accents) are usually split over several tokens. Special tokens:
``<|endoftext|>`` (id 0, eos/pad), ``<|im_start|>`` (1), ``<|im_end|>`` (2).

``make_metaspace_bpe_tokenizer``: sentencepiece-like BPE (``▁`` marks a word start; the decoder drops
the leading space of the first token), for leading-space tests.

Import as ``from tests.tokenizer_fixtures import make_byte_bpe_tokenizer`` (pytest run from the repo
root via ``python -m pytest``, which puts the root on ``sys.path``).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TRAINING_TEXT = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "你好，世界。今天天气很好。我们一起学习中文。",
    "日本語のテキストも少しあります。こんにちは。",
    "Emoji: 🙂 🚀 👍🏽 👨‍👩‍👧 ❤️ and math: ∑ ∞ ≈ π",
    "Café, naïve, résumé, Ümlaut: ä ö ü ß — “quotes” and ‘single’ ones…",
    "def add(a, b):\n    return a + b\n",
]


def _finish(tokenizer: Tokenizer, tmp_path: Path | None) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )
    if tmp_path is None:
        return fast
    fast.save_pretrained(str(tmp_path))
    return AutoTokenizer.from_pretrained(str(tmp_path))


def make_byte_bpe_tokenizer(tmp_path: Path | None = None, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer; with ``tmp_path`` it is also saved there and reloaded from disk."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return _finish(tokenizer, tmp_path)


# A role-tagged template, one line per message: what the front-end tests need to turn chat messages
# into a prompt (no generation prompt; the e2e servers' template adds one).
ROLE_LINES_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def make_chat_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level BPE above with `ROLE_LINES_TEMPLATE` as its chat template."""
    tok = make_byte_bpe_tokenizer()
    tok.chat_template = ROLE_LINES_TEMPLATE
    return tok


def make_metaspace_bpe_tokenizer(tmp_path: Path | None = None) -> PreTrainedTokenizerFast:
    """A sentencepiece-like BPE tokenizer (Metaspace, prepend_scheme="first", no byte fallback)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[*SPECIAL_TOKENS, "<unk>"], show_progress=False
    )
    tokenizer.train_from_iterator(TRAINING_TEXT[:2], trainer)
    return _finish(tokenizer, tmp_path)
