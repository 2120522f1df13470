"""Token ids -> text, streamed: incremental detokenization, stop strings, logprob token strings.

Owns:
  * ``IncrementalDetokenizer`` -- turns a growing list of output token ids into text deltas for one
    request. It never emits a broken UTF-8 character: a character whose bytes are spread over several
    byte-level tokens is held back until its last byte arrives (``flush`` releases what is left at the
    end). Each step decodes only a short window of recent tokens (the prefix / read offset technique), so
    a step costs O(window), not O(output length).
  * ``StopStringChecker`` -- finds stop strings in the streamed text, holding back a suffix that could
    still become a stop string so that no part of a stop string ever leaks into a stream.
  * ``detokenize_logprobs`` -- the per-token strings shown next to logprobs (OpenAI style).

Does not own: tokenization and chat templates (the API server calls the Hugging Face tokenizer
directly), stop *token ids* / EOS (the scheduler ends a request on those, with token ids only), finish
reasons, or which text goes into which response (the output processor). Engine cores never import this
module: all text-level work happens in the API server process (DESIGN.md section 2).

Only transformers fast tokenizers are supported (a ``PreTrainedTokenizerFast``; in transformers v5 that
is ``TokenizersBackend``): everything here decodes through ``tokenizer.backend_tokenizer`` (the Rust
``tokenizers.Tokenizer``) directly, which is both faster than ``tokenizer.decode`` and gives exactly the
same text when ``clean_up_tokenization_spaces`` is off (the v5 default; v5 ignores it for BPE models
anyway). Clean-up is never applied here, because it is not prefix-stable (``" ."`` -> ``"."`` can span
two steps).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers import decoders as tokenizers_decoders

__all__ = ["IncrementalDetokenizer", "StopStringChecker", "detokenize_logprobs"]

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as left context for the first output tokens. Context matters for decoders that
# treat the first token of a string specially (sentencepiece's Metaspace drops the leading space of the
# first token), so "Hello" + ["▁world"] must stream " world", as in the full decode. Five tokens are
# enough for that and cover a whole UTF-8 character (at most four bytes). Same choice as vLLM.
_PROMPT_CONTEXT_TOKENS = 5


def _backend_tokenizer(tokenizer: Any) -> Tokenizer:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(
            f"expected a transformers fast tokenizer (PreTrainedTokenizerFast) with a "
            f"`backend_tokenizer`, got {type(tokenizer).__name__}; slow (Python) tokenizers are not supported"
        )
    return backend


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens, one ``add_tokens`` call per engine step.

    Invariant: ``output_text`` (the concatenation of every delta returned so far, plus ``flush()``)
    equals ``tokenizer.decode(context + output_ids)`` minus the decoded context, where the context is the
    last few prompt tokens. For byte-level BPE this is exactly ``tokenizer.decode(output_ids)``; for
    sentencepiece-like decoders it keeps the leading space of the first output token, like vLLM.

    How a step works, on an example (byte-level BPE, "你" = bytes e4 bd a0 in three tokens)::

        ids:        [..context.., "Hi", " ", <e4>, <bd>, <a0>]
                     ^prefix_offset       ^read_offset
        prefix_text = decode(ids[prefix_offset:read_offset])
        new_text    = decode(ids[prefix_offset:])         # "Hi \ufffd" after <e4>, <bd>: held back
        delta       = new_text[len(prefix_text):]         # after <a0>: "你"

    After emitting, ``prefix_offset`` moves to the old ``read_offset`` (so the new first token still has
    left context) and ``read_offset`` to the end. While the window's text ends in U+FFFD (an incomplete
    character) or adds nothing (a skipped special token), the offsets stay and the window grows.

    ``spaces_between_special_tokens`` follows vLLM for fast tokenizers: ``True`` (default) is the
    tokenizer's own decoding (what ``tokenizer.decode`` returns; byte-level BPE puts no space around
    special tokens, WordPiece does). ``False`` renders every added token as its raw content, glued to
    its neighbours, and decodes the runs of ordinary tokens between them separately. It has no effect
    when ``skip_special_tokens`` is true (nothing special is left to put spaces around).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._backend = _backend_tokenizer(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Added tokens rendered verbatim when spaces_between_special_tokens is False.
        self._added_token_text: dict[int, str] = (
            {}
            if skip_special_tokens or spaces_between_special_tokens
            else {tid: tok.content for tid, tok in self._backend.get_added_tokens_decoder().items()}
        )

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character (or in an invalid byte). Using it as context would let
            # the first output bytes "complete" a prompt character and shift the text diff; decode the
            # output on its own instead, as tokenizer.decode(output_ids) does.
            context = []
        self._token_ids: list[int] = context  # context + output ids; only the tail is ever decoded
        self._num_context_tokens = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text_pieces: list[str] = []
        self._finished = False

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_context_tokens :]

    @property
    def output_text(self) -> str:
        """All text emitted so far (held-back bytes excluded until they complete or ``flush``)."""
        if len(self._text_pieces) > 1:
            self._text_pieces = ["".join(self._text_pieces)]
        return self._text_pieces[0] if self._text_pieces else ""

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Appends the step's new output tokens; returns the text that became complete ("" if none).

        Tokens are taken one at a time, so the text is the same however a step groups them: a
        speculative step's [.., "9", <e3>] releases "..9" now, not once the character <e3> starts is
        complete (a stop string ending in "9" must end the request at this step)."""
        if self._finished:
            raise RuntimeError("add_tokens() called after flush(); a flushed detokenizer is finished")
        return "".join([self._add_token(token_id) for token_id in new_token_ids])

    def _add_token(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing new (skipped special token) or an incomplete character: wait for more tokens.
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._text_pieces.append(delta)
        return delta

    def flush(self) -> str:
        """Releases held-back text at the end of the request (it may contain U+FFFD). Call once."""
        if self._finished:
            return ""
        self._finished = True
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._token_ids)
        if delta:
            self._text_pieces.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not self._added_token_text:
            return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        # spaces_between_special_tokens=False: [a, b, <s>, c] -> decode([a, b]) + "<s>" + decode([c])
        pieces: list[str] = []
        run_start = 0
        for index, token_id in enumerate(token_ids):
            added_text = self._added_token_text.get(token_id)
            if added_text is not None:
                if run_start < index:
                    pieces.append(self._backend.decode(token_ids[run_start:index], skip_special_tokens=False))
                pieces.append(added_text)
                run_start = index + 1
        if run_start < len(token_ids):
            pieces.append(self._backend.decode(token_ids[run_start:], skip_special_tokens=False))
        return "".join(pieces)


class StopStringChecker:
    """Cuts a text stream at the first stop string, without ever leaking part of one.

    Semantics (same as running over the whole text at once): the output ends at the *earliest start
    position* of any stop string in the full text; when several stop strings start there, the shortest
    one wins (it is the one that completes first). The stop string itself is dropped unless
    ``include_stop_str_in_output``. vLLM checks stop strings in list order instead; the earliest match is
    what the non-streaming text would show, so that is what the stream shows too.

    Streaming: ``process`` keeps back the shortest suffix of the unreleased text at which some stop
    string could still begin (a proper prefix of a stop string), at most ``max(len(stop)) - 1``
    characters, and releases it once it can no longer match. A complete match is only reported once no
    earlier position could still grow into a match: with stops ["bcd", "c"], the text "abc" is held
    until the next character decides between "bcd" and "c". Each call costs O(len(delta) + longest stop
    string x number of stop strings), independent of the text length. The hold-back is applied in both
    include/exclude modes: it costs at most a few characters of latency and keeps one code path.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(stop))  # de-duplicated, order kept
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once ``process`` or ``flush`` found one."""
        return self._matched

    def process(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the matched stop string or None).

        After a match, the request is over: the caller must not call ``process`` again.
        """
        if self._matched is not None:
            raise RuntimeError(f"process() called after stop string {self._matched!r} matched")
        if not self.stop:
            return delta, None
        text = self._held + delta
        hold_from = self._earliest_partial_match(text)
        match = self._earliest_complete_match(text)
        if match is not None and match[0] <= hold_from:
            # A partial match at the same start belongs to a longer stop string: the shorter one wins.
            start, stop_str = match
            self._matched = stop_str
            self._held = ""
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            return text[:end], stop_str
        self._held = text[hold_from:]
        return text[:hold_from], None

    def flush(self) -> str:
        """Releases the held-back text when the request ends for another reason (length, EOS).

        The held text can contain a complete stop string that was waiting for an earlier, longer one
        to be ruled out (stops ["aba", "b"], text "ab"). The stream ends, so it is ruled out: the text
        is cut at that stop string and ``matched`` is set -- the caller should then report finish
        reason "stop" (with ``matched``) instead of "length".
        """
        text, self._held = self._held, ""
        if self._matched is not None or not self.stop:
            return text
        match = self._earliest_complete_match(text)
        if match is None:
            return text
        start, self._matched = match
        return text[: start + len(self._matched) if self.include_stop_str_in_output else start]

    def _earliest_complete_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop_str in self.stop:
            start = text.find(stop_str)
            if start != -1 and (best is None or (start, len(stop_str)) < best[:2]):
                best = (start, len(stop_str), stop_str)
        return None if best is None else (best[0], best[2])

    def _earliest_partial_match(self, text: str) -> int:
        """Smallest i such that text[i:] is a proper prefix of a stop string; len(text) if none."""
        # "xab" with stop "abc": i=1 ("ab" could become "abc"); only the last max_len-1 chars can qualify.
        for start in range(max(0, len(text) - self._max_stop_len + 1), len(text)):
            tail = text[start:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stop):
                return start
        return len(text)


# --------------------------------------------------------------------------------------------------
# Logprob token strings
# --------------------------------------------------------------------------------------------------


def _byte_level_char_to_byte() -> dict[str, int]:
    """Inverse of byte-level BPE's byte -> printable char table (GPT-2 scheme).

    Printable Latin-1 bytes stand for themselves; the 68 others (controls, space, 0x7f-0xa0, 0xad)
    are mapped, in byte order, to chr(256), chr(257), ...
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    unprintable = sorted(set(range(256)) - set(printable))
    table.update({chr(256 + i): byte for i, byte in enumerate(unprintable)})
    return table


_BYTE_LEVEL_CHAR_TO_BYTE = _byte_level_char_to_byte()
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_bytes(backend: Tokenizer, token_id: int) -> bytes | None:
    """The raw bytes a token stands for, when the tokenizer makes them recoverable; else None."""
    token = backend.id_to_token(token_id)
    if token is None:
        return None
    fallback = _BYTE_FALLBACK_TOKEN.fullmatch(token)
    if fallback is not None:  # sentencepiece byte fallback: "<0xE4>"
        return bytes([int(fallback.group(1), 16)])
    if isinstance(backend.decoder, tokenizers_decoders.ByteLevel) and all(
        ch in _BYTE_LEVEL_CHAR_TO_BYTE for ch in token
    ):
        return bytes(_BYTE_LEVEL_CHAR_TO_BYTE[ch] for ch in token)
    return None


def detokenize_logprobs(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """Per-token strings for logprobs output (``logprobs.content[i].token`` / ``top_logprobs``).

    Each id is rendered on its own (they are alternatives at one position, not a sequence):

    * A token whose bytes form whole characters gives its text, leading space included (" world",
      also for sentencepiece's "▁world", which is decoded after an anchor token so the decoder does
      not strip the space of a "first" token). Special tokens give their content ("<|endoftext|>").
    * A token holding only part of a UTF-8 character gives ``"bytes:\\xe4\\xbd"`` -- the literal
      characters ``bytes:`` then one ``\\xNN`` (lower-case hex) per byte, as OpenAI's API does -- when
      the tokenizer lets us recover its bytes (byte-level BPE, sentencepiece ``<0xNN>`` byte fallback).
      Otherwise it gives the decoder's text, which then contains U+FFFD.
    """
    backend = _backend_tokenizer(tokenizer)
    ids = [int(t) for t in token_ids]
    if not ids:
        return []
    # Any ordinary token works as the anchor; the last piece of "a" is one ("a", or "a" of "▁" + "a").
    anchor = backend.encode("a", add_special_tokens=False).ids[-1:]
    texts: list[str]
    if anchor:
        anchor_text = backend.decode(anchor, skip_special_tokens=False)
        with_anchor = backend.decode_batch([[anchor[0], t] for t in ids], skip_special_tokens=False)
        alone = None
        texts = []
        for i, text in enumerate(with_anchor):
            if anchor_text and text.startswith(anchor_text):
                texts.append(text[len(anchor_text) :])
            else:  # decoder merged the anchor with the token: fall back to decoding it alone
                alone = alone or backend.decode_batch([[t] for t in ids], skip_special_tokens=False)
                texts.append(alone[i])
    else:
        texts = backend.decode_batch([[t] for t in ids], skip_special_tokens=False)

    result: list[str] = []
    for token_id, text in zip(ids, texts):
        if REPLACEMENT_CHAR in text:
            raw = _token_bytes(backend, token_id)
            if raw is not None and not _is_valid_utf8(raw):
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        result.append(text)
    return result


def _is_valid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
