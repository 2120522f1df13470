"""The shared training loop runs bf16 autocast only where the CPU computes bf16 matmuls fast."""

from __future__ import annotations

import pytest
import torch

from phalanx.ops.cpu import cpu_flags
from phalanx.training import loop as loop_mod
from phalanx.training.loop import LoopConfig, TrainLoop


def _run(bf16: bool) -> list[bool]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def loss_fn(batch):  # noqa: ANN001, ANN202
        seen.append(torch.is_autocast_enabled("cpu"))
        return model(batch).pow(2).mean(), ""

    loop = TrainLoop(LoopConfig(steps=2, lr=0.1, warmup=0, bf16=bf16), model, opt, lambda _step: torch.ones(3, 4),
                     loss_fn)
    loop.run(progress=False)
    return seen


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_autocast_only_where_the_cpu_is_fast(monkeypatch, fast):
    monkeypatch.setattr(loop_mod, "bf16_autocast_fast", lambda: fast)
    assert _run(bf16=True) == [fast, fast]
    assert _run(bf16=False) == [False, False]  # never asked for: never on


def test_fast_bf16_means_avx512_or_better():
    """oneDNN's bf16 kernels start at AVX-512 (BW/VL/DQ); an AVX2-only CPU trains in float32."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    assert loop_mod.bf16_autocast_fast() == ({"avx512bw", "avx512vl", "avx512dq"} <= flags)
