"""Reading checkpoint weights: safetensors (one file or sharded with an index) and GGUF files.

Owns: finding the weight files of a Hugging Face folder and streaming (Hugging Face name, tensor)
pairs from either format (GGUF tensors are dequantized and renamed by ``phalanx.gguf_file``).
Does not own: name mapping to phalanx's parameters (each model's `load_weights`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from phalanx.checkpoint import hf_config, is_gguf


def weight_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {str(folder)!r} (phalanx reads safetensors folders and .gguf files)"
        )
    return files


def iterate_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    if is_gguf(path):
        from phalanx.gguf_file import iterate_gguf_weights

        yield from iterate_gguf_weights(path, hf_config(path))
        return
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)
