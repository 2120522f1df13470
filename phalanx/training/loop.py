"""The training loop every phalanx trainer shares (the demo models, EAGLE heads for any target).

Owns: the learning-rate schedule (`lr_at`: linear warm-up, cosine decay to a floor), `TrainLoop`
(one optimizer step as named steps — `set_lr`, `train_step`, then `maybe_eval` / `maybe_checkpoint`
— under bf16 autocast where the CPU computes bf16 fast (`bf16_autocast_fast`), with a progress bar
and the loss curves), `LoopState` (what a resumed run continues from), and `save_checkpoint` /
`load_checkpoint` (model, optimizer and loop state in one file, written whole and renamed into
place, so a crash leaves the previous one).
Does not own: what a batch is or what the loss is (the caller's `next_batch` and `loss_fn`).

A parameter group may carry ``lr_scale`` (default 1): its learning rate is the schedule's times it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

B = TypeVar("B")


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then cosine from `peak` down to `floor` x `peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def bf16_autocast_fast() -> bool:
    """Whether bfloat16 autocast speeds training up on this CPU: oneDNN has bf16 matmul kernels from
    AVX-512 up (native on AVX512-BF16 and AMX); below that torch's bf16 matmul takes a converting
    reference path, 16x slower than float32 (a SmolLM2 EAGLE-3 training step, 4,096 tokens, 2 threads
    on an AVX2-only Zen 3: 110 s under autocast, 6.7 s in float32)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class LoopConfig:
    steps: int
    lr: float
    warmup: int
    clip: float = 1.0  # gradient-norm clip (0: none)
    # bfloat16 autocast for the forward (fp32 master weights and optimizer state) where the CPU computes
    # bf16 matmuls fast (`bf16_autocast_fast`); float32 elsewhere
    bf16: bool = False
    threads: int = 1  # torch threads while the loop runs
    eval_every: int = 0  # evaluate every this many steps and at the end (0: only at the end)
    checkpoint_every: int = 0  # call the checkpoint hook every this many steps (0: never)
    desc: str = "train"
    lr_floor: float = 0.1
    # give glibc's freed heap back to the OS every this many steps (0: never): batches of different
    # shapes leave its arenas fragmented, and the resident set grows step after step without it
    trim_every: int = 10
    curve_offset: int = 0  # added to step numbers in the curves (a later stage continues an earlier one's)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup < 0 or self.eval_every < 0 or self.checkpoint_every < 0:
            raise ValueError("warmup, eval_every and checkpoint_every must be >= 0")


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    train_curve: list[tuple[int, float]] = field(default_factory=list)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0  # time spent in the loop, over every resumed run

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "train_curve": self.train_curve, "val_curve": self.val_curve,
                "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoopState:
        return cls(int(d["step"]), [tuple(x) for x in d["train_curve"]], [tuple(x) for x in d["val_curve"]],
                   float(d["seconds"]))


class TrainLoop(Generic[B]):
    """Runs optimizer steps `state.step .. cfg.steps - 1`.

    next_batch(step) -> batch; loss_fn(batch) -> (scalar loss, short text for the progress bar);
    eval_fn(step) -> validation loss (printed by the caller as it likes); checkpoint_fn(state) saves
    whatever a resumed run needs (called after the step it names)."""

    def __init__(
        self,
        cfg: LoopConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        next_batch: Callable[[int], B],
        loss_fn: Callable[[B], tuple[torch.Tensor, str]],
        eval_fn: Callable[[int], float] | None = None,
        checkpoint_fn: Callable[[LoopState], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.next_batch = next_batch
        self.loss_fn = loss_fn
        self.eval_fn = eval_fn
        self.checkpoint_fn = checkpoint_fn
        self.autocast = cfg.bf16 and bf16_autocast_fast()  # what the forward really runs under

    # ---- the named steps ---------------------------------------------------------------------
    def set_lr(self, step: int) -> None:
        lr = lr_at(step, self.cfg.steps, self.cfg.lr, self.cfg.warmup, self.cfg.lr_floor)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)

    def train_step(self, batch: B) -> tuple[float, str]:
        self.model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss, note = self.loss_fn(batch)
        loss.backward()
        if self.cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), note

    def _due(self, step: int, every: int) -> bool:
        return step + 1 == self.cfg.steps or (every > 0 and (step + 1) % every == 0)

    def maybe_eval(self, step: int, state: LoopState) -> None:
        if self.eval_fn is not None and self._due(step, self.cfg.eval_every):
            self.model.eval()
            with torch.no_grad():
                state.val_curve.append((self.cfg.curve_offset + step, float(self.eval_fn(step))))

    def maybe_checkpoint(self, step: int, state: LoopState) -> None:
        if self.checkpoint_fn is not None and self.cfg.checkpoint_every > 0 and (step + 1) % self.cfg.checkpoint_every == 0:
            self.checkpoint_fn(state)

    def maybe_trim(self, step: int) -> None:
        """Every `trim_every` steps, the freed heap back to the OS. Measured on SmolLM2's EAGLE-3
        head (4,096-token batches, 2 threads, Intel Xeon with AMX): without it the resident set
        after a step grew from 3.8 GB at step 20 to 6.6 GB at step 120, and to 10.4 GB at step 818
        of a 6,000-prompt run; with it, 1.3-2.0 GB right after a trim and a peak between trims of
        4.4 GB over the first 50 steps, 5.9 GB over steps 250-300 (still creeping, far slower). A
        step is no slower (1.17-1.39 s against 1.24-1.49 s). A trim after every step holds the peak
        lower (3.0 GB against 4.3-4.5 GB over 50 steps) but costs 14-23 % of the step time (three
        alternating rounds: 1.04-1.12 s against 0.88-0.92 s)."""
        if self.cfg.trim_every > 0 and (step + 1) % self.cfg.trim_every == 0:
            from phalanx.models.loader import trim_heap

            trim_heap()

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, state: LoopState | None = None, progress: bool = True) -> LoopState:
        from tqdm.auto import tqdm

        state = state or LoopState()
        old_threads = torch.get_num_threads()
        torch.set_num_threads(self.cfg.threads)
        bar = tqdm(total=self.cfg.steps, initial=state.step, desc=self.cfg.desc, disable=not progress,
                   dynamic_ncols=True, mininterval=5)
        try:
            for step in range(state.step, self.cfg.steps):
                t0 = time.perf_counter()
                self.set_lr(step)
                loss, note = self.train_step(self.next_batch(step))
                state.train_curve.append((self.cfg.curve_offset + step, loss))
                state.step = step + 1
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.3f} {note}".rstrip(), refresh=False)
                self.maybe_eval(step, state)
                self.maybe_trim(step)
                state.seconds += time.perf_counter() - t0
                self.maybe_checkpoint(step, state)
        finally:
            bar.close()
            torch.set_num_threads(old_threads)
        return state


# ---- checkpoints -----------------------------------------------------------------------------
def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: LoopState,
                    extra: dict[str, Any] | None = None) -> None:
    """Model, optimizer and loop state in `path`, written to a temporary file and renamed into place."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loop": state.to_dict(),
                "extra": extra or {}}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[LoopState, dict]:
    """Restore what `save_checkpoint` wrote; returns the loop state and the extra dict."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(blob["model"])
    optimizer.load_state_dict(blob["optimizer"])
    return LoopState.from_dict(blob["loop"]), blob.get("extra", {})
