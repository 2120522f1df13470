"""The incremental detokenizer releases the same text however an engine step groups the tokens.

Regression: `add_tokens` used to decode a step's tokens as one window and hold the whole window back
when it ended inside a character. A speculative step [.., "。", "9", <e3>] then released nothing, so a
stop string "。9" completed by "9" went unseen until a later step (or the end of the request): the
request ran on to max_tokens where plain decoding stopped (tests/unit/test_spec_decode.py's stop-string
check found it on the tiny random model).
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.engine.detokenizer import IncrementalDetokenizer
from tests.tokenizer_fixtures import make_byte_bpe_tokenizer, make_metaspace_bpe_tokenizer

BYTE_BPE = make_byte_bpe_tokenizer()
METASPACE = make_metaspace_bpe_tokenizer()


def _released_per_step(tokenizer, prompt: list[int], output: list[int], cuts: list[int]) -> list[str]:  # noqa: ANN001
    bounds = sorted({c % (len(output) + 1) for c in cuts} | {0, len(output)})
    detok = IncrementalDetokenizer(tokenizer, prompt)
    return [detok.add_tokens(output[lo:hi]) for lo, hi in itertools.pairwise(bounds)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    use_metaspace=st.booleans(),
    prompt=st.lists(st.integers(0, 319), max_size=6),
    output=st.lists(st.integers(0, 319), max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_a_step_releases_what_its_tokens_one_by_one_release(
    use_metaspace: bool, prompt: list[int], output: list[int], cuts: list[int]
) -> None:
    tokenizer = METASPACE if use_metaspace else BYTE_BPE
    vocab = len(tokenizer)
    prompt, output = [t % vocab for t in prompt], [t % vocab for t in output]
    bounds = sorted({c % (len(output) + 1) for c in cuts} | {0, len(output)})
    one_by_one = _released_per_step(tokenizer, prompt, output, list(range(len(output) + 1)))
    grouped = _released_per_step(tokenizer, prompt, output, cuts)
    assert grouped == ["".join(one_by_one[lo:hi]) for lo, hi in itertools.pairwise(bounds)]


def test_complete_text_before_a_trailing_partial_character_is_released() -> None:
    euro = BYTE_BPE.encode("€", add_special_tokens=False)  # three bytes, more than one token
    assert len(euro) > 1
    detok = IncrementalDetokenizer(BYTE_BPE, [])
    assert detok.add_tokens(BYTE_BPE.encode("ab9", add_special_tokens=False) + euro[:1]) == "ab9"
    assert detok.add_tokens(euro[1:]) == "€"
