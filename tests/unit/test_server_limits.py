"""Every size a client controls has a limit, enforced with an error before any work is queued, and
prompt preparation runs off the event loop. The real app over a fake engine (tests/fake_engine.py)
shows what reached the engine: nothing, for a refused request.

Before these limits, `"n": 100000` was accepted (the API process grew until it was killed),
`"seed": 2**70` answered 500 ("OverflowError: can't serialize ints"), NaN and 2**70 numbers reached
the engine, and a request body of any size was read and parsed; tokenization and chat templates ran
on the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from phalanx.entrypoints.openai.prompts import PromptPreparer, longest_token_chars
from phalanx.entrypoints.openai.protocol import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SAMPLES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from phalanx.entrypoints.openai.server import max_request_bytes
from tests.fake_engine import fake_app
from tests.tokenizer_fixtures import make_chat_tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
MAX_MODEL_LEN = 256
VOCAB = 2048  # the model's (logits) vocabulary; the tokenizer's is smaller
BIG = 2**70

TOKENIZER = make_chat_tokenizer()
MAX_CHARS = MAX_MODEL_LEN * longest_token_chars(TOKENIZER)

# (path, body, text expected in the message, expected param or None)
OVER_LIMITS: list[tuple[str, dict[str, Any], str, str | None]] = [
    (COMPLETIONS, {"prompt": [5, 6], "n": 100_000}, "less than or equal to 128", "n"),
    (CHAT, {"messages": MSGS, "n": MAX_N + 1}, "128", "n"),
    (COMPLETIONS, {"prompt": [[5, 6]] * (MAX_SAMPLES + 1)}, f"at most {MAX_SAMPLES}", None),
    (COMPLETIONS, {"prompt": [[5, 6]] * 65, "n": 2}, f"at most {MAX_SAMPLES}", None),
    (COMPLETIONS, {"prompt": [5, 6], "seed": BIG}, "seed", "seed"),
    (COMPLETIONS, {"prompt": [5, 6], "seed": -BIG}, "seed", "seed"),
    (COMPLETIONS, {"prompt": [5, 6], "max_tokens": BIG}, "max_tokens", "max_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": BIG}, "max_completion_tokens", "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "min_tokens": BIG}, "min_tokens", "min_tokens"),
    (CHAT, {"messages": MSGS, "top_k": BIG}, "top_k", "top_k"),
    (COMPLETIONS, {"prompt": [5, 6], "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "at most 16", "stop"),
    (COMPLETIONS, {"prompt": [5, 6], "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "at most 128", "stop"),
    (COMPLETIONS, {"prompt": [5, 6], "stop": ["y", "x" * (MAX_STOP_STRING_CHARS + 1)]}, "at most 128", "stop"),
    (COMPLETIONS, {"prompt": [5, 6], "stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)}, "at most", "stop_token_ids"),
    (COMPLETIONS, {"prompt": [5, 6], "stop_token_ids": [BIG]}, "stop_token_ids", "stop_token_ids.0"),
    (COMPLETIONS, {"prompt": [5, 6], "stop_token_ids": [5, VOCAB]}, "stop_token_ids token id 2048 is outside",
     "stop_token_ids"),
    # a sampling parameter's own range (SamplingParams): the 400 names it in `param` too
    (COMPLETIONS, {"prompt": [5, 6], "top_p": 0}, "top_p must be in (0, 1]", "top_p"),
    (CHAT, {"messages": MSGS, "temperature": -0.5}, "temperature must be", "temperature"),
    (COMPLETIONS, {"prompt": [5, 6], "max_tokens": 2, "min_tokens": 3}, "must be <= max_tokens", "min_tokens"),
    # no max_tokens: the room after the prompt bounds min_tokens (it used to run to the context's end
    # with EOS banned)
    (CHAT, {"messages": MSGS, "min_tokens": MAX_MODEL_LEN}, "reduce min_tokens", "min_tokens"),
    (CHAT, {"messages": MSGS, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "at most", "logit_bias"),
    (CHAT, {"messages": MSGS, "logit_bias": {"5": 100.5}}, "[-100, 100]", "logit_bias"),
    (CHAT, {"messages": MSGS, "logit_bias": {str(VOCAB): 1}}, "outside the vocabulary", "logit_bias"),
    (CHAT, {"messages": MSGS, "logit_bias": {"five": 1}}, "logit_bias", None),
    (COMPLETIONS, {"prompt": [5, 6], "logprobs": MAX_LOGPROBS + 1}, "logprobs", None),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs", None),
    (COMPLETIONS, {"prompt": [5] * MAX_MODEL_LEN}, "max_model_len is 256", None),
    (COMPLETIONS, {"prompt": "a" * (MAX_CHARS + 1)}, "characters", "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "a" * (MAX_CHARS + 1)}]}, "characters", "messages"),
    ("/tokenize", {"prompt": "a" * (MAX_CHARS + 1)}, "characters", "prompt"),
    ("/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)}, "max_model_len", "tokens"),
]


def _run(check: Any) -> Any:
    async def main() -> Any:
        async with fake_app(TOKENIZER, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN) as (http, engine, _):
            return await check(http, engine)

    return asyncio.run(main())


@pytest.mark.parametrize(("path", "body", "text", "param"), OVER_LIMITS, ids=[str(i) for i in range(len(OVER_LIMITS))])
def test_over_the_limit_is_a_400_and_queues_nothing(path: str, body: dict, text: str, param: str | None) -> None:
    async def check(http: Any, engine: Any) -> None:
        r = await http.post(path, json=body)
        assert r.status_code == 400, r.text[:500]
        error = r.json()["error"]
        assert text in error["message"], error
        if param is not None:
            assert error["param"] == param, error
        assert engine.added == []
        r = await http.post(COMPLETIONS, json={"prompt": [5, 6], "max_tokens": 2})  # still serving
        assert r.status_code == 200 and len(engine.added) == 1

    _run(check)


def test_at_the_limits_is_accepted() -> None:
    async def check(http: Any, engine: Any) -> None:
        bodies = [
            (COMPLETIONS, {"prompt": [5, 6], "n": MAX_N, "max_tokens": 1}),
            (COMPLETIONS, {"prompt": [[5, 6]] * (MAX_SAMPLES // 2), "n": 2, "max_tokens": 1}),
            # the largest seed, n = 2: the second sample's seed wraps around instead of overflowing
            (COMPLETIONS, {"prompt": [5, 6], "n": 2, "seed": 2**63 - 1, "temperature": 1.0, "max_tokens": 1}),
            (CHAT, {"messages": MSGS, "seed": -(2**63), "max_tokens": 1}),
            (CHAT, {"messages": MSGS, "stop": ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS, "max_tokens": 1}),
            (CHAT, {"messages": MSGS, "logit_bias": {str(i): -100 for i in range(MAX_LOGIT_BIAS)}, "max_tokens": 1}),
            (CHAT, {"messages": MSGS, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)), "max_tokens": 1}),
        ]
        for path, body in bodies:
            r = await http.post(path, json=body)
            assert r.status_code == 200, r.text[:500]
        assert [r.sampling_params.seed for r in engine.added[-6:-4]] == [2**63 - 1, -(2**63)]
        assert engine.added[-2].sampling_params.logit_bias[5] == -100

    _run(check)


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinite_numbers_are_refused(field: str, value: str) -> None:
    """Python's json module parses NaN / Infinity; `temperature: NaN` used to reach the sampler."""

    async def check(http: Any, engine: Any) -> None:
        body = f'{{"prompt": [5, 6], "{field}": {value}}}'
        r = await http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and engine.added == []

    _run(check)


def test_request_body_over_the_limit_is_refused_before_parsing() -> None:
    limit = max_request_bytes(MAX_MODEL_LEN)
    body = json.dumps({"prompt": "a" * limit})

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the size shows only while reading
        data = body.encode()
        for i in range(0, len(data), 65536):
            yield data[i : i + 65536]

    async def check(http: Any, engine: Any) -> None:
        declared = await http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"})
        streamed = await http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
        for r in (declared, streamed):
            assert r.status_code == 413, r.text[:300]
            assert r.json()["error"]["code"] == "request_too_large"
        assert engine.added == []
        r = await http.post(COMPLETIONS, json={"prompt": "a" * 100, "max_tokens": 1})
        assert r.status_code == 200

    _run(check)


def test_tokenization_and_chat_templates_run_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the server tokenized and rendered chat templates on its event loop, so one long
    prompt stalled every stream. Now both run on the tokenizer threads (each with its own copy)."""
    threads: list[str] = []
    call = type(TOKENIZER).__call__
    apply = type(TOKENIZER).apply_chat_template

    def record_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return call(self, *args, **kwargs)

    def record_apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return apply(self, *args, **kwargs)

    monkeypatch.setattr(type(TOKENIZER), "__call__", record_call)
    monkeypatch.setattr(type(TOKENIZER), "apply_chat_template", record_apply)

    async def check(http: Any, engine: Any) -> None:
        loop_thread = threading.current_thread().name
        # Sampling fields are checked before any prompt work: a bad one costs no tokenization.
        assert (await http.post(CHAT, json={"messages": MSGS, "temperature": -1})).status_code == 400
        assert (await http.post(COMPLETIONS, json={"prompt": "hello", "logit_bias": {"5": 500}})).status_code == 400
        assert threads == []
        assert (await http.post(CHAT, json={"messages": MSGS, "max_tokens": 2})).status_code == 200
        assert (await http.post(COMPLETIONS, json={"prompt": "hello", "max_tokens": 2})).status_code == 200
        assert (await http.post("/tokenize", json={"prompt": "hello"})).status_code == 200
        assert len(threads) == 4 and loop_thread not in threads
        assert all(name.startswith("phalanx-tokenizer") for name in threads), threads

    _run(check)


def test_prompt_preparer_gives_each_thread_its_own_tokenizer() -> None:
    preparer = PromptPreparer(TOKENIZER, MAX_MODEL_LEN, num_threads=2)

    async def main() -> set[int]:
        barrier = threading.Barrier(2)

        def grab(tok: Any) -> int:
            barrier.wait(timeout=10)  # both threads busy at once
            return id(tok)

        return set(await asyncio.gather(preparer.run(grab), preparer.run(grab)))

    try:
        ids = asyncio.run(main())
    finally:
        preparer.shutdown()
    assert len(ids) == 2 and id(TOKENIZER) not in ids
