"""Loading a checkpoint's tokenizer and rendering chat templates (transformers does the work).

Owns: `load_tokenizer` (None when the checkpoint has no tokenizer: token-id prompts still work),
`eos_token_ids_of`, and `render_chat` (the one place chat messages become prompt text).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phalanx.checkpoint import resolve_model_path, tokenizer_path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(name_or_path: str, *, torch_free: bool = False) -> Any | None:
    """The tokenizer of a checkpoint (anything `checkpoint.resolve_model_path` takes: a folder, a
    .gguf file -- its tokenizer converted from the GGUF metadata --, a built-in name or a hub id).

    `torch_free` (the API server): when this process has imported neither torch nor transformers,
    transformers is imported as if torch were not installed, as a tokenizer-only install runs it,
    so that neither loading the tokenizer nor using it imports torch (transformers' configuration
    classes import it whenever it is installed)."""
    folder = Path(tokenizer_path(resolve_model_path(name_or_path)))
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    with _torch_hidden() if torch_free else contextlib.nullcontext():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """Within: `import torch` fails and `importlib.util.find_spec("torch")` finds nothing (a None in
    `sys.modules`), so a first `import transformers` caches `is_torch_available() == False` for the
    process's life. Nothing is hidden once either is imported (transformers would then import torch
    on the strength of its earlier answer)."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        yield
        return
    advisory = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # its "PyTorch was not found" notice
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
        if advisory is None:
            os.environ.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advisory


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
