"""Built-in demo model family ``phalanx-math`` (tiny Llama / Mixtral models + drafters) and the
scripts that train, build and evaluate it.

Importable without torch. The names and folders are ``phalanx.checkpoint``'s (which resolves every
model name); they are re-exported here for the demo scripts.
"""

from __future__ import annotations

from phalanx.checkpoint import DEMO_MODELS as BUILTIN_MODELS
from phalanx.checkpoint import DEMO_MODELS_DIR as MODELS_DIR
from phalanx.checkpoint import DEMO_NAMES as BUILTIN_NAMES


def resolve_model_path(name_or_path: str) -> str:
    """Map a built-in demo model name to its folder; pass anything else through unchanged."""
    p = BUILTIN_MODELS.get(name_or_path)
    return str(p) if p is not None else name_or_path


__all__ = ["BUILTIN_MODELS", "BUILTIN_NAMES", "MODELS_DIR", "resolve_model_path"]
