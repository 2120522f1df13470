"""What the adaptive draft-length policy measures online, and the glue the scheduler calls.

Owns: `AcceptanceStats` (each request's running acceptance per draft position, smoothed towards
the engine-wide rate), `StepCostModel` (step time against the number of rows in the step, and the
cost of one extra drafter pass, both as exponential moving averages with a prior shape until
measured), and `AdaptiveDrafting` (turns both into the inputs of `policy.choose_draft_lengths`).
Does not own: the decision itself (``spec_decode.policy``, a pure function), the per-request and
per-batch caps (``core.scheduler``), timing the step (``engine.engine_core``), or agreement across
lockstep ranks (each rank decides for its own requests; the vote sizes the drafter passes from the
gathered lengths: ``distributed.vote``).

Numpy only, no torch: the scheduler imports it.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np

from phalanx.spec_decode.policy import choose_draft_lengths, choose_draft_lengths_small

# Row-count buckets of the step-cost curve: [1, 2), [2, 3), [3, 4), [4, 6), ... up to 4096 and beyond.
_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# Up to this many candidate positions (requests x k) the policy runs in plain Python (faster than
# numpy's per-call overhead at that size), above it in numpy: the same choice either way.
SMALL_PROBLEM = 16
# Prior shape of step time against rows, used where nothing was measured: time proportional to
# rows + this (a fixed part worth this many rows: weights streamed once per step, Python overhead),
# so an extra row is cheap in a small batch and costs its share in a large one.
PRIOR_FIXED_ROWS = 16.0


class AcceptanceStats:
    """Per-request acceptance counts per draft position, decayed so that they follow the recent
    text, smoothed towards the engine-wide counts, themselves smoothed towards `prior`.

    A verification of n drafts that accepted a tests positions 1..min(a + 1, n) (position j is
    only tested when 1..j-1 were accepted) and accepts positions 1..a; the rate at position j is
    accepted_j / tested_j, the conditional acceptance the policy needs.
    """

    def __init__(
        self,
        k: int,
        prior: float = 0.6,
        prior_weight: float = 4.0,
        request_weight: float = 2.0,
        request_decay: float = 0.9,
        engine_decay: float = 0.995,
    ) -> None:
        self.k = k
        self.prior, self.prior_weight, self.request_weight = prior, prior_weight, request_weight
        self.request_decay, self.engine_decay = request_decay, engine_decay
        # Plain Python floats: a handful per verification, cheaper than numpy calls at this size.
        self.engine_tested = [0.0] * k
        self.engine_accepted = [0.0] * k
        self._counts: dict[str, tuple[list[float], list[float]]] = {}  # req_id -> (tested, accepted)

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        tested_upto = min(num_accepted + 1, num_drafts)
        tested, accepted = self._counts.setdefault(req_id, ([0.0] * self.k, [0.0] * self.k))
        d, e = self.request_decay, self.engine_decay
        for j in range(self.k):
            t_j, a_j = float(j < tested_upto), float(j < num_accepted)
            tested[j] = tested[j] * d + t_j
            accepted[j] = accepted[j] * d + a_j
            self.engine_tested[j] = self.engine_tested[j] * e + t_j
            self.engine_accepted[j] = self.engine_accepted[j] * e + a_j

    def forget(self, req_id: str) -> None:
        self._counts.pop(req_id, None)

    def engine_rates(self) -> list[float]:  # [k]
        w, p = self.prior_weight, self.prior
        return [(a + w * p) / (t + w) for t, a in zip(self.engine_tested, self.engine_accepted)]

    def rates_of(self, req_id: str, base: list[float] | None = None) -> list[float]:  # [k]
        """One request's conditional acceptance per position (`base`: the engine-wide rates)."""
        base = self.engine_rates() if base is None else base
        counts = self._counts.get(req_id)
        if counts is None:
            return base
        w = self.request_weight
        return [(a + w * b) / (t + w) for t, a, b in zip(counts[0], counts[1], base)]

    def rates(self, req_ids: list[str]) -> np.ndarray:  # [R, k] conditional acceptance per position
        base = self.engine_rates()
        rows = [self.rates_of(r, base) for r in req_ids]
        return np.array(rows, dtype=np.float64).reshape(len(req_ids), self.k)


class StepCostModel:
    """Step time against the rows in the step's target forward, and the time of one drafter pass.

    Each row-count bucket keeps an exponential moving average of the rows and of the step time
    (without the drafter's passes after the first); the curve interpolates between measured
    buckets, extrapolates along the nearest measured segment (upwards at least along the prior
    shape time ~ rows + PRIOR_FIXED_ROWS), and is made non-decreasing. With one bucket measured
    (usually a prompt's step) it is flat below it — no saving from fewer rows is assumed before one
    is seen — and follows the prior shape above it. The pass cost is
    the average drafter time per pass over steps without a prefill chunk (a prompt's catch-up would
    make pass 1 look expensive).
    """

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._rows: list[float | None] = [None] * len(_EDGES)  # EMA of the rows of steps in each bucket
        self._time = [0.0] * len(_EDGES)  # EMA of their time
        self.pass_cost = 0.0
        self._pass_seen = False
        # The curve as it stands (rebuilt after each step): measured rows ascending, their times
        # made non-decreasing, the slopes below / above them, the floor below.
        self._xs: list[float] = []
        self._ys: list[float] = []
        self._lo_slope = self._hi_slope = self._floor = 0.0

    @property
    def measured(self) -> bool:
        return bool(self._xs)

    def observe(self, num_rows: int, seconds: float, drafter_seconds: float, drafter_passes: int,
                decode_only: bool) -> None:
        """One step: `num_rows` through the target forward, `seconds` for the whole step, of which
        `drafter_seconds` in `drafter_passes` drafter passes."""
        if num_rows <= 0 or seconds <= 0:
            return
        extra = drafter_seconds * (drafter_passes - 1) / drafter_passes if drafter_passes > 1 else 0.0
        b = bisect.bisect_right(_EDGES, num_rows) - 1
        rows = self._rows[b]
        if rows is not None:
            self._rows[b] = rows + self.alpha * (num_rows - rows)
            self._time[b] += self.alpha * (seconds - extra - self._time[b])
        else:
            self._rows[b], self._time[b] = float(num_rows), seconds - extra
        if decode_only and drafter_passes > 0:
            per_pass = drafter_seconds / drafter_passes
            self.pass_cost = per_pass if not self._pass_seen else self.pass_cost + self.alpha * (per_pass - self.pass_cost)
            self._pass_seen = True
        self._rebuild()

    def _rebuild(self) -> None:
        xs = [x for x in self._rows if x is not None]  # ascending: the buckets are ordered
        ys = list(itertools.accumulate((max(t, 1e-9) for x, t in zip(self._rows, self._time) if x is not None), max))
        self._xs, self._ys = xs, ys  # more rows never take less time (running maximum)
        if len(xs) > 1:
            self._lo_slope = (ys[1] - ys[0]) / max(xs[1] - xs[0], 1e-9)
            self._hi_slope = max((ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-9), ys[-1] / (xs[-1] + PRIOR_FIXED_ROWS))
        self._floor = ys[0] * PRIOR_FIXED_ROWS / (xs[0] + PRIOR_FIXED_ROWS)  # the prior's fixed part

    def cost_at(self, rows: float) -> float:
        """Predicted seconds of a step of `rows` rows (plain Python: a few points at a time)."""
        assert self.measured, "no step measured yet"
        xs, ys = self._xs, self._ys
        if len(xs) == 1:  # fewer rows: no saving assumed; more rows: the prior shape
            return ys[0] * max(rows + PRIOR_FIXED_ROWS, xs[0] + PRIOR_FIXED_ROWS) / (xs[0] + PRIOR_FIXED_ROWS)
        if rows < xs[0]:
            return max(ys[0] + self._lo_slope * (rows - xs[0]), self._floor)
        if rows > xs[-1]:
            return ys[-1] + self._hi_slope * (rows - xs[-1])
        i = min(bisect.bisect_right(xs, rows) - 1, len(xs) - 2)
        return ys[i] + (ys[i + 1] - ys[i]) * (rows - xs[i]) / (xs[i + 1] - xs[i])

    def step_cost(self, rows: np.ndarray) -> np.ndarray:  # [n] rows -> [n] predicted seconds
        """`cost_at` for many rows at once."""
        assert self.measured, "no step measured yet"
        xs, ys = np.asarray(self._xs), np.asarray(self._ys)  # [b]
        rows = np.asarray(rows, dtype=np.float64)
        if xs.shape[0] == 1:
            return ys[0] * np.maximum(rows + PRIOR_FIXED_ROWS, xs[0] + PRIOR_FIXED_ROWS) / (xs[0] + PRIOR_FIXED_ROWS)
        out = np.interp(rows, xs, ys)
        out = np.where(rows < xs[0], np.maximum(ys[0] + self._lo_slope * (rows - xs[0]), self._floor), out)
        return np.where(rows > xs[-1], ys[-1] + self._hi_slope * (rows - xs[-1]), out)


class AdaptiveDrafting:
    """The scheduler's handle on the adaptive policy: request acceptance in, step costs in, draft
    lengths out. `drafter_passes`: the drafter runs a pass per draft position (model drafters),
    so the deepest request's length costs passes; n-gram lookup does not."""

    def __init__(self, k: int, drafter_passes: bool) -> None:
        self.k = k
        self.drafter_passes = drafter_passes
        self.acceptance = AcceptanceStats(k)
        self.costs = StepCostModel()

    def choose(self, req_ids: list[str], caps: list[int], base_rows: int) -> list[int]:
        """Draft lengths for the requests that reach their end this step (verified next step, in
        a batch of about `base_rows` rows besides the drafts). Before any step was measured every
        request gets its cap (static drafting), which is also what gives the first measurements."""
        if not req_ids or not self.costs.measured or max(caps, default=0) == 0:
            return list(caps)
        pass_cost = self.costs.pass_cost if self.drafter_passes else 0.0
        if len(req_ids) * self.k <= SMALL_PROBLEM:  # low concurrency: short steps, no numpy
            caps = [min(c, self.k) for c in caps]
            step_cost = [self.costs.cost_at(base_rows + m) for m in range(sum(caps) + 1)]
            base = self.acceptance.engine_rates()
            rates = [self.acceptance.rates_of(r, base) for r in req_ids]
            return choose_draft_lengths_small(rates, caps, step_cost, pass_cost)
        caps_arr = np.minimum(np.asarray(caps, dtype=np.int64), self.k)
        step_cost = self.costs.step_cost(base_rows + np.arange(int(caps_arr.sum()) + 1))
        return choose_draft_lengths(self.acceptance.rates(req_ids), caps_arr, step_cost, pass_cost).tolist()

    def observe_verification(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.observe(req_id, num_drafts, num_accepted)

    def observe_step(self, num_rows: int, seconds: float, drafter_seconds: float, drafter_passes: int,
                     decode_only: bool) -> None:
        self.costs.observe(num_rows, seconds, drafter_seconds, drafter_passes, decode_only)

    def forget(self, req_id: str) -> None:
        self.acceptance.forget(req_id)
