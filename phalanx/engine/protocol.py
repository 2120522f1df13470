"""A request as the API server hands it to an engine core, and the checks of its token ids.

Owns: `EngineCoreRequest` (the request inside ``core_process.AddRequest``, and what the offline
`LLM` adds to its in-process engine), `validate_prompt_tokens` and `validate_resumed_tokens` (the
API server runs the first before a request leaves it; the engine runs both on intake).
Does not own: the other wire messages (``core_process``), what the engine does with a request
(``engine_core``).

Plain Python and msgspec only: the API server process imports this module and never imports torch
(tests/unit/test_front_end_imports.py).
"""

from __future__ import annotations

import msgspec

from phalanx.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    group_id: str | None = None  # the parent request of an n > 1 sample
    # Output tokens already produced elsewhere (the API server replays a request whose rank died):
    # the engine computes prompt + these as context and goes on from there, counting them as
    # output (penalties, min_tokens, max_tokens) and advancing a seeded generator past them.
    output_token_ids: list[int] = []


def validate_prompt_tokens(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if len(prompt_token_ids) == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is {max_model_len}; "
            f"prompts must be at most {max_model_len - 1} tokens to leave room for output"
        )
    _check_vocabulary(prompt_token_ids, vocab_size, "token id")


def validate_resumed_tokens(output_token_ids: list[int], vocab_size: int, max_tokens: int) -> None:
    """A resumed request's produced tokens: in the vocabulary, and fewer than its max_tokens (a
    request that reached max_tokens is finished, never resumed)."""
    if len(output_token_ids) >= max_tokens:
        raise ValueError(
            f"a resumed request has {len(output_token_ids)} output tokens already; it must have fewer "
            f"than its max_tokens ({max_tokens})"
        )
    _check_vocabulary(output_token_ids, vocab_size, "output token id")


def _check_vocabulary(token_ids: list[int], vocab_size: int, what: str) -> None:
    """Every id an int in [0, vocab_size), else a ValueError naming the first bad one as `what`."""
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"{what} {bad[0]!r} is outside the vocabulary; valid ids are 0..{vocab_size - 1}")
