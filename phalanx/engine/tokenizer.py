"""Loading a checkpoint's tokenizer and rendering chat templates (transformers does the work).

Owns: `load_tokenizer` (None when the checkpoint has no tokenizer: token-id prompts still work),
`eos_token_ids_of`, and `render_chat` (the one place chat messages become prompt text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phalanx.checkpoint import resolve_model_path, tokenizer_path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(name_or_path: str) -> Any | None:
    """The tokenizer of a checkpoint (anything `checkpoint.resolve_model_path` takes: a folder, a
    .gguf file -- its tokenizer converted from the GGUF metadata --, a built-in name or a hub id)."""
    folder = Path(tokenizer_path(resolve_model_path(name_or_path)))
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def eos_token_ids_of(tokenizer: Any | None) -> list[int]:
    if tokenizer is None or tokenizer.eos_token_id is None:
        return []
    eos = tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Apply the model's chat template; returns prompt text (tokenize without special tokens)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use the completions API instead")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message needs the last message to be an assistant message")
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **(chat_template_kwargs or {}),
    )
