"""Prompt preparation for the API server, off its event loop: chat templates, tokenization, limits.

Owns: `PromptPreparer` -- turning a request's prompt (text, token ids, or chat messages) into
prompt token ids on a small thread pool with one tokenizer copy per thread, so that a long prompt
never stalls the event loop that streams every other request (Hugging Face fast tokenizers release
the GIL while encoding; a chat template is Python, which the interpreter interleaves with the loop
every few milliseconds); and the character limit checked *before* that work: a text longer than
max_model_len x the longest token (in characters) cannot fit in the context, so it is rejected
without being tokenized.
Does not own: sampling fields and their limits (``protocol``), the token-count checks against the
context length (``serving``), rendering itself (``engine.tokenizer.render_chat``), detokenizing
outputs (the engine front end's ``OutputProcessor``).
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from phalanx.engine.tokenizer import render_chat

T = TypeVar("T")

TOKENIZER_THREADS = 2  # a long prompt occupies one; short ones keep flowing through the other


class PromptError(ValueError):
    """A prompt the server refuses (HTTP 400); `param` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry (byte-level
    and sentencepiece entries spell each byte or character with at least one character)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


class PromptPreparer:
    def __init__(self, tokenizer: Any | None, max_model_len: int, num_threads: int = TOKENIZER_THREADS) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * longest_token_chars(tokenizer) if tokenizer is not None else 0
        self._local = threading.local()
        # The workers' tokenizer copies, made here rather than on the workers: copying goes through
        # the Rust tokenizer's serialized form, and a worker would leave that garbage in its own
        # malloc arena, which the process keeps (~30 MB per thread for SmolLM2's tokenizer).
        self._copies: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(num_threads if tokenizer is not None else 0):
            self._copies.put(copy.deepcopy(tokenizer))
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="phalanx-tokenizer")

    # ---- the thread pool --------------------------------------------------------------------
    def _thread_tokenizer(self) -> Any:
        """This worker thread's own tokenizer: a fast tokenizer's encode mutates its Rust state
        (truncation / padding settings) and refuses concurrent use ("Already borrowed")."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = self._copies.get_nowait()  # one per pool thread
        return tok

    async def run(self, fn: Callable[[Any], T]) -> T:
        """`fn(tokenizer)` on a worker thread with that thread's tokenizer."""
        if self.tokenizer is None:
            raise PromptError("this model has no tokenizer; send token ids as the prompt", "prompt")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(self._thread_tokenizer()))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- limits -----------------------------------------------------------------------------
    def check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_chars:
            raise PromptError(
                f"the {param} has {num_chars} characters; no text over {self.max_chars} characters "
                f"(max_model_len {self.max_model_len} x the longest token, "
                f"{self.max_chars // self.max_model_len} characters) fits in this model's context",
                param,
            )

    # ---- prompts ----------------------------------------------------------------------------
    async def encode(self, prompt: str | list[int], add_special_tokens: bool = True, param: str = "prompt") -> Prompt:
        """Text -> token ids (off the loop); token ids pass through."""
        if not isinstance(prompt, str):
            return Prompt(None, list(prompt))
        if self.tokenizer is None:
            raise PromptError("this model has no tokenizer; send token ids as the prompt", param)
        self.check_chars(len(prompt), param)
        ids = await self.run(lambda tok: list(tok(prompt, add_special_tokens=add_special_tokens).input_ids))
        return Prompt(prompt, ids)

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> str:
        """The chat template applied to `messages` (off the loop); ValueError when it fails."""
        if self.tokenizer is None:
            raise PromptError("this model has no tokenizer, so it cannot serve chat completions")
        self.check_chars(sum(len(str(m.get("content", ""))) for m in messages), "messages")

        def render(tok: Any) -> str:
            try:
                return render_chat(tok, messages, add_generation_prompt, continue_final_message, chat_template_kwargs)
            except ValueError:
                raise
            except Exception as e:  # jinja errors raised by the template itself (e.g. role order)
                raise ValueError(f"the chat template failed to render these messages: {e}") from e

        return await self.run(render)

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
        add_special_tokens: bool = False,
    ) -> Prompt:
        """Rendered and tokenized (the template carries the special tokens: none are added, unless
        `add_special_tokens`, which `/tokenize` may ask for, as vLLM's does)."""
        text = await self.render_chat(messages, add_generation_prompt, continue_final_message, chat_template_kwargs)
        return await self.encode(text, add_special_tokens=add_special_tokens, param="messages")

    async def decode(self, token_ids: list[int]) -> str:
        return await self.run(lambda tok: tok.decode(token_ids))
