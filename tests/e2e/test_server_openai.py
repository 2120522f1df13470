"""The server through the official `openai` client (sync and async): the OpenAI surface works."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.e2e.conftest import API_KEY, MODEL_NAME, ServerProcess
from tests.tiny_models import load_hf, middle_stop_string

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 + 3?"}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def async_client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


class Reference:
    """transformers (fp32, the served model's dtype) on the served checkpoint, and the server's token
    strings mapped back to ids (they are one string per id for the byte-level tokenizer: checked)."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        from phalanx.engine.detokenizer import detokenize_logprobs

        self.model = load_hf(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.strings = detokenize_logprobs(self.tokenizer, list(range(len(self.tokenizer))))
        self.ids = {s: i for i, s in enumerate(self.strings)}
        assert len(self.ids) == len(self.strings)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)
        return out[0, len(ids):].tolist()

    def logprobs(self, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]: row i predicts ids[i + 1]
        with torch.no_grad():
            return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Reference:
    return Reference(tiny_model)


def _tokenize(server: ServerProcess, prompt: str) -> list[int]:
    return httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}).json()["tokens"]


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].owned_by == "phalanx"


def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=8, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL_NAME
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    # Content given as a list of text parts renders the same prompt.
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MSGS]
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=8, **GREEDY)
    assert r2.choices[0].message.content == choice.message.content
    assert r2.usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_default_max_tokens_is_context_length(client: openai.OpenAI, server: ServerProcess) -> None:
    """Without max_tokens a chat request may run to the end of the context (256 here)."""
    long_msgs = [{"role": "user", "content": "one two three four " * 12}]  # leaves a short tail to generate
    r = client.chat.completions.create(model=MODEL_NAME, messages=long_msgs, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > 100
    assert r.usage.total_tokens == 256


def test_completions_prompt_forms(client: openai.OpenAI, server: ServerProcess) -> None:
    one = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=5, **GREEDY)
    assert one.object == "text_completion" and len(one.choices) == 1
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 5
    two = client.completions.create(
        model=MODEL_NAME, prompt=["hello world", "def add(a"], max_tokens=5, **GREEDY
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == one.choices[0].text
    assert two.usage.completion_tokens == 10
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == one.choices[0].text
    batch = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=5, **GREEDY)
    assert batch.choices[0].text == one.choices[0].text and len(batch.choices) == 2
    # Completions default to 16 tokens, as in OpenAI and vLLM.
    default = client.completions.create(model=MODEL_NAME, prompt="hello", **GREEDY)
    assert default.usage.completion_tokens == 16


def test_streaming_chat_matches_non_streaming(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=24, **GREEDY)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MSGS,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_matches_non_streaming(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt="The answer", max_tokens=20, **GREEDY)
    chunks = list(
        client.completions.create(model=MODEL_NAME, prompt="The answer", max_tokens=20, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=6, n=3, seed=7, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    assert len({c.message.content for c in r.choices}) > 1  # seeds 7, 8, 9 differ
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=6, n=2, seed=3, stream=True, extra_body={"ignore_eos": True}
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
    again = client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=6, n=2, seed=3, extra_body={"ignore_eos": True}
    )
    assert [texts[0], texts[1]] == [c.text for c in again.choices]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for pos in content:
        assert len(pos.top_logprobs) == 3
        lps = [t.logprob for t in pos.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert pos.logprob == pytest.approx(lps[0], abs=1e-4)
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=5, logprobs=True, top_logprobs=1, stream=True, **GREEDY
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [p.logprob for p in streamed] == pytest.approx([p.logprob for p in content], abs=1e-4)


def test_completion_logprobs_and_echo(client: openai.OpenAI, server: ServerProcess, reference: Reference) -> None:
    """Sample and echoed prompt logprobs are transformers' values for the same tokens: each chosen
    token's logprob, and the top-n alternatives by name and value."""
    prompt_ids = _tokenize(server, "hello world")
    generated = reference.greedy(prompt_ids, 4)
    full = prompt_ids + generated
    ref = reference.logprobs(full)

    def check_position(pos: int, token: str, logprob: float, top: dict[str, float], n: int) -> None:
        row = ref[pos - 1]  # the logits before position pos
        assert reference.ids[token] == full[pos], pos
        assert logprob == pytest.approx(row[full[pos]].item(), abs=1e-4), pos
        top_ids = [reference.ids[t] for t in top]
        assert set(row.topk(n).indices.tolist()) <= set(top_ids) <= {*row.topk(n).indices.tolist(), full[pos]}, pos
        assert [v for v in top.values()] == pytest.approx([row[i].item() for i in top_ids], abs=1e-4), pos

    r = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=4, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for j in range(4):
        check_position(len(prompt_ids) + j, lp.tokens[j], lp.token_logprobs[j], lp.top_logprobs[j], 2)
    e = client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=4, logprobs=1, echo=True, **GREEDY
    )
    assert e.choices[0].text == "hello world" + r.choices[0].text
    assert e.usage.prompt_tokens == len(prompt_ids)
    elp = e.choices[0].logprobs
    assert [reference.ids[t] for t in elp.tokens] == full
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None  # nothing predicts the first token
    for pos in range(1, len(full)):
        check_position(pos, elp.tokens[pos], elp.token_logprobs[pos], elp.top_logprobs[pos], 1)
    # Streamed with echo: the same text, tokens and offsets, chunk by chunk.
    text, tokens, offsets = "", [], []
    for chunk in client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=4, logprobs=1, echo=True, stream=True, **GREEDY
    ):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert (text, tokens, offsets) == (e.choices[0].text, elp.tokens, elp.text_offset)


def test_stop_strings(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=30, **GREEDY)
    stop = middle_stop_string(full.choices[0].text)
    expected = full.choices[0].text[: full.choices[0].text.index(stop)]
    r = client.completions.create(
        model=MODEL_NAME, prompt="def add(a, b):", max_tokens=30, stop=[stop], **GREEDY
    )
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL_NAME, prompt="def add(a, b):", max_tokens=30, stop=stop, stream=True, **GREEDY
        )
    )
    assert streamed == expected  # no part of the stop string leaks into the stream
    inc = client.completions.create(
        model=MODEL_NAME,
        prompt="def add(a, b):",
        max_tokens=30,
        stop=[stop],
        temperature=0.0,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert inc.choices[0].text == expected + stop


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(
            model=MODEL_NAME,
            prompt="hello",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].text

    a = sample(1234)
    assert sample(1234) == a
    assert any(sample(s) != a for s in (1, 2, 3))


def test_extension_fields(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MSGS,
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="u1",
        extra_body={
            "top_k": 20,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "return_spec_stats": True,
            "chat_template_kwargs": {},
        },
    )
    choice = r.model_dump()["choices"][0]
    assert choice["spec_stats"] == {
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "num_verify_steps": 0,
        "mean_acceptance_length": None,
    }


def test_generation_prompt_flags_render_the_prompt_they_name(client: openai.OpenAI, server: ServerProcess) -> None:
    """`add_generation_prompt: false` leaves the assistant opener out, `continue_final_message: true`
    continues the last assistant message in place (no end-of-message newline): each chat request
    equals a plain completion of the text the chat template gives for those flags, token for token."""
    rendered = "<|system|>be brief\n<|user|>What is 2 + 3?\n"  # conftest.CHAT_TEMPLATE, by hand
    cases = [
        ({}, MSGS, rendered + "<|assistant|>"),  # the default, for contrast
        ({"add_generation_prompt": False}, MSGS, rendered),
        ({"add_generation_prompt": False, "continue_final_message": True},
         [*MSGS, {"role": "assistant", "content": "It is"}], rendered + "<|assistant|>It is"),
    ]  # fmt: skip
    counts = []
    for flags, messages, prompt in cases:
        chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0.0,
                                              extra_body={"ignore_eos": True, **flags})  # fmt: skip
        plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, **GREEDY)
        assert chat.usage.prompt_tokens == plain.usage.prompt_tokens == len(_tokenize(server, prompt)), flags
        assert chat.choices[0].message.content == plain.choices[0].text, flags
        counts.append(chat.usage.prompt_tokens)
    assert len(set(counts)) == 3  # three different prompts


def test_async_client_concurrent_streams(server: ServerProcess, client: openai.OpenAI) -> None:
    """32 concurrent streams (greedy, some with a stop string) all finish with the right reason."""
    base = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=24, **GREEDY)
    stop = middle_stop_string(base.choices[0].text)
    expected_stop_text = base.choices[0].text[: base.choices[0].text.index(stop)]

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[int, str, str | None, int]:
        kwargs = {"stop": [stop]} if i % 4 == 0 else {}
        max_tokens = 8 + i % 5 if i % 4 else 24
        stream = await aclient.completions.create(
            model=MODEL_NAME,
            prompt="hello world",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
            **kwargs,
        )
        text, finish, usage = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return max_tokens, text, finish, usage

    async def main() -> list[tuple[int, str, str | None, int]]:
        aclient = async_client(server)
        try:
            chat = await aclient.chat.completions.create(
                model=MODEL_NAME, messages=MSGS, max_tokens=3, **GREEDY
            )
            assert chat.choices[0].finish_reason == "length"
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(32))), timeout=120)
        finally:
            await aclient.close()

    results = asyncio.run(main())
    for i, (max_tokens, text, finish, usage) in enumerate(results):
        if i % 4 == 0:
            assert (finish, text) == ("stop", expected_stop_text), i
        else:
            assert finish == "length" and usage == max_tokens, i
            # A sample cut mid-character ends in U+FFFD where the longer one has the whole character.
            assert base.choices[0].text.startswith(text.rstrip("\ufffd")), i
