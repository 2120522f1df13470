"""Reading checkpoint weights: safetensors (one file or sharded with an index) and GGUF files.

Owns: finding the weight files of a Hugging Face folder, streaming (Hugging Face name, tensor)
pairs from either format (GGUF tensors are dequantized and renamed by ``phalanx.gguf_file``), and
`release_load_buffers` (giving the heap that loading freed back to the OS; `trim_heap`).
Does not own: name mapping to phalanx's parameters (each model's `load_weights`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from phalanx.checkpoint import gguf_conversion, hf_config, is_gguf


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
        from phalanx.gguf_file import TENSOR_INDEX, iterate_gguf_weights

        yield from iterate_gguf_weights(path, hf_config(path), gguf_conversion(path) / TENSOR_INDEX)
        return
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


@functools.cache
def _libc_malloc_trim():  # noqa: ANN202
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def trim_heap() -> bool:
    """Give the free chunks of glibc's heap arenas back to the OS (``malloc_trim``): glibc keeps
    freed memory mapped, so a process whose tensors change size from one use to the next holds
    far more than it uses. False where the C library has no ``malloc_trim``."""
    trim = _libc_malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def release_load_buffers() -> bool:
    """Return the heap that loading freed (dequantized / converted copies of every weight, packing
    buffers) to the OS (`trim_heap`): ~100 MB for a 135M-parameter GGUF, which would otherwise stay
    in the engine's resident set for its whole life. Call once after the model (and drafter) are
    loaded, before the KV cache. False where the C library has no ``malloc_trim``."""
    return trim_heap()
