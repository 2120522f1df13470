"""Incremental detokenization, stop strings and logprob token strings (phalanx.engine.detokenizer).

The specification: streamed text == the full (non-streaming) decode, stop-string streaming == cutting
the whole text at the earliest stop string, for every way of splitting the stream.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.engine.detokenizer import IncrementalDetokenizer, StopStringChecker, detokenize_logprobs
from tests.tokenizer_fixtures import make_byte_bpe_tokenizer, make_metaspace_bpe_tokenizer

BYTE_BPE = make_byte_bpe_tokenizer()
METASPACE = make_metaspace_bpe_tokenizer()
REPLACEMENT_CHAR = "\ufffd"

PROMPTS = ["", "Hello", "你好，", "Emoji: 🙂", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


def _split(items: list, cuts: list[int]) -> list[list]:
    """[a, b, c, d] with cuts [1, 3] -> [[a], [b, c], [d]] (cuts are taken modulo len + 1, sorted)."""
    bounds = sorted({c % (len(items) + 1) for c in cuts} | {0, len(items)})
    return [items[lo:hi] for lo, hi in itertools.pairwise(bounds)]


def _stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.add_tokens(chunk) for chunk in chunks]


# ------------------------------------------------------------------------------------------------
# IncrementalDetokenizer
# ------------------------------------------------------------------------------------------------


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.one_of(
        st.sampled_from(PROMPTS).map(lambda p: BYTE_BPE.encode(p, add_special_tokens=False)),
        st.lists(st.integers(0, len(BYTE_BPE) - 1), max_size=8),  # may end inside a character
    ),
    output_ids=st.lists(st.integers(0, len(BYTE_BPE) - 1), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=12),
    skip_special_tokens=st.booleans(),
    spaces_between_special_tokens=st.booleans(),
)
def test_streamed_text_equals_full_decode(
    prompt: list[int],
    output_ids: list[int],
    cuts: list[int],
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> None:
    detok = IncrementalDetokenizer(BYTE_BPE, prompt, skip_special_tokens, spaces_between_special_tokens)
    deltas = _stream(detok, _split(output_ids, cuts))
    full = BYTE_BPE.decode(output_ids, skip_special_tokens=skip_special_tokens)

    assert not any(delta.endswith(REPLACEMENT_CHAR) for delta in deltas), "emitted a broken character"
    assert detok.output_text == "".join(deltas)
    if not full.endswith(REPLACEMENT_CHAR):
        assert detok.output_text == full
    assert detok.output_text + detok.flush() == full
    assert detok.output_text == full
    assert detok.output_token_ids == output_ids


MULTIBYTE_TEXT = "你好，世界 🙂 👍🏽 café 👨‍👩‍👧 ∑"


def test_multibyte_characters_split_across_tokens_are_held_until_complete() -> None:
    ids = BYTE_BPE.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in BYTE_BPE.decode([i]) for i in ids), "fixture must split characters"
    detok = IncrementalDetokenizer(BYTE_BPE, prompt_token_ids=[])
    deltas = [detok.add_tokens([token_id]) for token_id in ids]

    assert "".join(deltas) == MULTIBYTE_TEXT
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    # "你" is e4 bd a0, one byte per token here: nothing until its last byte arrives.
    assert BYTE_BPE.convert_ids_to_tokens(ids[:3]) == ["ä", "½", "ł"]
    assert deltas[:3] == ["", "", "你"]
    assert detok.flush() == ""


def test_flush_releases_an_incomplete_character_as_replacement() -> None:
    ids = BYTE_BPE.encode("ok 🚀", add_special_tokens=False)
    detok = IncrementalDetokenizer(BYTE_BPE, prompt_token_ids=[])
    streamed = "".join(detok.add_tokens([token_id]) for token_id in ids[:-1])  # last emoji byte missing
    assert streamed == "ok"
    tail = detok.flush()
    assert streamed + tail == BYTE_BPE.decode(ids[:-1]) and tail.endswith(REPLACEMENT_CHAR)
    with pytest.raises(RuntimeError):
        detok.add_tokens(ids[-1:])


@pytest.mark.parametrize("tokenizer", [BYTE_BPE, METASPACE], ids=["byte_level", "metaspace"])
def test_first_output_token_keeps_its_leading_space(tokenizer) -> None:
    """Sentencepiece's decoder drops the leading space of the *first* token; with the prompt as left
    context the stream must still say " world" after "Hello", like decoding prompt + output."""
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    full_ids = tokenizer.encode("Hello world the", add_special_tokens=False)
    assert full_ids[: len(prompt)] == prompt
    output = full_ids[len(prompt) :]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detok.add_tokens([token_id]) for token_id in output) + detok.flush()
    assert text == " world the"
    assert text == tokenizer.decode(full_ids)[len(tokenizer.decode(prompt)) :]


@settings(max_examples=100, deadline=None)
@given(
    prompt_text=st.sampled_from(["", "Hello", "The quick"]),
    output_ids=st.lists(st.integers(0, len(METASPACE) - 1), max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    skip_special_tokens=st.booleans(),
)
def test_metaspace_stream_equals_decode_in_prompt_context(
    prompt_text: str, output_ids: list[int], cuts: list[int], skip_special_tokens: bool
) -> None:
    prompt = METASPACE.encode(prompt_text, add_special_tokens=False)
    detok = IncrementalDetokenizer(METASPACE, prompt, skip_special_tokens=skip_special_tokens)
    text = "".join(_stream(detok, _split(output_ids, cuts))) + detok.flush()
    full = METASPACE.decode(prompt + output_ids, skip_special_tokens=skip_special_tokens)
    assert text == full[len(METASPACE.decode(prompt, skip_special_tokens=skip_special_tokens)) :]


def test_special_tokens_skipped_or_kept() -> None:
    ids = BYTE_BPE.encode("Hi", add_special_tokens=False)
    output = [1, *ids, 2, 0]  # <|im_start|> Hi <|im_end|> <|endoftext|>
    skipped = IncrementalDetokenizer(BYTE_BPE, [], skip_special_tokens=True)
    assert "".join(skipped.add_tokens([t]) for t in output) == "Hi"
    kept = IncrementalDetokenizer(BYTE_BPE, [], skip_special_tokens=False)
    assert "".join(kept.add_tokens([t]) for t in output) == "<|im_start|>Hi<|im_end|><|endoftext|>"


def test_window_stays_short_on_long_outputs() -> None:
    """Cost per step is O(window): the decoded window must not grow with the output length."""
    ids = BYTE_BPE.encode(MULTIBYTE_TEXT * 30, add_special_tokens=False)
    detok = IncrementalDetokenizer(BYTE_BPE, [])
    longest_window = 0
    for token_id in ids:
        detok.add_tokens([token_id])
        longest_window = max(longest_window, len(detok._token_ids) - detok._prefix_offset)
    assert detok.output_text == MULTIBYTE_TEXT * 30
    assert longest_window <= 10


def test_slow_tokenizer_is_rejected() -> None:
    with pytest.raises(TypeError, match="fast tokenizer"):
        IncrementalDetokenizer(object(), [])


# ------------------------------------------------------------------------------------------------
# StopStringChecker
# ------------------------------------------------------------------------------------------------


def _reference_stop(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Non-streaming semantics: cut at the earliest start of any stop string (ties: shortest)."""
    matches = [(text.find(s), len(s), s) for s in stop if s in text]
    if not matches:
        return text, None
    start, length, stop_str = min(matches)
    return text[: start + length if include else start], stop_str


def _run_checker(checker: StopStringChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    chunks = []
    for delta in deltas:
        emitted, matched = checker.process(delta)
        chunks.append(emitted)
        if matched is not None:
            return chunks, matched
    chunks.append(checker.flush())
    return chunks, checker.matched


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=30),
    stop=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    include=st.booleans(),
)
def test_streamed_stop_strings_equal_whole_text_cut(
    text: str, stop: list[str], cuts: list[int], include: bool
) -> None:
    chunks, matched = _run_checker(
        StopStringChecker(stop, include), ["".join(c) for c in _split(list(text), cuts)]
    )
    expected_text, expected_stop = _reference_stop(text, stop, include)
    assert ("".join(chunks), matched) == (expected_text, expected_stop)


def test_stop_string_spanning_deltas_never_leaks() -> None:
    checker = StopStringChecker(["STOP"], include_stop_str_in_output=False)
    assert checker.process("Hello S") == ("Hello ", None)
    assert checker.process("T") == ("", None)
    assert checker.process("Oops") == ("STOops", None)  # "STOO..." cannot become "STOP": released
    assert checker.process(" ST") == (" ", None)
    assert checker.process("OP and more") == ("", "STOP")
    with pytest.raises(RuntimeError):
        checker.process("x")


def test_earlier_longer_stop_string_wins_over_later_shorter_one() -> None:
    checker = StopStringChecker(["bcd", "c"], include_stop_str_in_output=True)
    assert checker.process("abc") == ("a", None)  # "c" matched, but "bcd" could still start earlier
    assert checker.process("d!") == ("bcd", "bcd")
    checker = StopStringChecker(["bcd", "c"], include_stop_str_in_output=False)
    assert checker.process("abc") == ("a", None)
    assert checker.process("x") == ("b", "c")


def test_stop_checker_flush_and_validation() -> None:
    checker = StopStringChecker(["</s>"], include_stop_str_in_output=False)
    assert checker.process("end </") == ("end ", None)
    assert checker.flush() == "</"
    assert checker.matched is None


def test_flush_resolves_a_stop_string_held_for_an_earlier_candidate() -> None:
    checker = StopStringChecker(["aba", "b"], include_stop_str_in_output=False)
    assert checker.process("xab") == ("x", None)  # "b" matched, but "ab" may still become "aba"
    assert checker.flush() == "a"
    assert checker.matched == "b"
    assert StopStringChecker([], include_stop_str_in_output=False).process("any") == ("any", None)
    with pytest.raises(ValueError, match="non-empty"):
        StopStringChecker(["ok", ""], include_stop_str_in_output=False)


# ------------------------------------------------------------------------------------------------
# detokenize_logprobs
# ------------------------------------------------------------------------------------------------


def test_logprob_tokens_byte_level() -> None:
    ids = BYTE_BPE.encode("Hello 你好", add_special_tokens=False)
    tokens = detokenize_logprobs(BYTE_BPE, [*ids, BYTE_BPE.eos_token_id])
    assert tokens[-1] == "<|endoftext|>"
    # Whole-character tokens come out as text; partial-UTF-8 tokens as OpenAI-style "bytes:\xNN".
    partial = [t for t in tokens if t.startswith("bytes:")]
    assert partial and all(REPLACEMENT_CHAR not in t for t in tokens)
    assert "bytes:\\xe4" in tokens  # first byte of "你" (e4 bd a0) is its own token in the fixture
    raw = b"".join(
        bytes.fromhex(t[len("bytes:") :].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
        for t in tokens[:-1]
    )
    assert raw.decode("utf-8") == "Hello 你好"
    assert detokenize_logprobs(BYTE_BPE, []) == []


def test_logprob_tokens_keep_sentencepiece_leading_space() -> None:
    ids = METASPACE.encode("Hello world", add_special_tokens=False)
    tokens = detokenize_logprobs(METASPACE, ids)
    assert tokens[0] == " Hello" and "".join(tokens) == " Hello world"


@pytest.mark.parametrize("chunks", [[1] * 8, [3, 5], [8], [2, 2, 4]])
def test_stop_strings_only_count_after_min_tokens(chunks: list[int]) -> None:
    """As vLLM: text of the first `min_tokens` tokens is never matched against stop strings."""
    from phalanx.core.outputs import EngineCoreOutput
    from phalanx.engine.output_processor import OutputProcessor
    from phalanx.sampling_params import SamplingParams

    tok = make_byte_bpe_tokenizer()
    ids = [tok.encode(c, add_special_tokens=False)[0] for c in "xyxyxyxy"]
    assert tok.decode(ids) == "xyxyxyxy"
    results = {}
    for min_tokens in (0, 3, 4):
        proc = OutputProcessor(tok)
        [(child_id, _)] = proc.add_request("r", None, [ids[0]], SamplingParams(stop=["y"], min_tokens=min_tokens))
        done, pos = None, 0
        for n in chunks:
            res = proc.process([EngineCoreOutput(child_id, ids[pos : pos + n])])
            pos += n
            if res.request_outputs and res.request_outputs[0].finished:
                done = res.request_outputs[0].outputs[0]
                break
        assert done is not None and done.finish_reason == "stop" and done.stop_reason == "y"
        results[min_tokens] = done.text
    # min 0: cut at the first "y"; min 3 (tokens x y x released unchecked): the next "y" is token 4;
    # min 4: tokens 1-4 unchecked, the first checked "y" is token 6.
    assert results == {0: "x", 3: "xyx", 4: "xyxyx"}
