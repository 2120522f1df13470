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

import numpy as np

from phalanx.spec_decode.policy import choose_draft_lengths

# Row-count buckets of the step-cost curve: [1, 2), [2, 3), [3, 4), [4, 6), ... up to 4096 and beyond.
_EDGES = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
                   3072, 4096], dtype=np.float64)  # fmt: skip
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
        self.engine_tested = np.zeros(k)  # [k]
        self.engine_accepted = np.zeros(k)  # [k]
        self._tested: dict[str, np.ndarray] = {}  # req_id -> [k]
        self._accepted: dict[str, np.ndarray] = {}  # req_id -> [k]

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        tested = np.arange(self.k) < min(num_accepted + 1, num_drafts)  # [k]
        accepted = np.arange(self.k) < num_accepted  # [k]
        t = self._tested.setdefault(req_id, np.zeros(self.k))
        a = self._accepted.setdefault(req_id, np.zeros(self.k))
        t *= self.request_decay
        a *= self.request_decay
        t += tested
        a += accepted
        self.engine_tested = self.engine_tested * self.engine_decay + tested
        self.engine_accepted = self.engine_accepted * self.engine_decay + accepted

    def forget(self, req_id: str) -> None:
        self._tested.pop(req_id, None)
        self._accepted.pop(req_id, None)

    def engine_rates(self) -> np.ndarray:  # [k]
        w = self.prior_weight
        return (self.engine_accepted + w * self.prior) / (self.engine_tested + w)

    def rates(self, req_ids: list[str]) -> np.ndarray:  # [R, k] conditional acceptance per position
        base = self.engine_rates()  # [k]
        w = self.request_weight
        zeros = np.zeros(self.k)
        tested = np.stack([self._tested.get(r, zeros) for r in req_ids]) if req_ids else np.zeros((0, self.k))
        accepted = np.stack([self._accepted.get(r, zeros) for r in req_ids]) if req_ids else np.zeros((0, self.k))
        return (accepted + w * base[None, :]) / (tested + w)  # [R, k]


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
        self._rows = np.zeros(len(_EDGES))  # [B] EMA of the rows of steps in each bucket
        self._time = np.zeros(len(_EDGES))  # [B] EMA of their time
        self._seen = np.zeros(len(_EDGES), dtype=bool)  # [B]
        self.pass_cost = 0.0
        self._pass_seen = False

    @property
    def measured(self) -> bool:
        return bool(self._seen.any())

    def observe(self, num_rows: int, seconds: float, drafter_seconds: float, drafter_passes: int,
                decode_only: bool) -> None:
        """One step: `num_rows` through the target forward, `seconds` for the whole step, of which
        `drafter_seconds` in `drafter_passes` drafter passes."""
        if num_rows <= 0 or seconds <= 0:
            return
        extra = drafter_seconds * (drafter_passes - 1) / drafter_passes if drafter_passes > 1 else 0.0
        b = int(np.searchsorted(_EDGES, num_rows, side="right")) - 1
        if self._seen[b]:
            self._rows[b] += self.alpha * (num_rows - self._rows[b])
            self._time[b] += self.alpha * (seconds - extra - self._time[b])
        else:
            self._rows[b], self._time[b], self._seen[b] = num_rows, seconds - extra, True
        if decode_only and drafter_passes > 0:
            per_pass = drafter_seconds / drafter_passes
            self.pass_cost = per_pass if not self._pass_seen else self.pass_cost + self.alpha * (per_pass - self.pass_cost)
            self._pass_seen = True

    def step_cost(self, rows: np.ndarray) -> np.ndarray:  # [n] rows -> [n] predicted seconds
        assert self.measured, "no step measured yet"
        xs, ys = self._rows[self._seen], self._time[self._seen]  # [b] ascending rows (buckets are ordered)
        ys = np.maximum.accumulate(np.maximum(ys, 1e-9))  # more rows never take less time
        rows = np.asarray(rows, dtype=np.float64)
        if xs.shape[0] == 1:  # fewer rows: no saving assumed; more rows: the prior shape
            return ys[0] * np.maximum(rows + PRIOR_FIXED_ROWS, xs[0] + PRIOR_FIXED_ROWS) / (xs[0] + PRIOR_FIXED_ROWS)
        out = np.interp(rows, xs, ys)
        lo_slope = (ys[1] - ys[0]) / max(xs[1] - xs[0], 1e-9)
        hi_slope = max((ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-9), ys[-1] / (xs[-1] + PRIOR_FIXED_ROWS))
        floor = ys[0] * PRIOR_FIXED_ROWS / (xs[0] + PRIOR_FIXED_ROWS)  # the prior's fixed part
        out = np.where(rows < xs[0], np.maximum(ys[0] + lo_slope * (rows - xs[0]), floor), out)
        return np.where(rows > xs[-1], ys[-1] + hi_slope * (rows - xs[-1]), out)


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
        caps_arr = np.minimum(np.asarray(caps, dtype=np.int64), self.k)
        step_cost = self.costs.step_cost(base_rows + np.arange(int(caps_arr.sum()) + 1))
        pass_cost = self.costs.pass_cost if self.drafter_passes else 0.0
        return choose_draft_lengths(self.acceptance.rates(req_ids), caps_arr, step_cost, pass_cost).tolist()

    def observe_verification(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.observe(req_id, num_drafts, num_accepted)

    def observe_step(self, num_rows: int, seconds: float, drafter_seconds: float, drafter_passes: int,
                     decode_only: bool) -> None:
        self.costs.observe(num_rows, seconds, drafter_seconds, drafter_passes, decode_only)

    def forget(self, req_id: str) -> None:
        self.acceptance.forget(req_id)
