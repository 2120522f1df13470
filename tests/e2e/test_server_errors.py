"""Bad requests get the right status and an OpenAI-style error body; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import API_KEY, MODEL_NAME, ServerProcess

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "ab " * 400  # > 256 tokens (the server's max_model_len)

BAD_REQUESTS = [
    # (path, body, status, text expected in the message, expected param)
    (
        CHAT,
        {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
        "tools",
    ),
    (CHAT, {"messages": MSGS, "tool_choice": "auto"}, 400, "tool_choice", "tool_choice"),
    (
        CHAT,
        {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "response_format",
        "response_format",
    ),
    (CHAT, {"messages": MSGS, "logit_bias": {"1": 500}}, 400, "logit_bias", None),
    (CHAT, {"messages": MSGS, "functions": []}, 400, "functions", "functions"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix", "suffix"),
    (CHAT, {"messages": MSGS, "temperature": -0.5}, 400, "temperature", None),
    (CHAT, {"messages": MSGS, "top_p": 0}, 400, "top_p", None),
    (CHAT, {"messages": MSGS, "n": 0}, 400, "n must be", None),
    (CHAT, {"messages": MSGS, "max_tokens": 0}, 400, "max_tokens", None),
    (CHAT, {"messages": MSGS, "max_tokens": 10, "min_tokens": 20}, 400, "min_tokens", None),
    (CHAT, {"messages": MSGS, "presence_penalty": 3}, 400, "presence_penalty", None),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "logprobs", None),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", None),
    (CHAT, {"messages": MSGS, "temperature": "hot"}, 400, "temperature", "temperature"),
    (CHAT, {"messages": []}, 400, "messages", "messages"),
    (CHAT, {}, 400, "messages", "messages"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "role", "messages.0.role"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "image_url",
        None,
    ),
    (CHAT, {"messages": MSGS, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    (CHAT, {"messages": MSGS, "max_tokens": 1000}, 400, "maximum context length is 256", None),
    (CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "max_model_len is 256", None),
    (COMPLETIONS, {"prompt": LONG_PROMPT}, 400, "max_model_len is 256", None),
    (COMPLETIONS, {"prompt": [1, 2, 99999]}, 400, "outside the vocabulary", None),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": "x", "logprobs": 99}, 400, "logprobs", None),
    (COMPLETIONS, {"prompt": "x", "stop": ["a", ""]}, 400, "stop", None),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "gpt-4", "model"),
    (CHAT, {"messages": MSGS, "model": "nope"}, 404, "nope", "model"),
    ("/tokenize", {"prompt": "x", "extra": 1}, 400, "extra", "extra"),
    ("/detokenize", {"tokens": [99999]}, 400, "vocabulary", "tokens"),
]


def _check_error(r: httpx.Response, status: int, text: str | None = None, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if text is not None:
        assert text in error["message"], error
    if param is not None:
        assert error["param"] == param, error


def _normal_request_works(http: httpx.Client) -> None:
    r = http.post(CHAT, json={"model": MODEL_NAME, "messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    ("path", "body", "status", "text", "param"),
    BAD_REQUESTS,
    ids=[f"{i}-{b[0].rsplit('/', 1)[-1]}" for i, b in enumerate(BAD_REQUESTS)],
)
def test_bad_request(
    http: httpx.Client, path: str, body: dict, status: int, text: str, param: str | None
) -> None:
    _check_error(http.post(path, json=body), status, text, param)


def test_bad_requests_streaming_then_serving(http: httpx.Client) -> None:
    """Errors found before streaming starts are plain HTTP errors, not 200 + an error event."""
    r = http.post(CHAT, json={"messages": MSGS, "stream": True, "temperature": -1})
    _check_error(r, 400, "temperature")
    r = http.post(COMPLETIONS, json={"prompt": LONG_PROMPT, "stream": True})
    _check_error(r, 400, "max_model_len")
    _normal_request_works(http)


def test_null_fields_are_unset(http: httpx.Client) -> None:
    """OpenAI's optional parameters are nullable: a null is the field not sent (the same answer),
    an unsupported field's null asks for nothing; a required field's null is still a 400."""
    want = http.post(CHAT, json={"model": MODEL_NAME, "messages": MSGS, "max_tokens": 4, "temperature": 0})
    nulls = dict.fromkeys(("stream", "n", "ignore_eos", "speculative", "logprobs", "stream_options", "tools",
                           "response_format", "skip_special_tokens"))
    got = http.post(CHAT, json={"model": MODEL_NAME, "messages": MSGS, "max_tokens": 4, "temperature": 0, **nulls})
    assert want.status_code == got.status_code == 200, got.text
    assert got.headers["content-type"].startswith("application/json")  # not streamed
    assert got.json()["choices"] == want.json()["choices"]
    r = http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "echo": None, "n": None, "suffix": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    _check_error(http.post(CHAT, json={"messages": None}), 400, "messages", "messages")


def test_malformed_json(http: httpx.Client) -> None:
    r = http.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    _check_error(r, 400, "JSON")
    r = http.post(CHAT, content=b"[1, 2]", headers={"content-type": "application/json"})
    _check_error(r, 400)
    _normal_request_works(http)


def test_api_key(server: ServerProcess, http: httpx.Client) -> None:
    url = f"{server.base_url}{CHAT}"
    body = {"messages": MSGS, "max_tokens": 2}
    _check_error(httpx.post(url, json=body), 401, "API key")
    _check_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    _check_error(httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": API_KEY}), 401)
    # Health, metrics and version stay open, like vLLM.
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    _normal_request_works(http)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _check_error(http.get("/v1/nothing"), 404)
    _check_error(http.get(CHAT), 405)
    _normal_request_works(http)


def test_tokenize_detokenize(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "hello world"
    chat = http.post("/tokenize", json={"messages": MSGS}).json()
    assert chat["count"] > r["count"] - 2
    _check_error(http.post("/tokenize", json={}), 400, "prompt")
