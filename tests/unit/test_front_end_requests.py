"""What the server hands the engine, on the real app over a fake engine (no processes): the samples
of an n > 1 request as one group (the scheduler lets one compute the shared prompt and the others
wait for its cached blocks), as offline; and every sampling field a client sends, with its value."""

from __future__ import annotations

import asyncio

from tests.fake_engine import fake_app
from tests.tokenizer_fixtures import make_byte_bpe_tokenizer, make_chat_tokenizer


def test_the_samples_of_one_request_share_a_group_and_single_samples_have_none() -> None:
    """Regression: the server sent every sample without its group (offline `LLM` set it), so the n
    samples of a request each computed the whole prompt."""

    async def run() -> list:
        async with fake_app(make_byte_bpe_tokenizer(), vocab_size=320) as (http, engine, _):
            for body in ({"prompt": [5, 6, 7], "n": 3, "max_tokens": 2},
                         {"prompt": [[5, 6], [7, 8, 9]], "n": 2, "max_tokens": 2},
                         {"prompt": [5, 6, 7], "max_tokens": 2}):
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
            return list(engine.added)

    added = asyncio.run(run())
    assert len(added) == 3 + 2 * 2 + 1
    groups = [r.group_id for r in added]
    assert groups[-1] is None  # one sample: no group
    firsts = groups[:3], groups[3:5], groups[5:7]
    for g in firsts:
        assert g[0] is not None and len(set(g)) == 1, groups
    assert len({g[0] for g in firsts}) == 3  # each prompt of each request its own group


def test_every_sampling_field_sent_over_http_reaches_the_engine() -> None:
    """The OpenAI fields and vLLM's extensions, on both endpoints, land in the engine request's
    SamplingParams with the values sent (an end-to-end test that only checks a 200 cannot tell a
    field honoured from one dropped)."""
    common = {"temperature": 0.7, "top_p": 0.9, "seed": 11, "presence_penalty": 0.5, "frequency_penalty": 0.25,
              "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
              "skip_special_tokens": False, "include_stop_str_in_output": True, "stop": ["xyz"],
              "stop_token_ids": [7], "logit_bias": {"5": 1.5}, "max_tokens": 9}
    bodies = {
        "/v1/completions": {**common, "prompt": [5, 6, 7], "logprobs": 2, "echo": True},
        "/v1/chat/completions": {**common, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                 "top_logprobs": 3},
    }
    tok = make_chat_tokenizer()

    async def run() -> list:
        async with fake_app(tok, vocab_size=320) as (http, engine, _):
            for path, body in bodies.items():
                r = await http.post(path, json=body)
                assert r.status_code == 200, (path, r.text)
            return [r.sampling_params for r in engine.added]

    completions, chat = asyncio.run(run())
    for p in (completions, chat):
        assert (p.temperature, p.top_p, p.seed, p.presence_penalty, p.frequency_penalty) == (0.7, 0.9, 11, 0.5, 0.25)
        assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens, p.max_tokens) == (20, 0.05, 1.1, 2, 9)
        assert p.ignore_eos and not p.skip_special_tokens and p.include_stop_str_in_output
        assert p.stop == ["xyz"] and p.stop_token_ids == [7] and p.logit_bias == {5: 1.5}
    assert completions.logprobs == 2 and completions.prompt_logprobs == 2  # echo with logprobs: the prompt's too
    assert chat.logprobs == 3 and chat.prompt_logprobs is None
