"""Training batches from the feature shards, streamed with bounded memory.

Owns: `FeatureShards` (the shards of one split: each sequence's length read from the shard headers
without loading the features), `epoch_plan` (which sequences form which batch in an epoch: a pure
function of the seed, the epoch and the lengths, so a resumed run sees the same batches), and
`BatchStream` (batch `step` of the whole run, loading only the shards of the current window and
dropping the rest) with `make_batch` (sequences -> a padded `EagleBatch`).
Does not own: writing shards (``training.distill``) or the loss (``training.objective``).

Memory: an epoch walks the shards in a shuffled order, `window` shards at a time; within a window
the sequences are shuffled, grouped by length into batches of at most `batch_tokens` padded tokens
(little padding), and the batches shuffled. At most one window of shards is in memory.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx.training.objective import IGNORE, EagleBatch

SeqRef = tuple[int, int]  # (shard, sequence within the shard)


@dataclass(frozen=True)
class FeatureShards:
    paths: list[Path]
    lengths: list[list[int]]  # per shard, each sequence's token count

    @classmethod
    def open(cls, paths: list[Path]) -> FeatureShards:
        from safetensors import safe_open

        lengths = []
        for p in paths:
            with safe_open(str(p), "pt") as f:
                off = f.get_tensor("offsets")
            lengths.append((off[1:] - off[:-1]).tolist())
        return cls(list(paths), lengths)

    @property
    def num_sequences(self) -> int:
        return sum(len(x) for x in self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(sum(x) for x in self.lengths)


@dataclass(frozen=True)
class PlannedBatch:
    window: tuple[int, ...]  # the shards loaded while this batch's window is being read
    refs: list[SeqRef]


def epoch_plan(shards: FeatureShards, batch_tokens: int, window: int, seed: int, epoch: int,
               max_len: int) -> list[PlannedBatch]:
    """The batches of one epoch, in order (see the module docstring). A batch's padded size
    (sequences x longest, each cut to `max_len`) stays within `batch_tokens`; a sequence longer than
    that is a batch of its own."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(shards.paths)))
    rng.shuffle(order)
    batches: list[PlannedBatch] = []
    for w in range(0, len(order), window):
        win = tuple(order[w:w + window])
        items = [(s, j) for s in win for j in range(len(shards.lengths[s]))]
        rng.shuffle(items)
        items.sort(key=lambda r: min(shards.lengths[r[0]][r[1]], max_len))  # stable: shuffled among equals
        group: list[list[SeqRef]] = []
        cur: list[SeqRef] = []
        for r in items:
            n = min(shards.lengths[r[0]][r[1]], max_len)
            if cur and (len(cur) + 1) * n > batch_tokens:  # items are sorted: n is the longest so far
                group.append(cur)
                cur = []
            cur.append(r)
        if cur:
            group.append(cur)
        rng.shuffle(group)
        batches.extend(PlannedBatch(win, refs) for refs in group)
    return batches


def steps_per_epoch(shards: FeatureShards, batch_tokens: int, window: int, seed: int, max_len: int) -> int:
    return len(epoch_plan(shards, batch_tokens, window, seed, 0, max_len))


class BatchStream:
    """`batch(step)` for steps 0, 1, 2, ... (any start: epochs are planned from the lengths alone)."""

    def __init__(self, shards: FeatureShards, batch_tokens: int, window: int, seed: int, max_len: int,
                 aux: bool) -> None:
        self.shards = shards
        self.batch_tokens, self.window, self.seed, self.max_len, self.aux = batch_tokens, window, seed, max_len, aux
        self._plans: dict[int, list[PlannedBatch]] = {}
        self._loaded: dict[int, dict[str, torch.Tensor]] = {}

    def _plan(self, epoch: int) -> list[PlannedBatch]:
        if epoch not in self._plans:
            self._plans[epoch] = epoch_plan(self.shards, self.batch_tokens, self.window, self.seed, epoch, self.max_len)
        return self._plans[epoch]

    def planned(self, step: int) -> PlannedBatch:
        epoch, i = 0, step
        while i >= len(self._plan(epoch)):
            i -= len(self._plan(epoch))
            epoch += 1
        return self._plan(epoch)[i]

    def batch(self, step: int) -> EagleBatch:
        from safetensors.torch import load_file

        pb = self.planned(step)
        for s in [s for s in self._loaded if s not in pb.window]:
            del self._loaded[s]  # the window moved on: at most one window in memory
        seqs = []
        for s, j in pb.refs:
            if s not in self._loaded:
                self._loaded[s] = load_file(str(self.shards.paths[s]))
            seqs.append(sequence(self._loaded[s], j, self.aux, self.max_len))
        return make_batch(seqs)


@dataclass(frozen=True)
class Sequence:
    tokens: torch.Tensor  # [n] int64
    greedy: torch.Tensor  # [n] int64: the target's argmax at each position
    final: torch.Tensor  # [n, H]
    features: torch.Tensor  # [n, F]: EAGLE-3's aux layers, EAGLE-1's final hidden state
    answer_start: int


def sequence(shard: dict[str, torch.Tensor], j: int, aux: bool, max_len: int) -> Sequence:
    a, b = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
    b = min(b, a + max_len)
    final = shard["final"][a:b]
    return Sequence(
        tokens=shard["tokens"][a:b].long(),
        greedy=shard["greedy"][a:b].long(),
        final=final,
        features=shard["aux"][a:b] if aux else final,
        answer_start=int(shard["answer_start"][j]),
    )


def make_batch(seqs: list[Sequence]) -> EagleBatch:
    """Sequences -> one padded batch. Position t (0 <= t <= n - 2) is fed token x_{t+1} with the
    target's feature at t and learns the target's greedy token at t + 1 (its x_{t+2}) where that
    token is an answer token and not past the end (t + 2 <= n - 1).
    [prompt p0 p1 | answer a0 a1 a2] (n = 5, answer_start 2): labels at t = 0, 1, 2 (a0, a1, a2).
    The engine's first drafting chain starts at t = answer_start - 1 (fed a0, which the target
    itself answered the prompt with): the batch's `first_draft`."""
    L = max(len(s.tokens) for s in seqs) - 1
    B = len(seqs)
    H = seqs[0].final.shape[-1]
    F_ = seqs[0].features.shape[-1]
    tokens = torch.zeros(B, L, dtype=torch.int64)
    features = torch.zeros(B, L, F_)
    next_final = torch.zeros(B, L, H)
    labels = torch.full((B, L), IGNORE, dtype=torch.int64)
    for b, s in enumerate(seqs):
        n = len(s.tokens)
        tokens[b, :n - 1] = s.tokens[1:]
        features[b, :n - 1] = s.features[:n - 1].float()
        next_final[b, :n - 1] = s.final[1:].float()
        lab = s.greedy[1:n - 1].clone()  # label at t is greedy[t + 1], t = 0 .. n - 3
        lab[: max(0, s.answer_start - 2)] = IGNORE  # only where x_{t+2} is an answer token
        labels[b, :n - 2] = lab
    positions = torch.arange(L)[None].expand(B, L)
    first_draft = torch.tensor([max(0, s.answer_start - 1) for s in seqs], dtype=torch.int64)
    return EagleBatch(tokens, features, next_final, labels, positions, first_draft)
