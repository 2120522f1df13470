"""The rotary tables: every entry the float32 nearest to the true cos / sin of its float32 angle,
so every process builds the same table (torch's float32 `cos`, run as a process's first parallel
op, was off by up to 1.5e-4 on one thread's half of the table in about one process in eight)."""

from __future__ import annotations

import math

import numpy as np
import torch

from phalanx.layers.rotary import RotaryEmbedding, inverse_frequencies


def test_the_tables_are_the_nearest_float32_of_their_angles() -> None:
    head_dim, max_positions = 64, 8192  # SmolLM2's
    rotary = RotaryEmbedding(head_dim, max_positions, 10000.0, None)
    inv_freq = inverse_frequencies(head_dim, 10000.0, None)
    rng = np.random.default_rng(0)
    # both halves of the table (a parallel op splits it there), its ends and random positions
    positions = sorted({0, 1, max_positions // 2 - 1, max_positions // 2, max_positions - 1,
                        *rng.integers(0, max_positions, 200).tolist()})
    for p in positions:
        angles = (torch.tensor(float(p)) * inv_freq).tolist()  # float32 products, as the table's
        angles = angles + angles
        want_cos = np.array([math.cos(a) for a in angles], dtype=np.float64).astype(np.float32)
        want_sin = np.array([math.sin(a) for a in angles], dtype=np.float64).astype(np.float32)
        assert np.array_equal(rotary.cos[p].numpy(), want_cos), p
        assert np.array_equal(rotary.sin[p].numpy(), want_sin), p
    assert rotary.cos.dtype == rotary.sin.dtype == torch.float32
