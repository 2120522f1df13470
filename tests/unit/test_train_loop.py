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


@pytest.mark.parametrize(("every", "want"), [(10, [10, 20]), (7, [7, 14]), (0, [])])
def test_the_loop_gives_the_freed_heap_back_every_trim_every_steps(monkeypatch, every, want):
    """Batches of different shapes fragment glibc's arenas and the resident set grows step after
    step unless the freed heap is trimmed: the loop trims after every `trim_every`-th step."""
    from phalanx.models import loader

    steps_at_trim: list[int] = []
    done = [0]
    monkeypatch.setattr(loader, "trim_heap", lambda: steps_at_trim.append(done[0]) or True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(batch):  # noqa: ANN001, ANN202
        done[0] += 1
        return model(batch).pow(2).mean(), ""

    TrainLoop(LoopConfig(steps=20, lr=0.1, warmup=0, trim_every=every), model, opt, lambda _step: torch.ones(3, 4),
              loss_fn).run(progress=False)
    assert steps_at_trim == want


def test_trim_heap_returns_whether_the_c_library_can_trim():
    from phalanx.models import loader

    assert loader.trim_heap() is (loader._libc_malloc_trim() is not None)
