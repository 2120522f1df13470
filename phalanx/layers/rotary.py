"""Rotary position embeddings (non-interleaved, "rotate half"), with Llama-3 and linear scaling.

Owns: the inverse frequencies for each supported `rope_type` and a cos/sin table indexed by
absolute position. Does not own: which positions a token has (the model runner computes them).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "default":
        return inv_freq
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: 'default', 'linear', 'llama3'")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2], float32 as HF has them
        emb = torch.cat((freqs, freqs), dim=-1).numpy().astype(np.float64)  # [max_positions, head_dim]
        # cos / sin of those float32 angles in float64, rounded once to float32: the nearest float32
        # to the true value, the same in every process. torch's float32 `cos` is not: in about one
        # process in eight (torch 2.13, this table the process's first parallel op) the second
        # thread's half of the table came out up to 1.5e-4 off (cos(1024) as 0.98720 for 0.98735),
        # and greedy outputs past the middle position changed from one run of the engine to the next.
        self.register_buffer("cos", torch.from_numpy(np.cos(emb).astype(np.float32)), persistent=False)
        self.register_buffer("sin", torch.from_numpy(np.sin(emb).astype(np.float32)), persistent=False)
        self.kernel: Any = None  # the compiled ops module (``ops.cpu.attach``), bf16 only
        self._typed: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # cos / sin per dtype

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin rows [T, 1, head_dim] for this batch, computed once per forward (all layers
        share them; `cache` is the batch's ``ForwardMemo.rotary_rows``)."""
        key = (self, dtype)
        if key not in cache:
            cos, sin = self.typed_tables(dtype)
            cache[key] = (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
        return cache[key]

    def typed_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos / sin tables [max_positions, head_dim] in `dtype` (converted once)."""
        typed = self._typed.get(dtype)
        if typed is None or typed[0].device != self.cos.device:
            typed = self._typed[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return typed

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim]
        cos, sin = self.tables(positions, q.dtype, {} if cache is None else cache)
        if self.kernel is not None and q.dtype == torch.bfloat16:
            return self.kernel.rotary(q, cos, sin), self.kernel.rotary(k, cos, sin)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor, cache: dict) -> torch.Tensor:
        """Rotate a [T, heads, head_dim] tensor (queries and keys side by side: one op chain)."""
        cos, sin = self.tables(positions, x.dtype, cache)
        if self.kernel is not None and x.dtype == torch.bfloat16:
            return self.kernel.rotary(x, cos, sin)
        return x * cos + _rotate_half(x) * sin
