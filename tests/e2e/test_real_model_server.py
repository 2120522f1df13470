"""`phalanx serve` with no MODEL serves the real SmolLM2-135M-Instruct (bf16, its GGUF's chat
template), as a user gets it: the `openai` client's chat and streaming, stopping at `<|im_end|>`,
and n-gram speculation on the same server reporting its acceptance.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import ServerProcess, start_server
from tests.real_model import smollm2_gguf


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    smollm2_gguf()  # fetched (or skipped with its reason) before a server is started
    log = tmp_path_factory.mktemp("real") / "server.log"
    # No MODEL: the default is the built-in real model.
    srv = start_server(None, log, "--max-model-len", "1024", "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
                       '"prompt_lookup_max": 4}', timeout=240.0)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture()
def client(real_server: ServerProcess):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=f"{real_server.base_url}/v1", api_key="none", timeout=120.0, max_retries=0)


def test_default_model_is_smollm2(real_server: ServerProcess, client) -> None:  # noqa: ANN001
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]  # --served-model-name from the fixture's start_server
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in real_server.log()


def test_chat_answers_and_stops_at_im_end(client) -> None:  # noqa: ANN001
    r = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        extra_body={"return_spec_stats": True},
    )
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # the model's <|im_end|>, not the length limit
    assert "<|im_end|>" not in choice.message.content and "<|im_start|>" not in choice.message.content
    assert r.usage.completion_tokens < 64


def test_streaming_equals_the_whole_answer(client) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    whole = client.chat.completions.create(model="tiny", temperature=0, max_tokens=48, messages=messages)
    chunks = client.chat.completions.create(model="tiny", temperature=0, max_tokens=48, messages=messages, stream=True)
    text, reasons = "", []
    for chunk in chunks:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert text == whole.choices[0].message.content and text
    assert reasons == [whole.choices[0].finish_reason]


def test_ngram_speculation_drafts_on_real_text(client) -> None:  # noqa: ANN001
    r = client.completions.create(
        model="tiny", temperature=0, max_tokens=40,
        prompt="Repeat after me: one two three four five six. one two three four five six. one two three",
        extra_body={"return_spec_stats": True},
    )
    stats = r.choices[0].model_extra["spec_stats"]
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0, stats
