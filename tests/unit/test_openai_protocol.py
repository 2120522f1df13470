"""Request bodies: a null that a field cannot hold is the field not sent (OpenAI's optional
parameters are nullable and clients send them as null); a null the field can hold keeps its meaning."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from phalanx.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

MSGS = [{"role": "user", "content": "hi"}]
REQUIRED = {ChatCompletionRequest: {"messages": MSGS}, CompletionRequest: {"prompt": "x"}, TokenizeRequest: {}}


def _nullable(model: type, name: str) -> bool:
    return type(None) in getattr(model.model_fields[name].annotation, "__args__", ())


@pytest.mark.parametrize("model", list(REQUIRED))
def test_every_optional_field_sent_as_null_is_its_default_or_null(model: type) -> None:
    base = REQUIRED[model]
    default = model.model_validate(base)
    optional = [name for name, f in model.model_fields.items() if not f.is_required()]
    assert len(optional) >= 5 and any(not _nullable(model, n) for n in optional)
    want = {n: None if _nullable(model, n) else getattr(default, n) for n in optional}
    for name in optional:
        assert getattr(model.model_validate({**base, name: None}), name) == want[name], name
    # all of them at once, with fields phalanx does not support (null: asking for nothing)
    got = model.model_validate({**base, **dict.fromkeys(optional), "tools": None, "response_format": None})
    assert {n: getattr(got, n) for n in optional} == want


def test_nulls_that_mean_something_and_those_refused() -> None:
    # completions' max_tokens: null is "up to the context length" (vLLM), not the default 16
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens is None
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens == 16
    chat = ChatCompletionRequest.model_validate({"messages": MSGS, "stream": None, "n": None, "speculative": None,
                                                 "logprobs": None, "ignore_eos": None})
    assert (chat.stream, chat.n, chat.speculative, chat.logprobs, chat.ignore_eos) == (False, 1, True, False, False)
    params = chat.sampling_params(8)
    assert params.n == 1 and params.speculative and not params.ignore_eos
    for body, loc in (({"messages": None}, ("messages",)), ({"prompt": None}, ("prompt",)),
                      ({"messages": [{"role": None, "content": "x"}]}, ("messages", 0, "role")),
                      ({"messages": MSGS, "tools": []}, ("tools",))):
        model = CompletionRequest if "prompt" in body else ChatCompletionRequest
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        assert e.value.errors()[0]["loc"][: len(loc)] == loc
