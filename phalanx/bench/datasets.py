"""Prompt sources for the benchmarks: seeded random prompts and JSONL datasets.

Owns: `BenchPrompt` (prompt as text or token ids, its length, the output length to ask for),
`random_prompts` (vLLM's `--dataset-name random` semantics: lengths drawn uniformly from
[len * (1 - range_ratio), len * (1 + range_ratio)]) and `load_jsonl` (one prompt per line, from a
`question` / `prompt` / `text` field, or a whole chat conversation from a `messages` list).
Does not own: sending prompts (``serve``, ``offline``).

Random prompts are token ids when the caller can send ids (completions, offline); for chat they are
text: with a tokenizer, the decoded random ids (exact length); without one, pseudo-words whose token
count is only approximately `input_len`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PROMPT_FIELDS: tuple[str, ...] = ("question", "prompt", "text", "input")
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "an", "el", "or", "um", "pre", "tion", "er", "ing")


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str | list[int]
    prompt_len: int  # tokens (exact for ids / tokenizer-decoded text, estimated otherwise)
    output_len: int | None  # None: let the server decide (dataset prompts without --output-len)
    # A chat conversation ({"role", "content"} dicts), sent as it is to a chat endpoint; `prompt` is then
    # the token ids of its rendering by the tokenizer's chat template (what a chat endpoint feeds the
    # model), or, without a tokenizer, its contents joined (for the input-token estimate only).
    messages: tuple[dict[str, str], ...] | None = None


def sample_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """n integer lengths uniform in [mean*(1-r), mean*(1+r)], at least 1. r=0 -> all equal to mean."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(mean * (1.0 - range_ratio)))
    hi = max(lo, int(mean * (1.0 + range_ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def _pseudo_words(rng: np.random.Generator, num_words: int) -> str:
    picks = rng.integers(0, len(_SYLLABLES), size=(num_words, 2))
    return " ".join(_SYLLABLES[a] + _SYLLABLES[b] for a, b in picks)


def random_prompts(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    as_ids: bool = True,
    vocab_size: int = 1000,
    tokenizer: Any | None = None,
) -> list[BenchPrompt]:
    """Seeded random prompts. Ids are drawn from the tokenizer's non-special vocabulary when one is
    given, else from [0, vocab_size)."""
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(input_len, range_ratio, num_prompts, rng)
    out_lens = sample_lengths(output_len, range_ratio, num_prompts, rng)
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        pool = np.asarray([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    else:
        pool = np.arange(vocab_size, dtype=np.int64)
    prompts = []
    for n_in, n_out in zip(in_lens, out_lens):
        if as_ids:
            prompts.append(BenchPrompt(rng.choice(pool, size=n_in).tolist(), n_in, n_out))
        elif tokenizer is not None:
            ids = rng.choice(pool, size=n_in).tolist()
            prompts.append(BenchPrompt(tokenizer.decode(ids), n_in, n_out))
        else:
            prompts.append(BenchPrompt(_pseudo_words(rng, n_in), n_in, n_out))
    return prompts


def load_jsonl(
    path: str | Path,
    num_prompts: int | None = None,
    output_len: int | None = None,
    fields: Sequence[str] = PROMPT_FIELDS,
    tokenizer: Any | None = None,
) -> list[BenchPrompt]:
    """Prompts from a JSONL file, in file order; the first of `fields` present in each line is used,
    or a line's `messages` (a chat conversation: a list of {"role", "content"} objects, roles system /
    user / assistant) where it has one.

    Lines that are blank are skipped; a line without any of the fields, or with malformed messages,
    is an error naming the line. If `num_prompts` exceeds the file, prompts are cycled (as vLLM
    oversamples).
    """
    texts: list[str | list[int]] = []
    convs: list[tuple[dict[str, str], ...] | None] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
            if isinstance(row, dict) and "messages" in row:
                conv = _messages(row["messages"], f"{path}:{lineno}")
                try:
                    texts.append(_render(conv, tokenizer))
                except ValueError as e:  # a tokenizer without a chat template
                    raise ValueError(f"{path}:{lineno}: {e}") from e
                convs.append(conv)
                continue
            field_name = next((k for k in fields if isinstance(row, dict) and isinstance(row.get(k), str)), None)
            if field_name is None:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{path}:{lineno}: no string field among {list(fields)}; got {keys}")
            texts.append(row[field_name])
            convs.append(None)
    if not texts:
        raise ValueError(f"{path}: no prompts")
    n = len(texts) if num_prompts is None else num_prompts
    chosen = [i % len(texts) for i in range(n)]

    def length(i: int) -> int:
        t = texts[i]
        if isinstance(t, list):
            return len(t)
        if tokenizer is not None:
            return len(tokenizer(t).input_ids)
        return max(1, len(t.split()))  # a rough estimate; only used for input-token totals

    return [BenchPrompt(texts[i], length(i), output_len, convs[i]) for i in chosen]


ROLES = ("system", "user", "assistant")


def _messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for k, m in enumerate(value):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: messages[{k}] must be {{\"role\": one of {list(ROLES)}, "
                             f"\"content\": a string}}; got {m!r:.80}")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def _render(conv: tuple[dict[str, str], ...], tokenizer: Any | None) -> str | list[int]:
    """The token ids a chat endpoint (and `LLM.chat`) feeds the model for `conv`: the chat template's
    rendering, tokenized without adding special tokens. Without a tokenizer, the contents joined."""
    if tokenizer is None:
        return "\n".join(m["content"] for m in conv)
    from phalanx.engine.tokenizer import render_chat

    return list(tokenizer(render_chat(tokenizer, list(conv)), add_special_tokens=False).input_ids)
