"""Built-in demo model family ``phalanx-math`` (tiny Llama / Mixtral models + drafters).

Importable without torch: only path resolution lives here.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"

BUILTIN_NAMES = (
    "phalanx-math",
    "phalanx-math-draft",
    "phalanx-math-eagle",
    "phalanx-math-eagle3",
    "phalanx-math-moe",
    "phalanx-math-moe-draft",
)

BUILTIN_MODELS: dict[str, Path] = {name: MODELS_DIR / name for name in BUILTIN_NAMES}


def resolve_model_path(name_or_path: str) -> str:
    """Map a built-in model name to its folder; pass anything else through unchanged."""
    p = BUILTIN_MODELS.get(name_or_path)
    return str(p) if p is not None else name_or_path


__all__ = ["BUILTIN_MODELS", "BUILTIN_NAMES", "MODELS_DIR", "resolve_model_path"]
