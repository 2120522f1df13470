"""`/tokenize` honours every field it accepts (vLLM's two forms in one body): `add_special_tokens`
with `prompt` (default true) and with `messages` (default false: the chat template carries its
special tokens), and the chat template's fields with `messages` only (with `prompt` they are a 400
naming the field, not silently ignored; sent as null they ask for nothing). The real app over a fake
engine (no processes)."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenizers import processors

from tests.fake_engine import fake_app
from tests.tokenizer_fixtures import make_chat_tokenizer

MSGS = [{"role": "user", "content": "hi"}]


def _tokenizer() -> Any:
    """The byte-level BPE with a BOS-like special token added in front when special tokens are."""
    tok = make_chat_tokenizer()
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    return tok


def test_tokenize_honours_add_special_tokens_and_refuses_chat_fields_with_a_prompt() -> None:
    tok = _tokenizer()
    bos = tok.convert_tokens_to_ids("<|endoftext|>")

    async def run() -> dict[str, Any]:
        async with fake_app(tok, vocab_size=320) as (http, _, _):
            async def tokens(body: dict) -> Any:
                r = await http.post("/tokenize", json=body)
                return r.json()["tokens"] if r.status_code == 200 else (r.status_code, r.json()["error"])

            return {
                "prompt": await tokens({"prompt": "hello"}),
                "prompt_plain": await tokens({"prompt": "hello", "add_special_tokens": False}),
                "chat": await tokens({"messages": MSGS}),
                "chat_special": await tokens({"messages": MSGS, "add_special_tokens": True}),
                "chat_no_opener": await tokens({"messages": MSGS, "add_generation_prompt": False}),
                "bad": await tokens({"prompt": "hello", "add_generation_prompt": False}),
                "bad_kwargs": await tokens({"prompt": "hello", "chat_template_kwargs": {}}),
                "null_chat_fields": await tokens({"prompt": "hello", **dict.fromkeys(
                    ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "add_special_tokens"))}),
            }

    got = asyncio.run(run())
    assert got["prompt"] == [bos, *got["prompt_plain"]] and bos not in got["prompt_plain"]
    assert got["chat"] == tok(tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False).input_ids
    assert got["chat_special"] == [bos, *got["chat"]]
    assert got["chat_no_opener"] == got["chat"]  # this template has no assistant opener
    assert got["null_chat_fields"] == got["prompt"]  # null: asking for nothing (the defaults)
    for key, field in (("bad", "add_generation_prompt"), ("bad_kwargs", "chat_template_kwargs")):
        status, error = got[key]
        assert status == 400 and error["param"] == field and "'messages' only" in error["message"], got[key]
