"""EAGLE's training objective, with the training-time test: several drafting passes at once.

Owns: `EagleBatch` (one padded batch of teacher-forced target features), `Objective` (the loss:
feature regression + token cross-entropy, summed over `passes` unrolled drafting passes with
weights decaying by `pass_decay`), and the per-pass statistics (cross-entropy and top-1 agreement
with the target, and `chain_acceptance`: what the engine's greedy chain drafting would accept on the
batch, the estimate of its acceptance that the trainer reports).
Does not own: the head's forward (``training.head.EagleHead.unrolled``) or where batches come from
(``training.features``).

Pass 0 at position t sees the target's feature at t and the token x_{t+1} and predicts x_{t+2};
pass j (the head's (j+1)-th draft) takes as feature its own pass j-1 output at t-1, exactly what
drafting feeds it, and sees the target's keys up to t-j plus its own chain's (see `unrolled`).
Its label is the target's greedy token at the same place, so its top-1 agreement estimates the
chance that draft j+1 is accepted given drafts 1..j were.

Loss per pass: smooth-L1 of the head's output (EAGLE-3: its normed output, which its lm_head, started
from the target's rows, turns into logits) on the target's final hidden state at t+1, plus
`ce_weight` x cross-entropy against hard labels (the target's greedy token) or soft labels (the
target's distribution over the head's vocabulary: its final hidden state times the target's lm_head
rows of that vocabulary).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from phalanx.training.head import EagleHead

IGNORE = -100


@dataclass(frozen=True)
class EagleBatch:
    tokens: torch.Tensor  # [B, T] int64: the token fed at position t (x_{t+1})
    features: torch.Tensor  # [B, T, F] the target's feature at t (EAGLE-3: its three aux layers, unfused)
    next_final: torch.Tensor  # [B, T, H] the target's final normed hidden state at t + 1
    labels: torch.Tensor  # [B, T] int64 target token id to predict at t (x_{t+2}); IGNORE: no loss
    positions: torch.Tensor  # [B, T] int64
    # [B] int64: the position of each sequence's first drafting chain in the engine, the one fed the
    # first answer token (answer_start - 1); None: each row's first labelled position
    first_draft: torch.Tensor | None = None

    @property
    def num_labels(self) -> int:
        return int((self.labels != IGNORE).sum())


@dataclass
class PassStats:
    """Sums over the labelled positions of one pass (add batches, then read the means)."""

    ce: float = 0.0  # hard-label cross-entropy, summed over the positions the head can draft
    ce_count: int = 0
    correct: int = 0  # top-1 equal to the target's token
    count: int = 0  # every labelled position (a token the head cannot draft is a miss)

    def add(self, other: PassStats) -> None:
        self.ce += other.ce
        self.ce_count += other.ce_count
        self.correct += other.correct
        self.count += other.count

    @property
    def mean_ce(self) -> float:
        return self.ce / max(1, self.ce_count)

    @property
    def accuracy(self) -> float:
        return self.correct / max(1, self.count)


@dataclass
class LossStats:
    passes: list[PassStats] = field(default_factory=list)
    loss_sum: float = 0.0
    batches: int = 0
    chain_steps: int = 0  # verification steps of the simulated chain drafting (`chain_acceptance`)
    chain_accepted: list[int] = field(default_factory=list)  # drafts accepted at each chain position

    def add(self, other: LossStats) -> None:
        if not self.passes:
            self.passes = [PassStats() for _ in other.passes]
        for a, b in zip(self.passes, other.passes, strict=True):
            a.add(b)
        self.loss_sum += other.loss_sum
        self.batches += other.batches
        self.chain_steps += other.chain_steps
        self.chain_accepted = [a + b for a, b in itertools.zip_longest(self.chain_accepted, other.chain_accepted,
                                                                        fillvalue=0)]

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.batches)

    @property
    def accuracies(self) -> list[float]:
        return [p.accuracy for p in self.passes]

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / max(1, self.chain_steps) for a in self.chain_accepted]

    @property
    def acceptance_length(self) -> float:
        """1 + accepted drafts per verification step of the simulated chain drafting."""
        return 1.0 + sum(self.chain_accepted) / max(1, self.chain_steps)

    def summary(self) -> dict:
        out = {"loss": round(self.loss, 5), "ce": [round(p.mean_ce, 4) for p in self.passes],
               "acc": [round(p.accuracy, 4) for p in self.passes],
               "expected_acceptance_length": round(expected_acceptance_length(self.accuracies), 3)}
        if self.chain_steps:
            out["acceptance_length"] = round(self.acceptance_length, 3)
            out["acceptance_per_position"] = [round(a, 4) for a in self.acceptance_per_position]
        return out


def expected_acceptance_length(accuracies: list[float]) -> float:
    """1 + a1 + a1 a2 + ...: the mean tokens per verification step when draft j is accepted with
    probability a_j given the earlier ones were (k = len(accuracies)). An optimistic estimate: the
    a_j are averages over every position, while the engine drafts most often where drafts fail (a
    chain starts right after each rejected draft); `chain_acceptance` follows the engine's chains."""
    total, run = 1.0, 1.0
    for a in accuracies:
        run *= a
        total += run
    return total


def chain_acceptance(hits: list[torch.Tensor], labelled: torch.Tensor,
                     first: torch.Tensor | None = None) -> tuple[int, list[int]]:
    """What greedy chain drafting of k = len(hits) tokens accepts over a teacher-forced batch.

    hits[j] [B, T] bool: pass j at position t drafted the target's token (pass j at t continues the
    chain that pass 0 started at t - j, as `EagleHead.unrolled` computes it); labelled [B, T]: the
    positions with a label; first [B]: where each row's first chain starts (None: its first labelled
    position). Like the engine, a chain starting at s accepts drafts while they hit (pass j at s + j),
    and the next one starts after the accepted drafts and the target's own token. Returns (chains,
    accepted drafts at each chain position), which the engine reports as its verification steps and
    per-position acceptance (on the same sequences they agree: 2.222 simulated vs 2.218 served for
    SmolLM2's head on 32 held-out answers, where the per-pass accuracies' product says 2.321)."""
    k = len(hits)
    ok = [(h & labelled).cpu().numpy() for h in hits]
    lab = labelled.cpu().numpy()
    steps, accepted = 0, [0] * k
    B, T = lab.shape
    for b in range(B):
        labelled_at = np.flatnonzero(lab[b])
        if not len(labelled_at):
            continue
        s = int(first[b]) if first is not None else int(labelled_at[0])
        while 0 <= s < T and lab[b, s]:
            a = 0
            while a < k and s + a < T and ok[a][b, s + a]:
                accepted[a] += 1
                a += 1
            steps += 1
            s += a + 1
    return steps, accepted


class _SoftCrossEntropy(torch.autograd.Function):
    """sum over rows of -sum_v teacher[v] log softmax(logits)[v], for teacher rows that are
    probability distributions: logsumexp(logits) - teacher . logits per row, whose gradient is
    softmax(logits) - teacher. As one function, a piece of `CHUNK_ROWS` rows at a time (its float32
    copy stays in cache), it reads the [rows, vocab] logits once forward and once backward, where
    log_softmax, the product and the sum with their autograd copies made about a dozen passes
    over them in memory; at 4,096 rows of a 3,584-token vocabulary that was a fifth of a training
    step."""

    CHUNK_ROWS = 128

    @staticmethod
    def forward(ctx, logits, teacher):  # noqa: ANN001, ANN205
        n, step = logits.shape[0], _SoftCrossEntropy.CHUNK_ROWS
        lse = torch.empty(n)
        loss = torch.zeros(())
        with torch.autocast("cpu", enabled=False):
            for a in range(0, n, step):
                z = logits[a : a + step].float()
                piece = torch.logsumexp(z, dim=-1)
                lse[a : a + step] = piece
                loss += piece.sum() - torch.dot(teacher[a : a + step].reshape(-1).float(), z.reshape(-1))
        ctx.save_for_backward(logits, teacher, lse)
        return loss

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        logits, teacher, lse = ctx.saved_tensors
        out = torch.empty_like(logits)
        step = _SoftCrossEntropy.CHUNK_ROWS
        with torch.autocast("cpu", enabled=False):
            for a in range(0, logits.shape[0], step):
                rows = slice(a, a + step)
                out[rows] = logits[rows].float().sub_(lse[rows, None]).exp_().sub_(teacher[rows]).mul_(grad)
        return out, None


def soft_cross_entropy(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of `logits` [n, V] (any float dtype) against the distributions
    `teacher` [n, V] (float32, rows summing to 1); equal to -(teacher * log_softmax(logits)).sum()."""
    return _SoftCrossEntropy.apply(logits, teacher)


@dataclass(frozen=True)
class Objective:
    passes: int = 3  # drafting passes unrolled in training (the k the head is trained for)
    labels: str = "soft"  # "soft": the target's distribution; "hard": its greedy token
    ce_weight: float = 0.5
    pass_decay: float = 0.8

    def __post_init__(self) -> None:
        if self.passes < 1:
            raise ValueError(f"passes must be >= 1, got {self.passes}")
        if self.labels not in ("soft", "hard"):
            raise ValueError(f"labels must be 'soft' or 'hard', got {self.labels!r}")

    def __call__(self, head: EagleHead, batch: EagleBatch, teacher_rows: torch.Tensor | None = None,
                 target_to_draft: torch.Tensor | None = None, with_stats: bool = True
                 ) -> tuple[torch.Tensor, LossStats]:
        """The weighted loss over all passes and its statistics (`with_stats=False`: the loss alone;
        the statistics' argmax and hard-label cross-entropy are two more passes over the logits).

        teacher_rows [V_head, H]: the target's lm_head rows of the head's vocabulary (soft labels);
        target_to_draft [V]: draft id of each target id, IGNORE where the head cannot draft it
        (EAGLE-3's reduced vocabulary; None: the head's vocabulary is the target's).
        """
        labels = batch.labels
        if target_to_draft is not None:  # target ids -> the head's ids (IGNORE outside its vocabulary)
            labels = torch.where(labels >= 0, target_to_draft[labels.clamp(min=0)], labels)
        outs = head.unrolled(batch.tokens, head.fuse(batch.features), batch.positions, self.passes)
        # The logits and losses are taken at labelled positions only (prompt and padding positions
        # feed the attention but learn nothing): rows of the flattened [B * T] grid.
        B, T = batch.labels.shape
        rows = torch.nonzero(batch.labels.reshape(-1) != IGNORE).flatten()  # [N]
        t_of_row = rows % T  # position of each row in its sequence
        target_final = batch.next_final.reshape(B * T, -1)[rows].float()  # [N, H]
        lab_rows = labels.reshape(-1)[rows]  # [N] the head's ids (IGNORE: not draftable)
        teacher = None
        if self.labels == "soft":
            assert teacher_rows is not None, "soft labels need the target's lm_head rows"
            with torch.no_grad():
                teacher = torch.softmax(target_final @ teacher_rows.float().t(), dim=-1)  # [N, V_head]
        weights = [self.pass_decay ** j for j in range(self.passes)]
        hit_grids: list[torch.Tensor] = []
        total = torch.zeros(())
        stats = LossStats(batches=1)
        for j, pre in enumerate(outs):
            sub = t_of_row >= j  # pass j needs a chain that starts at t - j >= 0
            n = int(sub.sum())
            pre_j = pre.reshape(B * T, -1)[rows[sub]]  # [n, H]
            lab = lab_rows[sub]
            logits = head.logits(pre_j)  # [n, V_head]
            if teacher is not None:
                token_loss = soft_cross_entropy(logits, teacher if n == len(rows) else teacher[sub]) / max(n, 1)
            else:
                token_loss = F.cross_entropy(logits.float(), lab, ignore_index=IGNORE) if n else logits.sum() * 0
            out = head.norm(pre_j) if head.eagle3 else pre_j
            reg = F.smooth_l1_loss(out.float(), target_final[sub], reduction="sum") / max(n * pre.shape[-1], 1)
            total = total + weights[j] * (reg + self.ce_weight * token_loss)
            if with_stats:
                with torch.no_grad():
                    hard_ce = F.cross_entropy(logits.float(), lab, ignore_index=IGNORE, reduction="sum")
                    hit = (logits.argmax(-1) == lab) & (lab != IGNORE)
                # positions whose target token the head cannot draft count as misses (not as skipped)
                stats.passes.append(PassStats(ce=float(hard_ce), ce_count=int((lab != IGNORE).sum()),
                                              correct=int(hit.sum()), count=n))
                grid = torch.zeros(B * T, dtype=torch.bool)
                grid[rows[sub]] = hit
                hit_grids.append(grid.reshape(B, T))
        loss = total / sum(weights)
        stats.loss_sum = float(loss.detach())
        if with_stats:
            stats.chain_steps, stats.chain_accepted = chain_acceptance(
                hit_grids, batch.labels != IGNORE, batch.first_draft)
        return loss, stats
