"""What the adaptive draft-length policy measures online, and the glue the scheduler calls.

Owns: `AcceptanceStats` (each request's running acceptance per draft position, smoothed towards
the engine-wide rate), `StepCostModel` (step time against the rows in the step and its drafter
passes: a local weighted least-squares fit over the recent steps, the target's part on a shape
profiled at start-up where the engine measured one), and `AdaptiveDrafting` (turns both into the
inputs of `policy.choose_draft_lengths`).
Does not own: the decision itself (``spec_decode.policy``, a pure function), the per-request and
per-batch caps (``core.scheduler``), timing the step (``engine.engine_core``), or agreement across
lockstep ranks (each rank decides for its own requests; the vote sizes the drafter passes from the
gathered lengths: ``distributed.vote``).

Numpy only, no torch: the scheduler imports it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from phalanx.spec_decode.policy import (
    choose_draft_lengths,
    choose_draft_lengths_small,
    prefer_uniform,
    step_rate,
    uniform_rates,
)

# Up to this many candidate positions (requests x k) the policy runs in plain Python, above it in
# numpy: the same choice either way. Measured between forward passes (where the scheduler runs:
# caches cold, each numpy call's first touch costs tens of microseconds), plain Python is the
# faster up to ~190 positions (R = 64, k = 3: 0.39 ms either way; R = 16: 0.15 ms vs 0.35).
SMALL_PROBLEM = 128
# Every this many decisions one request gets one draft more than the policy chose (one more row,
# and one more drafter pass when it was among the deepest), so that the next row's and the next
# pass's costs keep being measured: a policy settled on one pass would otherwise never see what a
# second costs, and would keep the prior's (an upper bound) for good.
EXPLORE_EVERY = 16
# An exploration the model predicts to cost more than this share of the step's tokens per second
# (the row crosses an edge of the GEMM's row tiles: on AMX the 33rd row of a batch costs ~14 % of a
# 32-row forward, or the request it drafts for must first feed its drafter a long wait: the demo
# at four requests, half of them not drafting, spent ~1 % of its time on catch-ups of ~100
# positions for one draft each) runs only every COSTLY_EXPLORE_EVERY decisions: it still measures
# what the model may have wrong (the pass, the rest of the step), at a quarter of the rate.
EXPLORE_MARGIN = 0.95
COSTLY_EXPLORE_EVERY = 4 * EXPLORE_EVERY
# Every this many decisions every request drafts its cap, if the policy chose less and the model
# predicts that within WIDE_EXPLORE_MARGIN of the choice's tokens per second: while the policy
# drafts little, the batch at its deepest (its verification rows, every pass) is measured by
# nothing else, and the curve there rests on prompt chunks of that size (a different mix of work)
# or on the prior, which can keep a policy from drafting where it pays. Where the deep step is
# measured and clearly loses, it is not tried again until its measurement ages out of the window.
WIDE_EXPLORE_EVERY = 64
WIDE_EXPLORE_MARGIN = 0.8
# Every this many decisions (half-way between the wide explorations), where the policy drafts and
# fewer than QUIET_STEPS of the window's decode steps about this batch size verified nothing, no
# request drafts (a quiet exploration, in place of that decision's one draft more): a policy that
# drafts every step never measures the step it compares drafting with, and prices it from the
# drafting steps, along the profile's shape, with the verification's fixed cost left in it. On
# SmolLM2 (AVX512-BF16 EPYC, the mixed workload at 16 requests, drafting one for ~7 of 16 every
# step) that step was priced at 17.7-17.9 ms where it took 16.8, so drafting, a wash, looked 6 %
# better than drafting nothing. One quiet step costs what drafting gains in a step (~0.4 of one at
# one request); as rare as this, ~0.3 % where drafting pays most.
QUIET_EXPLORE_EVERY = 4 * EXPLORE_EVERY
QUIET_STEPS = 4
# A batch that reaches its ends with the same requests that may draft (a cap above 0; those that
# may not come and go freely) and base rows as the last decision keeps that decision for up to
# this many decisions in all (an exploration still comes when due): at one request the decision,
# with cold caches between forward passes, took ~32 us, ~3 % of a demo step, while the estimates
# it reads move by a verification's weight a step. Caps that fell since (requests nearing
# max_tokens lower theirs, at 16 requests on a third of the steps) keep it too while they still
# hold its lengths: the best choice among more candidates is the best among fewer that include
# it. The two corners stand for a changed batch too, near the same grid point of the step-cost
# fits (`StepCostModel.grid_point`): a request more or less moves the costs little, and a new
# request is priced at the rates the others' drafts measured. Both stand until the next
# exploration, which decides afresh: one that drafts nothing where no draft length for all is
# predicted to pay at all (with no drafts no verification moves the acceptance it read; the demo's
# mixed workload at 16 requests: ~120 us a fresh decision on ~1.6 ms steps, its batch changing
# every few steps; a marginal one, below DRAFT_MIN_GAIN but above nothing, is kept as any other:
# SmolLM2's chat at 32 requests, AVX512-BF16, k = 1 predicted +3-5 % and serving +7 %, its fresh
# decisions drafted nothing in 9 of 115 and those stood for 49 steps of 114), and one that drafts
# every cap, new requests at their caps (the demo's chat at 32 requests: a fresh decision on 9
# steps of 10, ~0.15 ms each on ~4 ms steps, where every one drafted k; at 4 requests, standing
# for this many decisions, one in four steps, 28 us a step of the ~1.55 ms, against 21 us until
# the exploration). Tried and not kept: any other decision standing for a changed batch near its
# grid point too, a new request drafting its positions whose gain reaches the smallest gain the
# decision drafted. On the demo's
# chat at 16 requests (offline) fresh decisions fell from 131 to 72 of ~600 (~0.4 % of the time),
# but the rule drafts more than a fresh decision would (it leaves out the rows' rising cost and the
# request's own): SmolLM2 at 4 requests drafted 0 in 927 decisions where the exact-batch rule
# drafted 0 in 2,695, and ran 0.972 of its tokens per second (offline, six rounds, paired).
REUSE_DECISIONS = 4
# A decision to draft every cap stands until the next exploration (above) only where the model
# predicts it to beat drafting nothing by at least this share of tokens per second; a closer one
# is kept for REUSE_DECISIONS decisions, as any other. Standing for up to EXPLORE_EVERY decisions,
# with new requests given their caps, a marginal decision is as costly as it is wrong: on the
# demo's mixed workload at 4 requests (served, half of them code-like prompts whose drafts the
# head accepts ~0.4 of the time), 9 fresh decisions to draft 3 for the one or two requests that
# might stood for 132 more steps, each ~1.8x a step without drafts, and that round ran 0.92 of
# the same server with every request opted out, where rounds without them ran 0.98-0.99.
# Where drafting every cap wins clearly (the demo's chat, 1.3-1.8x plain decoding) it still
# stands, and saves the fresh decisions it was made for.
CORNER_CLEAR_GAIN = 0.15
# Such a clear decision stands for a batch up to this many grid points of the step-cost fits
# (`StepCostModel.grid_point`, a quarter of a bandwidth apart: ~19 % of rows + PRIOR_FIXED_ROWS) from
# its own, not only at its own: a batch whose requests come and go crosses a grid point's edge
# back and forth (13 and 14 requests lie on either side of one), and each crossing decided afresh.
# The demo's chat at 16 requests on AMX (steps of ~4 ms, the batch changing every step or two):
# a third of the decisions were fresh, ~0.27 ms each against ~0.03 for a reused one, every one of
# them drafting every cap again, and adaptive ran 0.94 of the same server pinned to k = 3. A gain
# of 15 % or more does not turn into a loss one grid point away; two would reach from 16 requests
# to 29.
CORNER_GRID_REACH = 1
# Until this many of the window's steps ran the drafter (with n-gram lookup, which runs none:
# verified drafts) with their base (rows besides their drafts) within the fit's cut of the batch
# decided for (`StepCostModel.drafted_near`), every request drafts its cap (static drafting, which
# is what measures the drafter). A fit on the first one or two (the drafter catching up on whole
# prompts, every shape's first run) priced its pass at several times its cost: offline, the demo at
# four requests then drafted nothing for most of its 48 requests (190 steps where k = 3 took 136).
# And the window, not the engine's life: after a spell in which no request could
# draft (all opted out, or pinned), the window holds no drafter step, the drafting costs stand on
# priors and memories, and those can price drafting at a loss where it pays. Served, the demo's
# chat at 32 requests on AMX, run right after 1,024 opted-out requests: its first decisions priced
# every request drafting 3 at 0.61-0.68 of drafting nothing (a drafting request at 0.24 ms, ~6x
# what the steps of k = 3 measured), a clear loss by the model, so no wide exploration ran, the
# policy drafted nothing, parked ~865 of 1,024 requests, and the round ran 0.6-0.8 of k = 3's
# tokens per second, in two to three rounds of eight.
MIN_DRAFTING_STEPS = 8
# Drafting at all must beat drafting nothing by more than this share of tokens per second: the
# model's error is not symmetric. On SmolLM2 (AMX, 16 requests decoding, half of them code-like
# prompts accepting ~0.45 of first drafts) it predicted +0.3 % for one draft each for 8 requests,
# while k = 1 ran 0.94x plain decoding there: a draft's real cost carries what the model leaves out
# (the 17th row's tile costing more in a real step than in the profile, the drafter's and the
# verification's per-step Python). Where drafting pays clearly (chat at one request: +70 %) this
# changes nothing.
DRAFT_MIN_GAIN = 0.03
# A choice that gives requests different depths must beat the best uniform one (every request
# min(j, its cap)) by more than this share of tokens per second, or the uniform one is taken
# (`policy.prefer_uniform`): the costs the model leaves out of a mixed choice (catch-ups of
# requests that stop and start drafting, a pass deepened for a few, a decision that changes every
# step) are the same size as DRAFT_MIN_GAIN's error.
UNIFORM_MARGIN = 0.03
# Once the policy's decisions have drafted nothing for this many decisions in a row (explorations
# aside), a request that may draft and arrives now, at a load no lower than those decisions were
# for, is parked (`AdaptiveDrafting.parks`): it runs as if opted out for its whole life, so its
# prompt never feeds the drafter and no wait of its is kept step after step. A request that may draft but is given nothing still costs the engine those: on
# the demo model at 16 requests, half of them opted out and the rest never drafting, ~12 % of
# plain decoding's tokens per second. Two explorations' worth: the policy has looked again twice.
PARK_AFTER = 2 * EXPLORE_EVERY
# While it parks, every this many requests that may draft arrive, one is not parked (a probe): the
# probes keep the policy deciding, exploring and measuring at the load of the moment, so that when
# drafting pays again (the load falls, the text turns repetitive) the policy sees it, and the
# requests that arrive then draft. One kept running at all times instead cost more than the
# parking saved at low load: on the demo's mixed workload at 4 requests (two that may draft at a
# time), adaptive ran 0.91 of plain decoding with one, 0.98 with none, offline. Tried and not
# kept: a probe's prompt waiting for the drafter until it drafts (most probes never do). Parked at
# 16 requests the demo's steps spent 0.08 ms in the drafter instead of 0.10-0.13 (plain decoding
# 0.01), but the probes' waits then hold their prompts, an exploration of a probe is priced with
# that catch-up and runs four times less often (`COSTLY_EXPLORE_EVERY`): the probes are what
# measure while parked, and in twelve rounds at 4 requests one stayed parked for its whole round
# (0.76 of k = 3's tokens per second).
PROBE_EVERY = 8
# Batch sizes (rows) the step-time profile measures (``ModelRunner.profile_step_curve``); step time
# is taken as linear between them. The AMX GEMM takes rows 32 at a time (two 16-row tiles per load
# of the weights), so time jumps just past each multiple of 16 and most past each multiple of 32
# (SmolLM2's forward: 15.1 / 17.6 / 19.7 ms at 32 / 33 / 48 rows); both sides of each such edge are
# measured, or interpolating from 32 to 48 would price the 33rd row at ~0.3 ms instead of ~2.5.
# oneDNN's AVX512-BF16 path (no AMX) takes rows 6 at a time: SmolLM2's forward there took 13.6 /
# 14.4 / 18.8 ms at 4 / 6 / 7 rows, and 23.8 / 28.9 at 12 / 13. Every batch up to 17 rows is
# measured (the small batches where one draft more or less is the whole decision): interpolated
# from 4 to 8 rows, 4 requests verifying one draft each for two of them (6 rows) were priced at
# +3.2 ms where their forward took +0.9, and the policy drafted nothing where drafting one served
# ~1.1x the tokens a second of drafting nothing (SmolLM2, the mixed workload at 4 requests).
PROFILE_ROWS = (*range(1, 18), 24, 32, 33, 40, 48, 49, 64, 65, 96, 97, 128, 129, 192, 193, 256)
# The profile measures every grid point up to this many rows whatever it takes (decode batches of up
# to 16 requests drafting 3 each); past it, once the profile has taken its time budget, it stops at
# the next point where it may (`profile_may_stop_after`), and the curve beyond is extended (`_interp`:
# its last segment, or its upper half's slope where that is steeper). On SmolLM2 and a slow AVX2-only CPU (~6 ms a row at 16 rows) the whole grid up to 256
# rows took 10-17 s of `phalanx serve`'s start-up; there a row costs the same at any batch size, so
# the extension is what the rest of the grid would have said. On AMX the whole grid takes ~1 s.
PROFILE_MIN_ROWS = 64
# Each profiled sequence attends this many cached tokens, in blocks of its own (as served requests'
# are). Draft rows share their request's keys, so what a draft row costs against a row of its own
# sequence depends on how much a sequence's attention costs: on SmolLM2 (AMX) 32 requests verifying
# one draft each took 1.25x the time of 32 requests without, at 200 cached tokens in blocks of their
# own (1.28-1.37x in served steps of chat requests), but 1.49x at 64 tokens in blocks all sequences
# shared, what the profile measured before.
PROFILE_CONTEXT = 192
# Rows at which the profile also times the forward with its rows held k + 1 to a sequence (a
# verification's shape). What that saves against rows of their own sequences is their attention,
# smooth in the number of sequences (no tile edges: both forwards run the same GEMM rows), so a few
# points give it everywhere: linear between them, in proportion to the rows beyond. The whole grid
# measured twice took ~4.5 s of SmolLM2's start-up on an AMX VM where one grid took ~2.3.
GROUPED_PROFILE_ROWS = (16, 32, 64, 128)


# The draft scale's prior (`StepCostModel._draft_scale`: 1, what the parts say) weighs as much as
# this many whole steps' time of drafting steps' evidence.
PRIOR_DRAFTING_STEPS = 8.0
# The forward's slope on the profiled shape (`StepCostModel._forward_fit`) is shrunk towards the
# ratio of served forwards to the profile as much as this many pairs of consecutive steps whose
# shapes differ by PRIOR_FIXED_ROWS decode rows: a pair of steps of which one verifies 32 drafts
# weighs ~4 such pairs, so a few transitions move it, a spell of them sets it.
PRIOR_SCALE_PAIRS = 8.0
# ... and kept at or above this share of the profile's own slope. Served rows can cost less than
# profiled ones: the profile's sequences hold PROFILE_CONTEXT tokens, served ones often fewer (their
# attention reads less), and SmolLM2 at 32 requests with contexts of ~40-170 grew 9.4 ms with 32
# draft rows where the profile said 11.8 (slope 0.8, AVX512-BF16). Below half, a slope is noise.
LOWEST_SLOPE = 0.5
# With a profiled shape, a fit weighs every remembered step besides the local ones by its recency
# alone, together as much as this many steps: where few steps lie near a batch size (16 requests
# drafting 3 each verify 64 rows, far from a fit at 16; at 32, 128 rows), the shape's scale and the
# work around the forward were read from those few, whatever they were (prompt chunks, a spell's
# first step): served, the demo at 32 requests priced a step without drafts at 10.6 ms from a
# scale of 2.66 where such steps took ~6 ms (scale ~1.9), and drafted at a loss. Where many steps
# lie near, it changes little.
GLOBAL_STEPS = 8.0


def profile_may_stop_after(grid: list[int], i: int) -> bool:
    """Whether the profile may end at grid point i: at or past PROFILE_MIN_ROWS, and not just past a
    tile edge (r with r - 1 on the grid: the segment into it is the edge's jump, and extended it
    would price every further row at that jump)."""
    r = grid[i]
    return r >= PROFILE_MIN_ROWS and (i == 0 or grid[i - 1] != r - 1)


# A first drafter pass that feeds at least this many positions prices a catch-up (`StepFit.catch_up_row`).
# A catch-up is a bulk pass, compute-bound where the passes of a few positions a step are not: on
# SmolLM2's head on a 2-core AVX2 CPU ~0.19 ms a position fed 500 at once, where the local slope
# over steps feeding 0-4 (steady state at 8 requests, none drafting) read 0.01, and a wide
# exploration starting 510 positions of catch-up was priced at 5 ms instead of ~100.
BULK_FEED = 32
# Prior shape of step time against rows, used where nothing was measured: time proportional to
# rows + this (a fixed part worth this many rows: weights streamed once per step, Python overhead),
# so an extra row is cheap in a small batch and costs its share in a large one.
PRIOR_FIXED_ROWS = 16.0


class AcceptanceStats:
    """Per-request acceptance counts per draft position, decayed (per test of the position) so that
    they follow the recent text, each smoothed towards what the request's own earlier position and
    the engine-wide counts say.

    A verification of n drafts that accepted a tests positions 1..min(a + 1, n) (position j is
    only tested when 1..j-1 were accepted) and accepts positions 1..a; the rate at position j is
    accepted_j / tested_j, the conditional acceptance the policy needs.

    Deep positions are tested by the requests the policy chose to draft deep, the ones it expects
    to accept, so the engine-wide rate pooled over those tests says what a good request accepts
    there, not what any request does: on SmolLM2 at 32 requests the adaptive engine's pooled third
    position read 0.72-0.78 where every request drafting three accepted 0.67 of them, and a request
    without tests of its own there took the higher figure. What carries over from request to
    request is the shape of the curve: how position j's rate compares with position j - 1's, both
    measured in the same verifications (those that drafted j), where the selection lifts both alike.
    So a request's rate at position j > 1 is smoothed towards its own rate at j - 1 times that
    engine-wide ratio (`ratios`), and position 1's towards the engine's rate there; each engine-wide
    rate is smoothed towards `prior` (a ratio with nothing measured: 1).
    """

    def __init__(
        self,
        k: int,
        prior: float = 0.6,
        prior_weight: float = 4.0,
        request_weight: float = 10.0,
        request_decay: float = 0.9,
        engine_decay: float = 0.995,
    ) -> None:
        self.k = k
        self.prior, self.prior_weight, self.request_weight = prior, prior_weight, request_weight
        self.request_decay, self.engine_decay = request_decay, engine_decay
        # Plain Python floats: a handful per verification, cheaper than numpy calls at this size.
        self.engine_tested = [0.0] * k
        self.engine_accepted = [0.0] * k
        # [j] for j >= 1: position j - 1 (0-based) in the verifications that drafted position j: the
        # same tests as position j's, one position earlier (the ratio's denominator); [0] unused.
        self.engine_prev_tested = [0.0] * k
        self.engine_prev_accepted = [0.0] * k
        self._counts: dict[str, tuple[list[float], list[float]]] = {}  # req_id -> (tested, accepted)

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """Counts decay per test of their own position: a position tested rarely (a third draft, while
        the policy drafts one or two) keeps what its last tests said instead of fading to the prior
        with every verification of the first, which would keep the policy from ever drafting there."""
        self.observe_all([(req_id, num_drafts, num_accepted)])

    def observe_all(self, verified: list[tuple[str, int, int]]) -> None:
        """`observe` each (req_id, num_drafts, num_accepted) in turn: a step's verifications in one
        call (this runs every step, between forward passes)."""
        counts_of, k = self._counts, self.k
        d, e = self.request_decay, self.engine_decay
        et, ea = self.engine_tested, self.engine_accepted
        pt, pa = self.engine_prev_tested, self.engine_prev_accepted
        for req_id, num_drafts, a in verified:
            tested_upto = a + 1 if a < num_drafts else num_drafts
            counts = counts_of.get(req_id)
            if counts is None:
                counts = counts_of[req_id] = ([0.0] * k, [0.0] * k)
            tested, accepted = counts
            for j in range(tested_upto):  # (plain float updates)
                tested[j] = tested[j] * d + 1.0
                et[j] = et[j] * e + 1.0
                if j < a:
                    accepted[j] = accepted[j] * d + 1.0
                    ea[j] = ea[j] * e + 1.0
                else:
                    accepted[j] *= d
                    ea[j] *= e
            # position j - 1 where position j was drafted (and j - 1 tested: 1..j-2 accepted)
            for j in range(1, min(num_drafts, k, tested_upto + 1)):
                pt[j] = pt[j] * e + 1.0
                pa[j] = pa[j] * e + 1.0 if j - 1 < a else pa[j] * e

    def forget(self, req_id: str) -> None:
        self._counts.pop(req_id, None)

    def pooled_rates(self) -> list[float]:  # [k]
        """Per position, what the drafts tested there accepted, engine-wide (each smoothed towards
        `prior`): position 1's is every drafting request's; deeper ones are the selected requests'."""
        w, p = self.prior_weight, self.prior
        return [(a + w * p) / (t + w) for t, a in zip(self.engine_tested, self.engine_accepted)]

    def ratios(self) -> list[float]:  # [k]: [0] unused (1.0)
        """Engine-wide, per position j >= 1: the rate at j over the rate at j - 1 in the
        verifications that drafted j (each smoothed towards `prior`; nothing measured: 1)."""
        return [1.0] + self.curve()[1:]

    def curve(self) -> list[float]:  # [k]
        """What `rates_of` builds every request's rates on, computed once per decision: position
        1's engine-wide rate, then the `ratios` after it."""
        w, p = self.prior_weight, self.prior
        pooled = self.pooled_rates()
        return pooled[:1] + [pooled[j] / ((self.engine_prev_accepted[j] + w * p) / (self.engine_prev_tested[j] + w))
                             for j in range(1, self.k)]

    def engine_rates(self, curve: list[float] | None = None) -> list[float]:  # [k]
        """What a request with no counts of its own accepts per position: the engine's rate at the
        first, the ratios after it (each at most 1)."""
        return self.rates_of(None, curve)

    def rates_of(self, req_id: str | None, curve: list[float] | None = None) -> list[float]:  # [k]
        """One request's conditional acceptance per position (`curve`: `curve()`, None: computed
        here): its own counts at each position (none for an unknown request), smoothed (weight
        `request_weight`) towards its own rate at the position before times the engine-wide ratio
        there, or at position 1 towards the engine's rate."""
        curve = self.curve() if curve is None else curve
        counts = self._counts.get(req_id) if req_id is not None else None
        rw = self.request_weight
        out: list[float] = []
        rate = 1.0
        for j in range(self.k):
            base = min(rate * curve[j], 1.0)
            rate = base if counts is None else (counts[1][j] + rw * base) / (counts[0][j] + rw)
            out.append(rate)
        return out

    def rate_rows(self, req_ids: list[str], caps: list[int] | None = None) -> list[list[float]]:  # [R][k]
        """`rates_of` each request, on one `curve()`; a request whose cap is 0 (`caps`) gets zeros
        (it drafts nothing: its rates are never read)."""
        curve = self.curve()
        if caps is None:
            return [self.rates_of(r, curve) for r in req_ids]
        zeros = [0.0] * self.k
        return [self.rates_of(r, curve) if c else zeros for r, c in zip(req_ids, caps)]

    def rates(self, req_ids: list[str], caps: list[int] | None = None) -> np.ndarray:  # [R, k]
        return np.array(self.rate_rows(req_ids, caps), dtype=np.float64).reshape(len(req_ids), self.k)


class StepFit(NamedTuple):
    """Step time = fixed + per_row * (rows without logits) + per_logit_row * (rows that compute
    logits) + draft_row * (draft rows) + verify_cost * (the step verifies drafts) + first_cost * (the
    drafter ran) + pass_cost * (its passes after the first) + request_cost * (requests drafted for),
    near one batch size."""

    fixed: float
    per_row: float  # a row that computes no logits (a prompt row)
    per_logit_row: float  # a row that does (a decode or draft row): the lm_head and sampling too
    first_cost: float
    pass_cost: float
    verify_cost: float = 0.0  # what verifying any drafts costs besides their rows
    # With a profiled shape (`StepCostModel.set_profile`): the target's forward and lm_head take
    # scale * shape(rows, logit rows) plus a per-step part (in `fixed`, `_forward_fit`), and fixed
    # / per_row / per_logit_row price the rest of the step (the drafter's part, scheduling,
    # sampling). 0: no profile, the linear form above prices the forward too.
    scale: float = 0.0
    # What a waiting catch-up costs a position: the drafter's seconds per position over the recent
    # steps whose first pass fed many (`BULK_FEED`: catch-ups, prompts), at any batch size; the
    # local slope `drafter_row` where none was measured.
    catch_up_row: float = 0.0
    # What a draft row costs on top of a row that computes logits: the drafter feeds it (pass 1 a
    # request's first draft position, a later pass each deeper one).
    draft_row: float = 0.0
    # What a request that drafts at all costs besides its draft rows: the drafter's work per
    # request, and feeding it the positions its last step accepted (the local mean of those beyond
    # one a drafting request fed).
    request_cost: float = 0.0
    # With a profiled shape: what the steps that verified drafts, their base (their rows besides the
    # drafts) near this fit's, took beyond the price of their base, over what the parts above priced
    # that at (`StepCostModel._draft_scale`); every drafting cost is scaled by it. 1: nothing
    # measured, or no profile (the fit then prices drafts on the steps near the rows they reach).
    draft_scale: float = 1.0


# The quantities each observed step leaves in `StepCostModel`'s window, in `_pending`'s order.
_FIELDS = ("rows", "logit_rows", "seconds", "drafter", "passes", "drafts", "fed", "pass_rows", "forward",
           "drafting", "step")


class StepProfile(NamedTuple):
    """The target's step time against rows, measured before serving (``ModelRunner.profile_step_curve``):
    the forward over `rows[i]` decode rows of a sequence each (`forward[i]` seconds) and the lm_head
    with greedy picks over as many (`head[i]`); with speculation, `grouped[j]` the forward over
    `grouped_rows[j]` rows (some of `rows`: `GROUPED_PROFILE_ROWS`) held `group` (k + 1) to a
    sequence, a verification's shape (None: not measured). Its fields are, in order,
    `StepCostModel.set_profile`'s arguments."""

    rows: list[int]
    forward: list[float]
    head: list[float]
    grouped_rows: list[int] | None = None
    grouped: list[float] | None = None
    group: int = 1


class StepCostModel:
    """Step time against the rows of the step's target forward and its drafter passes, fitted where
    the policy asks.

    Every step leaves (rows, logit rows, whether it verified drafts, passes, positions the first
    pass fed and the later ones fed, requests drafted for, seconds, drafter seconds) in a window of
    the last `window` steps. `fit(base)` fits

        seconds = fixed + row * rows + logit_extra * logit_rows + verify_cost * [drafts verified]
                  + drafter_row * positions_fed + first_cost * [passes >= 1] + pass_cost * max(passes - 1, 0)
                  + request_cost * requests_drafted_for

    over that window by weighted least squares, each step weighted by its recency (half-life
    `half_life` steps) and by how close its rows are to `base` (a Gaussian in log(rows +
    PRIOR_FIXED_ROWS), `bandwidth` wide, cut at two bandwidths): a local linear model of the curve
    at the batch size the drafts will be verified in. The slopes come from the differences between
    consecutive steps, which share the machine's state: a slow spell is not charged to whatever the
    policy chose during it. The step splits in two parts, each fitted on its own timer: the target's
    part (step minus drafter) against its rows, what a row that computes logits costs on top (a
    draft row does, a prompt row does not: the lm_head and sampling are a fifth of a row's cost on
    a small model, and most of the rows' variation at high load is prompts') and whether it
    verified drafts (a fixed cost: the rejection sampler, the per-draft bookkeeping); the drafter's
    part (`_fit_drafter`, catch-ups left out) against the positions its passes fed, the requests it
    drafted for, whether it ran and its later passes together (deep drafts happen at low load and shallow ones at high load, so
    pricing passes without the rows would charge one for the other). The drafter runs no pass in a
    step where no request drafts (its catch-up waits: ``spec_decode.proposer``), so the first pass
    is priced apart: drafting at all costs it, and verifying them. A pass is ~2 % of a step, below
    the step's jitter but not below the drafter's. Each slope is shrunk towards a prior that stands when its
    covariate does not vary (ridge, worth one pair of steps): the rows' towards time ~ rows +
    PRIOR_FIXED_ROWS through the local means (a fixed part worth that many rows: weights streamed
    once per step), the logit rows' extra towards `logit_share` of the rows', the verification
    towards 0, the drafter's towards its time ~ positions + PRIOR_FIXED_ROWS, the fixed part spread
    over its passes.
    No cost is ever negative, so predicted time never falls as drafts are added. `StepFit` prices the
    drafter's positions where it feeds them: a prompt row (always fed) and a draft row, not the
    decode row of a request that does not draft (it waits; in lockstep, `feeds_every_row`, it does
    not); a drafting request's other positions (what its last step accepted) go with its
    `request_cost`.

    Why not a curve of per-bucket averages: at low load the marginal row costs ~2 % of a step while
    step times jitter by 10-15 % (here: a shared machine), so differences of neighbouring buckets
    are mostly noise, and a running maximum over them (to keep the curve monotone) turned that noise
    into a cost that made the policy draft short where the longest drafts were best.
    """

    def __init__(self, window: int = 512, half_life: float = 128.0, bandwidth: float = float(np.log(2.0)) / 2,
                 row_ridge: float = 16.0, pass_ridge: float = 1.0, verify_ridge: float = 1.0,
                 drafter_row_ridge: float = PRIOR_FIXED_ROWS ** 2,
                 refit_every: int = 32, logit_share: float = 0.0, refit_seconds: float = 0.3,
                 feeds_every_row: bool = False) -> None:
        self.window, self.bandwidth = window, bandwidth
        # In lockstep every request feeds the drafter every step (the vote sized its first pass for
        # every position), drafting or not: a decode row costs the drafter its position, the first
        # pass runs whatever is drafted, and a drafting request feeds nothing more than it would
        # anyway. Alone, one that does not draft waits (``spec_decode.proposer``).
        self.feeds_every_row = feeds_every_row
        # What a row that computes logits costs on top of one that does not, as a share of the
        # latter, where nothing measured says otherwise: the lm_head's weights against the rest
        # (ModelConfig: vocab x hidden against the other active parameters; ~0.26 on SmolLM2).
        self.logit_share = logit_share
        # A fit (~60 numpy operations: ~0.15 ms with warm caches, ~0.45 ms between forward passes,
        # where the scheduler runs) is reused for this many steps; it moves little in 32 of a
        # 128-step half-life. And not before the steps since the last fit took `refit_seconds`
        # together: on a small model a step takes ~1.5 ms and a fit with its curves ~0.6 ms between
        # forward passes (the demo at 4 requests, offline), so 32 steps alone would spend ~1 % of
        # the engine's time refitting; 0.1 s still spent 0.7 % of the steps' time (a refit every
        # ~55 steps), 0.3 s bounds it at ~0.2 % (on SmolLM2, ~25 ms a step, the 32 steps bind).
        self.refit_every, self.refit_seconds = refit_every, refit_seconds
        self._seconds_seen = 0.0  # the observed steps' seconds, summed
        self._fits_since_seconds = 0.0
        self._fits: dict[int, StepFit | None] = {}  # grid point -> its fit (None: nothing measured near)
        self._curves: dict[tuple, tuple[list[float], float, float]] = {}  # step_cost's answers, as long as the fits
        self._fits_since = 0
        self._grid_step = bandwidth / 2
        self._grid_points: dict[float, int] = {}  # rows -> `grid_point(rows)`
        self._near: dict[int, bool] = {}  # grid point -> some step measured within its cut (as long as the fits)
        self._drafted: set[int] = set()  # grid points with enough drafting steps near (`drafted_near`; as long as the fits)
        self._undrafted: set[int] = set()  # likewise, steps verifying nothing (`only_drafted_near`)
        # Each prior weighs as much as one step this far (rows, passes) from the mean of the others.
        # The verification's prior (0) weighs one pair of steps, as a pass's does. Weighing 8, served
        # SmolLM2 at concurrency 16 drafted one token for most requests at a loss (0.90x plain):
        # the verification's cost then lands partly on the rows, and the fixed part the policy
        # amortizes over all drafting requests shrinks.
        self.row_ridge, self.pass_ridge, self.verify_ridge = row_ridge, pass_ridge, verify_ridge
        # The drafter's cost per position weighs one pair of steps PRIOR_FIXED_ROWS positions apart:
        # its timer jitters by ~0.5 ms between steps (the demo on AVX2), so where the positions fed
        # vary by one or two (every request drafting alike) the slope read from them was noise
        # (-0.3 ms a position at 32 requests, truly ~0.08) and the drafter's time went to its first
        # pass. Catch-ups and prompt chunks vary them by tens to hundreds, and outweigh it.
        self.drafter_row_ridge = drafter_row_ridge
        self._decay = 0.5 ** (1.0 / half_life)
        # The window, one row per quantity (the named attributes are views of its rows). A step is
        # queued as a tuple (`_pending`) and written when something reads the window (`_flush`):
        # nine numpy stores a step, with cold caches between forward passes, cost ~5 us a step.
        self._data = np.zeros((len(_FIELDS), window))
        (self._rows, self._logit_rows, self._seconds, self._drafter, self._passes, self._drafts, self._fed,
         self._pass_rows, self._forward, self._drafting, self._step) = self._data
        self._step[:] = -np.inf  # -inf: an empty slot
        # _drafter: seconds (0 where it ran no pass); _drafts: the draft rows the step verified;
        # _fed: positions the drafter's first pass fed; _pass_rows: those its later passes fed;
        # _forward: seconds in the target's forward and lm_head; _drafting: the requests the drafter
        # drafted for; _step: the step count each entry was taken at
        self._pending: list[tuple[float, ...]] = []
        self._next = 0
        self._count = 0
        self.drafting_steps = 0  # steps whose drafter ran a pass (all of them, not only the window's)
        # The target forward's and the lm_head's seconds against rows, measured before serving
        # (`set_profile`); None: the target's part is fitted as a line (class docstring).
        # (rows, forward seconds, head rows from 0, head seconds from 0)
        self._profile: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.measured_profile: StepProfile | None = None  # `set_profile`'s arguments, as given
        # What holding rows `_group` to a sequence saves of the forward, at rows from 0 (None: draft
        # rows are priced as rows of their own sequences).
        self._saving: tuple[np.ndarray, np.ndarray] | None = None
        self._group = 1
        # What drafting cost near each grid point when steps there last showed it: (the
        # verification's fixed cost, a later pass, a drafting request) from the last fit with some
        # step near it that verified drafts, standing for those three in a fit with none: only
        # drafting steps tell them, and a window without any priced drafting at its rows alone.
        # Served, the demo at 4 requests (mixed workload) after ~1,200 steps of no drafts: a step
        # drafting for one or two requests was priced ~0.1 ms above one without where it took
        # ~0.5-0.7 ms more, and the policy drafted for ~0.3 s, until its own steps told it
        # otherwise (~5 % of such a round).
        self._drafting_memory: dict[int, tuple[float, float, float]] = {}

    def set_profile(self, rows: list[int], forward_seconds: list[float], head_seconds: list[float],
                    grouped_rows: list[int] | None = None, grouped_seconds: list[float] | None = None,
                    group: int = 1) -> None:
        """Price rows on a measured shape instead of a fitted line: `forward_seconds[i]` is the
        target forward over `rows[i]` decode rows, `head_seconds[i]` the lm_head and greedy pick
        over as many (``ModelRunner.profile_step_curve``). The fit then maps that shape onto the
        forwards the steps timed near the batch size asked about (a slope and a per-step part:
        the API server's share of the cores, the machine's clock, `_forward_fit`) and fits only
        the rest of the step (the drafter's part, the per-step and per-request work around the
        forward, the verification's fixed cost) as lines. Why: served, steps of the same rows vary by 10-30 %
        (other work on the same cores), and a row's cost read from differences of a row or two
        between consecutive steps was mostly that noise. On a compute-bound CPU (AVX2, SmolLM2:
        ~2.3 ms a row at 32 rows) it read 0.8 ms, and the policy drafted at a loss under load.

        `grouped_seconds[j]`: the forward over `grouped_rows[j]` rows (each one of `rows`) held
        `group` to a sequence (a verification's shape), so that a draft row is priced as what it
        is, a row of its request's sequence (`shape`)."""
        r = np.asarray(rows, dtype=np.float64)
        if r.ndim != 1 or r.size == 0 or len(forward_seconds) != r.size or len(head_seconds) != r.size:
            raise ValueError(f"profile needs rows, forward and head seconds of one length, got {rows!r}")
        if not (np.diff(r) > 0).all() or r[0] < 1:
            raise ValueError(f"profile rows must rise from >= 1, got {rows!r}")
        if not min(forward_seconds) > 0:
            raise ValueError(f"profile forward seconds must be > 0, got {forward_seconds!r}")
        if grouped_seconds is not None:
            if grouped_rows is None or len(grouped_rows) != len(grouped_seconds) or not grouped_rows:
                raise ValueError(f"grouped profile needs rows and seconds of one length, got {grouped_rows!r} "
                                 f"and {grouped_seconds!r}")
            if not set(grouped_rows) <= set(rows) or sorted(set(grouped_rows)) != list(grouped_rows):
                raise ValueError(f"grouped profile rows must rise and be profiled rows ({rows!r}), got {grouped_rows!r}")
            if not min(grouped_seconds) > 0:
                raise ValueError(f"grouped profile seconds must be > 0, got {grouped_seconds!r}")
            if group < 2:
                raise ValueError(f"grouped profile needs rows grouped 2 or more to a sequence, got group={group}")
        # Non-decreasing (a bigger batch never takes less time; noise in the measurement can say so),
        # from below: noise only ever slows a run down, so a point above a larger batch's is the
        # outlier and takes that batch's time. (A running maximum from the left kept the outlier
        # instead and flattened the curve after it: SmolLM2's 15 rows once timed 13.9 ms against
        # 12.9 at 16 and 13.3 at 17, so 15-17 rows cost nothing, a draft row at 16 requests was
        # priced at a third of what it took, and a step without drafts 15 % above its own time.)
        fwd = _envelope_from_below(np.asarray(forward_seconds, dtype=np.float64))
        head = _envelope_from_below(np.maximum(np.asarray(head_seconds, dtype=np.float64), 0.0))
        # The head over 0 rows costs nothing (a step of prompt rows only).
        self._profile = (r, fwd, np.concatenate([[0.0], r]), np.concatenate([[0.0], head]))
        self.measured_profile = StepProfile(list(rows), list(forward_seconds), list(head_seconds), grouped_rows,
                                            grouped_seconds, group)
        self._saving, self._group = None, 1
        if grouped_seconds is not None and grouped_rows is not None:
            # Never below 0 (fewer sequences read fewer keys; a measurement saying otherwise is
            # noise), nothing at 0 rows.
            gr = np.asarray(grouped_rows, dtype=np.float64)
            own = fwd[np.searchsorted(r, gr)]
            saved = np.maximum(own - np.asarray(grouped_seconds, dtype=np.float64), 0.0)
            self._saving = (np.concatenate([[0.0], gr]), np.concatenate([[0.0], saved]))
            self._group = int(group)
        self._fits.clear()
        self._curves.clear()

    def shape(self, rows: np.ndarray | float, logit_rows: np.ndarray | float,
              draft_rows: np.ndarray | float = 0.0) -> np.ndarray:
        """The profiled seconds of a target forward over `rows` rows, `logit_rows` of them through
        the lm_head and `draft_rows` of them drafts verified (rows of a request's sequence after its
        token): linear between the measured points, extended beyond them (`_interp`). Where a
        grouped profile was measured, a share of what rows held `group` to a sequence save is taken
        off, the share of draft rows against a verification's (group - 1 of every group rows): a
        sequence's attention costs the same for one query row or a few. The saving is linear
        between the rows it was measured at and in proportion to the rows beyond them."""
        assert self._profile is not None
        r, fwd, head_rows, head = self._profile
        own = _interp(rows, r, fwd)
        if self._saving is not None:
            gr, saved = self._saving
            rows_arr = np.asarray(rows, dtype=np.float64)
            saving = np.where(rows_arr > gr[-1], saved[-1] * rows_arr / gr[-1], np.interp(rows_arr, gr, saved))
            spread = np.maximum(rows_arr * (self._group - 1) / self._group, 1e-9)
            share = np.clip(np.asarray(draft_rows, dtype=np.float64) / spread, 0.0, 1.0)
            own = own - share * np.minimum(saving, own)
        return own + _interp(logit_rows, head_rows, head)

    @property
    def measured(self) -> bool:
        return self._count > 0

    def observe(self, num_rows: int, seconds: float, drafter_seconds: float, drafter_passes: int,
                num_logit_rows: int | None = None, num_draft_rows: int = 0, drafter_rows: int | None = None,
                forward_seconds: float | None = None, drafter_pass_rows: int = 0, drafting_reqs: int = 0) -> None:
        """One step: `num_rows` through the target forward, `num_logit_rows` of them computing logits
        (None: all), `num_draft_rows` of those verifying drafts, `seconds` for the whole step, of which
        `drafter_seconds` in `drafter_passes` drafter passes, the first of which fed `drafter_rows`
        positions (None: the step's rows; more where a catch-up waited, fewer where it now waits)
        and the later ones `drafter_pass_rows` together, drafting for `drafting_reqs` requests, and
        `forward_seconds` in the target's forward and lm_head (None: all but the drafter's)."""
        if num_rows <= 0 or seconds <= 0:
            return
        self._count += 1
        self.drafting_steps += drafter_passes > 0
        drafter = max(drafter_seconds, 0.0)
        target = max(seconds - drafter, 0.0)
        forward = target if forward_seconds is None else min(max(forward_seconds, 0.0), target)
        self._pending.append((
            num_rows, num_rows if num_logit_rows is None else num_logit_rows, seconds, drafter, drafter_passes,
            num_draft_rows, num_rows if drafter_rows is None else drafter_rows, drafter_pass_rows, forward,
            drafting_reqs, self._count,
        ))
        if len(self._pending) >= self.window:
            self._flush()
        self._seconds_seen += seconds

    def _flush(self) -> None:
        """Write the queued steps into the window (the oldest entries make room)."""
        if not self._pending:
            return
        n = len(self._pending)
        slots = (self._next + np.arange(n)) % self.window
        self._data[:, slots] = np.array(self._pending, dtype=np.float64).T
        self._next = int((self._next + n) % self.window)
        self._pending.clear()

    def _nearness(self, base_rows: float, rows: np.ndarray | None = None) -> np.ndarray:
        """[window] each step's rows (or `rows`, one per step) from `base_rows`, in bandwidths."""
        self._flush()
        rows = self._rows if rows is None else rows
        return np.log((rows + PRIOR_FIXED_ROWS) / (base_rows + PRIOR_FIXED_ROWS)) / self.bandwidth

    def _caught_up(self) -> np.ndarray:
        """[window] the steps whose drafter's first pass fed BULK_FEED positions or more beyond the
        step's rows: a catch-up (or a prompt) in the drafter, priced apart (`catch_up_row`)."""
        return (self._fed - self._rows >= BULK_FEED) & (self._passes > 0)

    def _decode_steps(self) -> np.ndarray:
        """[window] the steps of decode rows, a prompt chunk of fewer than BULK_FEED rows at most."""
        return self._rows - self._logit_rows < BULK_FEED

    def measured_near(self, base_rows: float) -> bool:
        """Whether some remembered step lies within the fit's cut (two bandwidths) of the grid point
        that stands for `base_rows` (`grid_point`). With a profile, whether any step was measured: the
        shape is known everywhere, and any step gives its scale."""
        if self._profile is not None:
            return self.measured
        self._expire()
        return self._near_any(self.grid_point(base_rows))

    def drafted_near(self, base_rows: float, enough: int, passes: bool = True) -> bool:
        """Whether at least `enough` steps in the window ran the drafter (`passes`; else: verified
        drafts, a lookup's drafting steps) on decode rows (fewer than BULK_FEED prompt rows, no
        drafter catch-up of as many positions) with their base (rows besides the drafts they
        verified) within the fit's cut of the grid point that stands for `base_rows`: the steps the
        drafting costs at this batch size are read from. A yes stands as long as the fits do (`_expire`); a
        no is asked again at the next decision (the static drafting it leads to adds such steps one
        a step)."""
        self._expire()
        j = self.grid_point(base_rows)
        if j in self._drafted:
            return True
        steps = self._clean_steps_near(j)  # (first: it writes the queued steps into the window)
        drafting = (self._passes > 0) if passes else (self._drafts > 0)
        if int((steps & drafting).sum()) < enough:
            return False
        self._drafted.add(j)
        return True

    def only_drafted_near(self, base_rows: float, enough: int) -> bool:
        """Whether the window holds at least `enough` decode steps (no prompt rows, no drafter
        catch-up) that verified drafts with their base (rows besides the drafts) within the fit's
        cut of the grid point that stands for `base_rows`, and fewer than `enough` steps that
        verified none with their requests (rows that computed logits) within it: the step
        drafting is weighed against is extrapolated from drafting steps there, not measured
        (`QUIET_EXPLORE_EVERY`). A no for having enough of the latter stands as long as the fits
        do (`_expire`)."""
        self._expire()
        j = self.grid_point(base_rows)
        if j in self._undrafted:
            return False
        # A step that verified nothing counts near the batch of its requests (its rows that computed
        # logits), with a prompt chunk or a drafter catch-up in it or not. Where the policy drafts
        # again right after a quiet step, that step's drafter feeds every request the positions
        # the quiet decision left waiting (from about 8 requests on, a catch-up of BULK_FEED
        # positions or more; the forward, what the step is for, is a decode step's all the same),
        # and under churn most steps take a new request's prompt besides: counted among the clean
        # steps only, few or none counted, and the demo at 32 requests drafting 3 went quiet every
        # 64th decision for good (~2 % of its tokens a second). A quiet step with a long prompt
        # chunk informs the fits near its whole rows rather than its requests' (the fit's kernel);
        # it still counts here: an exploration whose steps cannot land nearer would never end.
        requests = self._nearness(self._grid_rows(j), self._logit_rows)  # (no drafts: one a request)
        quiet = int((np.isfinite(self._step) & (np.abs(requests) <= 2.0) & (self._drafts == 0)).sum())
        if quiet >= enough:
            self._undrafted.add(j)
            return False
        return int((self._clean_steps_near(j) & (self._drafts > 0)).sum()) >= enough

    def _clean_steps_near(self, j: int) -> np.ndarray:
        """[window] the remembered decode steps (fewer than BULK_FEED prompt rows, no drafter
        catch-up of as many positions) whose base (rows besides the drafts they verified) lies within
        the fit's cut of grid point `j`: the drafting steps among them tell what drafting costs at
        this batch size (`drafted_near`, `only_drafted_near`; the latter counts the steps without
        drafts apart, catch-up or prompt chunk or not). A step that also ran a prompt chunk or a drafter catch-up is
        mostly that work: a round of new requests opens with such steps, and priced on them the
        demo's first round at 16 requests after rounds at one (AVX512-BF16) read drafting 3 at 0.82
        of drafting nothing, drafted nothing and parked 387 of 512 requests, at ~0.6 of k = 3's
        tokens a second."""
        self._flush()
        near = np.abs(self._nearness(self._grid_rows(j), self._rows - self._drafts)) <= 2.0
        return np.isfinite(self._step) & near & self._decode_steps() & ~self._caught_up()

    def _near_any(self, j: int) -> bool:
        """Whether grid point `j` has a measured step within its cut (asked lately: the answer stands
        as long as the fits do, `_expire`)."""
        near = self._near.get(j)
        if near is None:
            self._flush()
            near_rows = np.abs(self._nearness(self._grid_rows(j))) <= 2.0
            near = self._near[j] = bool((np.isfinite(self._step) & near_rows).any())
        return near

    def fit(self, base_rows: float) -> StepFit:
        """The local fit at `base_rows` (class docstring)."""
        assert self.measured, "no step measured yet"
        self._flush()
        x, y, lg, dr_rows = self._rows, self._seconds, self._logit_rows, self._drafts
        v = (dr_rows > 0).astype(np.float64)  # the step verified drafts
        age = self._count - self._step  # steps since each entry (inf: an empty slot)
        full = np.isfinite(age)
        near = self._nearness(base_rows)
        kernel = np.where(full, np.exp(-0.5 * near * near), 0.0)  # [window]
        # Cut at 2 bandwidths (rows + 16 within a factor 2 of the base's): a pair of steps far
        # apart has so much leverage on a slope that even a faint Gaussian tail would let it
        # decide the local one. Nothing that near: the nearest steps, as the tail has them.
        inside = np.abs(near) <= 2.0
        local = np.where(inside, kernel, 0.0)
        if local.sum() > 0:
            kernel = local
        elif not kernel.sum() > 0:  # every step far beyond the tail's reach
            kernel = full.astype(np.float64)
        recency = np.where(full, self._decay ** np.where(full, age, 0.0), 0.0)
        if self._profile is not None:  # every step besides, as much as GLOBAL_STEPS steps together
            kernel = kernel + full * (GLOBAL_STEPS / float(recency.sum()))
        w = recency * kernel
        w = w / w.sum()
        d = self._drafter
        t = y - d  # everything but the drafter: the target forward, sampling, scheduling
        mx, ml, mv, mt = w @ x, w @ lg, w @ v, w @ t
        # The slopes from step-to-step differences: consecutive steps share the machine's state, so
        # a slow spell (other tenants, frequency) cancels instead of being charged to whatever the
        # policy chose during it. Slot i - 1 holds the step before slot i's (ring order).
        pairs = full & (np.roll(age, 1) == age + 1.0)
        wd = np.where(pairs, recency * np.sqrt(kernel * np.roll(kernel, 1)), 0.0)
        total = wd.sum()
        if total > 0:
            wd = wd / total
            share = float(wd @ wd)  # 1 / effective number of pairs: each prior counts as one pair
        # No step near here verified drafts: what drafting cost when steps near here last showed it
        # (`_drafting_memory`) stands for the parts only drafting steps tell.
        j = self.grid_point(base_rows)
        memory = self._drafting_memory.get(j) if not mv > 0 else None
        verify_prior = memory[0] if memory is not None else 0.0
        drafter_row, first_cost, pass_cost, drafter_fixed, catch_up_row, request_cost = self._fit_drafter(
            w, wd, recency, memory)
        if self.feeds_every_row:  # the first pass runs every step, drafts or none: part of every step
            drafter_fixed, first_cost = drafter_fixed + first_cost, 0.0
        # The drafter feeds a prompt row (always) and a draft row (a drafting request's), not a decode
        # row of a request that does not draft (it waits; in lockstep it does not): a decode row's
        # position, fed or waiting.
        fed_row = drafter_row if self.feeds_every_row else 0.0
        dv = v - np.roll(v, 1)
        if self._profile is not None:
            # The target's forward and lm_head: the profiled shape times one scale, the ratio of
            # what they measured near `base_rows` to what the profile says (the API server's share
            # of the cores, the machine's clock). The rest of the step (scheduling, sampling,
            # Python's per-step and per-request work) is a line of its own: a fixed part, a cost
            # per row that computes logits (a request or a draft: its sampling and bookkeeping)
            # and what verifying drafts at all costs, the last two from step-to-step differences,
            # each shrunk towards 0. Scaling the whole step on the shape instead priced a row at
            # up to twice its forward on a small model whose steps are half Python.
            f = self._forward
            shape = self.shape(x, lg, dr_rows)  # [window]
            scale, forward_fixed = self._forward_fit(base_rows, w, (wd, share) if total > 0 else None, shape, inside)
            rest = t - f
            rest_row, verify_cost = 0.0, verify_prior
            if total > 0:
                dl, dr = lg - np.roll(lg, 1), rest - np.roll(rest, 1)
                dz = np.stack([dl, dv])  # [2, window]
                gram = (dz * wd) @ dz.T + np.diag([share * self.row_ridge, share * self.verify_ridge])
                rhs = (dz * wd) @ dr + np.array([0.0, share * self.verify_ridge * verify_prior])
                rest_row, verify_cost = np.maximum(np.linalg.solve(gram, rhs), 0.0).tolist()
            rest_fixed = float(w @ rest) - rest_row * ml - verify_cost * mv
            fit = self._remember(j, mv, StepFit(
                float(drafter_fixed + rest_fixed + forward_fixed), float(drafter_row), float(rest_row + fed_row), float(first_cost),
                float(pass_cost), float(verify_cost), max(scale, 0.0), catch_up_row, drafter_row, request_cost))
            return fit._replace(draft_scale=self._draft_scale(base_rows, recency, shape, fit))
        row_prior = mt / (mx + PRIOR_FIXED_ROWS)  # the target's time ~ rows + PRIOR_FIXED_ROWS, likewise
        if total > 0:
            dx, dl, dt = x - np.roll(x, 1), lg - np.roll(lg, 1), t - np.roll(t, 1)
            # The target's part against its rows, what a row that computes logits costs on top
            # (the lm_head and sampling; shrunk towards `logit_share` of a row's slope, so where
            # only prompt rows vary, as at high load or near a batch size reached only by prompt
            # chunks, a draft row is priced from theirs) and whether it verifies drafts (the
            # rejection sampler, the runner's and scheduler's per-draft work: a fixed cost that one
            # draft row would otherwise carry alone; prior 0).
            dr = np.stack([dx, dl, dv])  # [3, window]
            ls = self.logit_share
            tie = np.array([[ls * ls, -ls, 0.0], [-ls, 1.0, 0.0], [0.0, 0.0, 0.0]])  # (extra - ls * row)^2
            row_ridge = share * self.row_ridge
            gram = (dr * wd) @ dr.T + np.diag([row_ridge, 0.0, share * self.verify_ridge]) + row_ridge * tie
            rhs = (dr * wd) @ dt + np.array([row_ridge * row_prior, 0.0, share * self.verify_ridge * verify_prior])
            target_row, logit_extra, verify_cost = np.linalg.solve(gram, rhs).tolist()
            # Each clipped as a whole (where every row computes logits the two row terms split one
            # slope between them, either part possibly below zero).
            logit_row = max(target_row + logit_extra, 0.0)
            target_row, verify_cost = max(target_row, 0.0), max(verify_cost, 0.0)
        else:
            logit_row = row_prior
            target_row = row_prior / (1.0 + self.logit_share)
            verify_cost = verify_prior
        fixed = mt - target_row * (mx - ml) - logit_row * ml - verify_cost * mv + drafter_fixed
        return self._remember(j, mv, StepFit(
            float(fixed), float(target_row + drafter_row), float(logit_row + fed_row), float(first_cost),
            float(pass_cost), float(verify_cost), 0.0, catch_up_row, drafter_row, request_cost))

    def _forward_fit(self, base_rows: float, w: np.ndarray, pairs: tuple[np.ndarray, float] | None,
                     shape: np.ndarray, inside: np.ndarray) -> tuple[float, float]:
        """The target's forward near `base_rows` as (scale, fixed): forward = fixed + scale * shape
        (`w`: the steps' weights; `pairs`: the step-to-step pairs' weights, normalised, and their
        `share` (1 / their effective number) as `fit` computed them, None: no pair; `shape`: the
        window's profiled shapes; `inside`: the steps within the fit's cut).

        Served forwards take longer than the profile says (SmolLM2 on AVX512-BF16 at 32 requests:
        23.7 ms against 18.5), and not in proportion: over the same steps the forward grew 9.5 ms
        with 32 draft rows where the profile's growth, scaled by that ratio, said 11.8, so drafting
        was priced ~20 % high and the policy drafted nothing where k = 1 served 1.09x plain. Part
        of what served forwards take beyond the profile is per step (the work around the GEMMs,
        the API server's share of the cores), not per row, and a served row can cost less than a
        profiled one (`LOWEST_SLOPE`). So the slope comes from step-to-step differences of forward
        against shape (consecutive steps share the machine's state), over pairs of decode steps
        within the fit's cut (a prompt chunk's rows are not the profile's decode rows, and a pair
        reaching far has the leverage to set the slope alone), shrunk towards the ratio by
        PRIOR_SCALE_PAIRS pairs whose shapes differ by PRIOR_FIXED_ROWS decode rows, and kept
        between min(LOWEST_SLOPE, ratio) and the ratio (the fixed part is never negative). Where
        drafting steps and steps without drafts alternate near the batch, their differences set
        it; where the rows barely move it stays at the ratio, one scale as before."""
        f = self._forward
        ms, mf = float(w @ shape), float(w @ f)
        ratio = mf / max(ms, 1e-12)  # > 0: every forward in the profile took time
        if pairs is None:
            return ratio, 0.0
        wd, share = pairs
        clean = (self._decode_steps() & inside).astype(np.float64)
        wc = wd * clean * np.roll(clean, 1)
        ds, df = shape - np.roll(shape, 1), f - np.roll(f, 1)
        unit = float(self.shape(base_rows + PRIOR_FIXED_ROWS, base_rows + PRIOR_FIXED_ROWS)
                     - self.shape(base_rows, base_rows))
        ridge = PRIOR_SCALE_PAIRS * share * unit * unit
        slope = (float(wc @ (ds * df)) + ridge * ratio) / (float(wc @ (ds * ds)) + ridge) if ridge > 0 else ratio
        slope = min(max(slope, min(LOWEST_SLOPE, ratio)), ratio)
        return slope, max(mf - slope * ms, 0.0)

    def _draft_scale(self, base_rows: float, recency: np.ndarray, shape: np.ndarray, f: StepFit) -> float:
        """What drafting took over what `f` prices it at, near `base_rows` (`StepFit.draft_scale`);
        `shape`: the profiled shape of every step in the window, as the fit computed it.

        The fit is local to the rows of a step, and drafts take a batch far from its base: 16
        requests drafting 3 each verify 64 rows, beyond the cut of a fit at 16, so their step is
        priced on the profile's shape scaled to the steps near 16 rows, and the shape moves between
        start-ups (the demo's forward over 128 rows held 4 to a sequence against 32 rows of their
        own: 2.44-3.02x in six profiles, ~2.9-3.0x in served steps), while the work around the
        forward that grows with drafts is read where none are verified. Served (the demo on an
        AVX512-BF16 CPU at 16 requests), steps drafting 3 were priced ~10 % under what they took,
        where the decision hung on less. So each step that verified drafts (catch-ups left out:
        priced apart), its base within the fit's cut of `base_rows`, is priced twice, as it ran and
        as its base alone, and the ratio of what it took beyond the second to what the first added,
        summed over those steps (weighted by recency and nearness), scales every drafting cost. A
        step jitters by a share of the whole step, not of what its drafts added (one draft explored
        in a batch that drafts nothing adds ~5 % to a step that jitters by ~15 %), so the ratio is
        shrunk towards 1 by PRIOR_DRAFTING_STEPS whole steps of evidence: a few explorations move it
        little, a spell of deep drafts sets it. Kept within [1/2, 2]."""
        x, lg, dr, passes = self._rows, self._logit_rows, self._drafts, self._passes
        base = x - dr
        near = self._nearness(base_rows, base)
        drafting = (dr > 0) & ~self._caught_up()
        w = np.where(drafting & (np.abs(near) <= 2.0), recency * np.exp(-0.5 * near * near), 0.0)
        pick = np.flatnonzero(w > 0)
        if pick.size == 0:
            return 1.0
        w, x, lg, dr, passes, base = w[pick], x[pick], lg[pick], dr[pick], passes[pick], base[pick]
        base_lg = lg - dr
        alone = f.scale * self.shape(base, base_lg) + f.per_row * (base - base_lg) + f.per_logit_row * base_lg
        priced = (f.scale * shape[pick] + f.per_row * (x - lg) + f.per_logit_row * lg + f.draft_row * dr
                  + f.verify_cost + f.first_cost * (passes > 0) + f.pass_cost * np.maximum(passes - 1, 0)
                  + f.request_cost * self._drafting[pick])
        took = self._seconds[pick] - f.fixed
        added, beyond = float(w @ (priced - alone)), float(w @ (took - alone))
        if not added > 0:
            return 1.0
        prior = PRIOR_DRAFTING_STEPS * float(w @ (alone + f.fixed)) / float(w.sum())
        return float(min(max((beyond + prior) / (added + prior), 0.5), 2.0))

    def _remember(self, j: int, verified: float, fit: StepFit) -> StepFit:
        """`fit`, its drafting costs (verification, a later pass, a drafting request) kept for grid
        point `j` where some step near it verified drafts (`verified`: their weighted share), for
        the fits there that have none (`_drafting_memory`)."""
        if verified > 0:
            self._drafting_memory[j] = (fit.verify_cost, fit.pass_cost, fit.request_cost)
        return fit

    def _fit_drafter(self, w: np.ndarray, wd: np.ndarray, recency: np.ndarray,
                     memory: tuple[float, float, float] | None = None
                     ) -> tuple[float, float, float, float, float, float]:
        """The drafter's part of the local fit (`w`: the steps' weights, `wd`: the step-to-step
        pairs', `recency`: the steps' recency alone): (seconds a position fed, its first pass, each
        later pass, its fixed part, a caught-up position's `StepFit.catch_up_row`, a drafting
        request's `StepFit.request_cost`), from its own timer: a pass is ~2 % of a step, far below
        the step's jitter, but not below the drafter's.

            drafter = fixed + row * positions fed (all passes) + first * [passes >= 1] + pass * (passes - 1)
                      + request * requests drafted for

        A request drafted for costs the drafter its own work besides the positions it feeds (its
        rows of the pass, its drafts' bookkeeping; prior 0): on the demo model at 16 requests
        ~50 us, against ~6 us a position and ~60 us for a whole decode row of the target.

        A later pass feeds one position per request drafting that deep; those are positions, so a
        pass is priced at its overhead. The steps whose first pass caught up a wait (`BULK_FEED`
        positions or more beyond the step's rows) are left out: a catch-up is priced per position
        in bulk (`StepFit.catch_up_row`), and it comes with the passes of the drafts that end the
        wait (the whole batch at its caps after a spell of none: the demo at 32 requests fed 800
        positions and ran two later passes in one step). Kept, what its positions cost beyond the
        local slope went to those passes (16-18 ms a pass against ~4) and drafting stopped."""
        d, passes = self._drafter, self._passes
        u = (passes > 0).astype(np.float64)  # the drafter ran (pass 1)
        q = np.maximum(passes - 1.0, 0.0)  # drafter passes after the first
        fed = self._fed + self._pass_rows
        kept = ~self._caught_up()
        if (w * kept).sum() > 0:  # (else only catch-ups near here: they are all there is to go by)
            w = w * kept / (w * kept).sum()
            wd = wd * kept * np.roll(kept, 1)
        r = self._drafting
        md, mf, mu, mq, mr = w @ d, w @ fed, w @ u, w @ q, w @ r
        # What the drafter takes in the steps near here that ran no pass (its bookkeeping; none
        # where every step ran one): its fixed part, at most.
        idle = w * (passes == 0)
        idle_cost = float(idle @ d) / float(idle.sum()) if idle.sum() > 0 else 0.0
        # Priors: a drafting step's time beyond that ~ positions fed + PRIOR_FIXED_ROWS through the
        # local means, the fixed part (PRIOR_FIXED_ROWS positions' worth) spread over its passes
        # alike. Priced at the average drafter time a pass instead, a later pass cost every position
        # the first fed: where no step near here ran one (the demo at 32 requests drafting one
        # each, prompts fed alongside) that prior stood at 5-12 ms against ~4 (~1.4 and 32 positions),
        # and drafting stopped.
        drafter_row = max(md - idle_cost, 0.0) / (mf + PRIOR_FIXED_ROWS * mu) if mf + mu > 0 else 0.0
        first_cost = pass_cost = drafter_row * PRIOR_FIXED_ROWS * mu / (mu + mq) if mu + mq > 0 else 0.0
        request = 0.0
        if memory is not None:  # no drafts verified near here: what they cost when last seen (`fit`)
            pass_cost, request = memory[1], memory[2]
        total = wd.sum()
        if total > 0:
            wd = wd / total
            # Each prior weighs one pair of steps (the row's: PRIOR_FIXED_ROWS positions apart).
            ridge = float(wd @ wd) * np.array([self.drafter_row_ridge, self.pass_ridge, self.pass_ridge,
                                               self.pass_ridge])
            dz = np.stack([fed - np.roll(fed, 1), u - np.roll(u, 1), q - np.roll(q, 1), r - np.roll(r, 1)])  # [4, window]
            gram = (dz * wd) @ dz.T + np.diag(ridge)
            rhs = (dz * wd) @ (d - np.roll(d, 1)) + ridge * np.array([drafter_row, first_cost, pass_cost, request])
            drafter_row, first_cost, pass_cost, request = np.maximum(np.linalg.solve(gram, rhs), 0.0).tolist()
        drafter_fixed = md - drafter_row * mf - first_cost * mu - pass_cost * mq - request * mr
        if drafter_fixed < 0.0:
            # The drafter takes no time where it feeds nothing and runs no pass, so its fixed part
            # is not negative. It comes out negative where its parts are not told apart: where every
            # step near here ran the drafter alike, the first pass and the positions fed sit at
            # their priors, and the positions' slope, read from differences of a position or two,
            # may be far above its prior (noise). So the first pass (what every drafting step runs
            # alike) takes what the positions and the later passes leave, and where that is not
            # enough all three are scaled down to the time measured here. A negative fixed part
            # priced a step without drafts ~3 ms under what it took (the demo at 16 requests on
            # AVX2: 4.6 against ~7), and drafting turned off in half the decisions where k = 3
            # paid 15 %.
            if mu > 0.0:
                cut = min(-drafter_fixed / mu, first_cost)
                first_cost, drafter_fixed = first_cost - cut, drafter_fixed + cut * mu
            if drafter_fixed < 0.0:
                explained = md - drafter_fixed  # > md >= 0
                drafter_row, first_cost, pass_cost, request = (
                    x * md / explained for x in (drafter_row, first_cost, pass_cost, request))
            drafter_fixed = 0.0
        if drafter_fixed > idle_cost and mu > 0.0:
            # Nor is it more than the drafter takes in the steps near here that ran no pass: the
            # rest is what running at all costs, the first pass's. Where positions and passes never
            # varied, their priors leave part of the drafter's time unexplained, and a fixed part
            # would price it into every step without drafts.
            first_cost += (drafter_fixed - idle_cost) / mu
            drafter_fixed = idle_cost
        # A catch-up at the drafter's cost per position in bulk (its later passes' overhead taken
        # out): that cost does not depend on the target's batch, so every bulk step in the window
        # counts.
        bulk = (recency > 0) & (self._fed >= BULK_FEED) & (passes > 0)
        wb = recency[bulk]
        catch_up_row = (float(wb @ np.maximum(d[bulk] - pass_cost * q[bulk], 0.0))
                        / float(wb @ fed[bulk]) if wb.sum() > 0 else drafter_row)
        # A drafting request's first pass feeds the positions its last step accepted besides its
        # first draft's: the local mean of those, over the steps that fed no prompt rows (a prompt's
        # positions are fed whether or not anything drafts, and priced as rows). In lockstep it
        # feeds them drafting or not.
        decode = w * (r > 0) * (self._rows <= self._logit_rows)
        accepted = (float(decode @ np.maximum(self._fed - r, 0.0)) / float(decode @ r)
                    if decode.sum() > 0 and not self.feeds_every_row else 0.0)
        return (float(drafter_row), float(first_cost), float(pass_cost), float(drafter_fixed), catch_up_row,
                float(request + drafter_row * accepted))

    def _cached_fit(self, rows: float, always: bool = False) -> StepFit | None:
        """The fit at the grid point nearest `rows` (None where no step was measured within its cut,
        unless `always`), reused for `refit_every` steps and `refit_seconds` (`_expire`)."""
        self._expire()
        j = self.grid_point(rows)
        if j not in self._fits or (always and self._fits[j] is None):
            self._fits[j] = self.fit(self._grid_rows(j)) if always or self._near_any(j) else None
        return self._fits[j]

    def _expire(self) -> None:
        """Drop the fits and curves once the oldest is `refit_every` steps and `refit_seconds` of
        steps old."""
        if not self._fits or (self._count - self._fits_since >= self.refit_every
                              and self._seconds_seen - self._fits_since_seconds >= self.refit_seconds):
            self._fits.clear()
            self._curves.clear()
            self._near.clear()
            self._drafted.clear()
            self._undrafted.clear()
            self._fits_since, self._fits_since_seconds = self._count, self._seconds_seen

    def grid_point(self, rows: float) -> int:
        """Fits are taken at grid points half the bandwidth apart in log(rows + PRIOR_FIXED_ROWS), the
        nearest one standing for `rows` (a fit weighs steps up to two bandwidths away: it moves little
        over a quarter of one): batch sizes that differ by a request or a prompt chunk share one fit
        instead of each taking its own. Remembered per `rows` (the policy asks every step)."""
        j = self._grid_points.get(rows)
        if j is None:
            j = max(round(math.log((rows + PRIOR_FIXED_ROWS) / PRIOR_FIXED_ROWS) / self._grid_step), 0)
            if len(self._grid_points) < 4096:  # rows are whole numbers up to the token budget
                self._grid_points[rows] = j
        return j

    def _grid_rows(self, j: int) -> float:
        return PRIOR_FIXED_ROWS * math.exp(j * self._grid_step) - PRIOR_FIXED_ROWS

    def step_cost(self, base_rows: float, num_extra: int, base_logit_rows: float | None = None
                  ) -> tuple[list[float], float, float]:
        """Predicted seconds of a step of `base_rows` rows (`base_logit_rows` of them computing logits;
        None: all) + m draft rows for m = 0..num_extra without a drafter pass, what drafting anything
        costs besides its rows and later passes (the drafter's first pass, run when some request
        drafts, and verifying drafts at all) and the cost of each pass after the first; every
        predicted time > 0 and non-decreasing in m. From fits `_expire` keeps.

        A local fit is a tangent: drafts can take a batch far from its base (16 requests drafting 3
        each verify 64 rows), where a row costs what it costs there (on SmolLM2 ~0.5 ms at 4-16 rows,
        where weights streamed once dominate, ~1 ms at 32-64). So the curve is pieced together from
        fits at anchors base, 2 base + 16, ... (each one fit's cut apart), linear between them; an
        anchor where nothing was measured extends the previous one along the prior shape (time ~
        rows + PRIOR_FIXED_ROWS) instead of along a tangent taken elsewhere."""
        self._expire()
        key = (base_rows, num_extra, base_logit_rows)
        cached = self._curves.get(key)
        if cached is not None:
            return cached
        logit_base = base_rows if base_logit_rows is None else base_logit_rows
        if self._profile is not None:
            # Pointwise in m: one curve per batch serves every number of draft rows up to its length
            # (the caps change as requests near their ends and opt out; the batch does not).
            wide_key = (base_rows, None, logit_base)
            wide = self._curves.get(wide_key)
            if wide is None or len(wide[0]) <= num_extra:
                wide = self._curves[wide_key] = self._profiled_cost(
                    base_rows, max(num_extra, 2 * len(wide[0]) if wide else 0), logit_base)
            result = (wide[0][: num_extra + 1], wide[1], wide[2])
            self._curves[key] = result
            return result
        top = base_rows + num_extra
        anchors = [float(base_rows)]
        while anchors[-1] < top:
            anchors.append(min(2.0 * anchors[-1] + PRIOR_FIXED_ROWS, float(top)))
        base = self._cached_fit(anchors[0], always=True)
        assert base is not None
        times: list[float] = []
        for i, a in enumerate(anchors):
            f = base if i == 0 else self._cached_fit(a)
            if f is None:
                times.append(times[-1] * (a + PRIOR_FIXED_ROWS) / (anchors[i - 1] + PRIOR_FIXED_ROWS))
                continue
            logits = logit_base + (a - base_rows)  # draft rows compute logits
            # a fit extrapolated below zero stays positive
            times.append(max(f.fixed + f.per_row * (a - logits) + f.per_logit_row * logits
                             + f.draft_row * (a - base_rows), 1e-6))
        # Linear between anchors, kept non-decreasing; plain Python (a few hundred points at most:
        # cheaper than numpy between forward passes).
        curve: list[float] = []
        seg, running = 0, 0.0
        for m in range(num_extra + 1):
            r = base_rows + m
            while seg + 2 < len(anchors) and r > anchors[seg + 1]:
                seg += 1
            if len(anchors) == 1:
                t = times[0]
            else:
                a0, a1 = anchors[seg], anchors[seg + 1]
                t = times[seg] + (times[seg + 1] - times[seg]) * (r - a0) / (a1 - a0)
            running = max(running, t)
            curve.append(running)
        result = (curve, base.first_cost + base.verify_cost, base.pass_cost)
        self._curves[key] = result
        return result

    def request_cost(self, base_rows: float) -> float:
        """What a request drafting at all costs besides its draft rows (`StepFit.request_cost`),
        asked near `base_rows`."""
        f = self._cached_fit(base_rows, always=True)
        assert f is not None
        return f.request_cost * f.draft_scale

    def draft_scale(self, base_rows: float) -> float:
        """What drafting took over what the fit near `base_rows` prices it at (`StepFit.draft_scale`)."""
        f = self._cached_fit(base_rows, always=True)
        assert f is not None
        return f.draft_scale

    def catch_up_cost(self, base_rows: float) -> float:
        """What feeding the drafter one waiting position costs in a catch-up (`StepFit.catch_up_row`),
        asked near `base_rows`."""
        f = self._cached_fit(base_rows, always=True)
        assert f is not None
        return f.catch_up_row

    def _profiled_cost(self, base_rows: float, num_extra: int, logit_base: float
                       ) -> tuple[list[float], float, float]:
        """`step_cost` on the profiled shape: the forward at base + m rows is the local scale times
        the shape there (the shape is measured up to the largest batch, so no anchors), the rest of
        the step its line through the rows and logit rows."""
        f = self._cached_fit(base_rows, always=True)
        assert f is not None
        m = np.arange(num_extra + 1, dtype=np.float64)
        rows, logits = base_rows + m, logit_base + m
        times = (f.scale * self.shape(rows, logits, m) + f.fixed + f.per_row * (rows - logits)
                 + f.per_logit_row * logits + f.draft_row * m)
        s = f.draft_scale
        times = times[0] + s * (times - times[0])
        curve = np.maximum.accumulate(np.maximum(times, 1e-6)).tolist()
        return curve, s * (f.first_cost + f.verify_cost), s * f.pass_cost


def _envelope_from_below(seconds: np.ndarray) -> np.ndarray:
    """The largest non-decreasing curve at or below `seconds` (timings along rising batch sizes):
    each point the least of its own and every larger batch's time."""
    return np.minimum.accumulate(seconds[::-1])[::-1]


def _interp(x: np.ndarray | float, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Linear between the points (xs rising), along the first segment below them, never below 0;
    beyond them along the last segment or the slope over their upper half, the steeper. A profile
    that ends early (a slow CPU: SmolLM2 on Zen 1 stops at 64 rows) may end in a flat segment (a
    noisy spike at 49 rows, measured lower at 64, takes 64's time: 49 to 64 rows cost nothing):
    extended, it priced every row past 64 at nothing, and 32 requests drafted 3 each, steps of
    ~950 ms predicted at 560 (0.6x decoding without drafts)."""
    x = np.asarray(x, dtype=np.float64)
    if xs.size == 1:
        return np.maximum(ys[0] * x / max(xs[0], 1.0), 0.0)
    y = np.interp(x, xs, ys)
    half = min(int(np.searchsorted(xs, xs[-1] / 2)), xs.size - 2)
    hi = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), (ys[-1] - ys[half]) / (xs[-1] - xs[half]))
    lo = (ys[1] - ys[0]) / (xs[1] - xs[0])
    y = np.where(x > xs[-1], ys[-1] + hi * (x - xs[-1]), y)
    y = np.where(x < xs[0], ys[0] + lo * (x - xs[0]), y)
    return np.maximum(y, 0.0)


class Decision(NamedTuple):
    """A fresh decision of `AdaptiveDrafting.choose`, kept for reuse: over the requests that may
    draft (a cap above 0), in batch order."""

    key: tuple[tuple[str, ...], int]  # the ids of the requests that may draft, and the base rows
    caps: list[int]  # theirs
    lengths: list[int]  # theirs
    at: int  # the decision count it was taken at
    grid: int  # the step-cost fit's grid point of the base rows (`StepCostModel.grid_point`)
    # drafting every cap: predicted to beat drafting nothing by CORNER_CLEAR_GAIN; drafting nothing:
    # no draft length for every request predicted to beat it at all (`REUSE_DECISIONS`)
    clear: bool = True


class AdaptiveDrafting:
    """The scheduler's handle on the adaptive policy: request acceptance in, step costs in, draft
    lengths out. `drafter_passes`: the drafter runs a pass per draft position (model drafters),
    so the deepest request's length costs passes; n-gram lookup does not."""

    def __init__(self, k: int, drafter_passes: bool, logit_share: float = 0.0,
                 min_drafting_steps: int = MIN_DRAFTING_STEPS, lockstep: bool = False) -> None:
        self.k = k
        self.min_drafting_steps = min_drafting_steps
        self.drafter_passes = drafter_passes
        # Parking saves a drafter's prompt feeds and waits: a model drafter's, outside lockstep
        # (where every request feeds the drafter every step, as the vote sized its passes).
        self.may_park = drafter_passes and not lockstep
        self.acceptance = AcceptanceStats(k)
        self.costs = StepCostModel(logit_share=logit_share, feeds_every_row=lockstep and drafter_passes)
        self._decisions = 0
        self._last: Decision | None = None  # the last fresh decision
        self._quiet_from: int | None = None  # the first of the decisions in a row that drafted nothing
        self._quiet_rows = 0  # the fewest base rows among those decisions
        # How the last `choose` decided (the step log records it): "static" (every cap, too little
        # measured), "reused", "fresh", "explore" (one request a draft more), "wide" (every cap),
        # "quiet" (no request drafts: `QUIET_EXPLORE_EVERY`).
        self.last_decision = ""
        # With `explain` (the engine's step log is on), a fresh decision also leaves what the model
        # predicted in `last_prediction`: tokens per second of the lengths chosen, of drafting
        # nothing and of every request at its cap, the base rows and the draft rows chosen.
        self.explain = False
        self.last_prediction: dict[str, float] | None = None

    def parks(self, load: int) -> bool:
        """Whether requests that may draft and arrive now, `load` requests in the engine with them,
        are parked (`PARK_AFTER`; the scheduler lets every `PROBE_EVERY`-th through): not where the
        load is a grid point of the step-cost fits below every batch the policy drafted nothing
        for (the load fell: drafting may pay again, and a parked request could never draft)."""
        return (self.may_park and self._quiet_from is not None
                and self._decisions - self._quiet_from + 1 >= PARK_AFTER
                and self.costs.grid_point(load) >= self.costs.grid_point(self._quiet_rows))

    def choose(self, req_ids: list[str], caps: list[int], base_rows: int, lags: list[int] | None = None,
               extra_logit_rows: int = 0) -> list[int]:
        """Draft lengths for the requests that reach their end this step (verified next step, in
        a batch of about `base_rows` rows besides the drafts). Until a step of about that size
        (within the fit's cut) was measured, and `min_drafting_steps` steps ran the drafter, every
        request gets its cap (static drafting), which is also what gives the first measurements.
        `lags`: per request, the positions its drafter catch-up has waiting (fed when it drafts
        again; None: none wait). The policy
        itself does not price them (a request that drafts again later feeds them then anyway);
        the explorations do, being one-off: the one-request exploration takes the request with
        the shortest wait, and the whole batch at its caps is tried only where it comes within
        the margin with its catch-ups paid. The same requests and base rows as the last fresh
        decision, with caps no higher than it had and still holding its lengths, keep it for up
        to REUSE_DECISIONS decisions, up to the next exploration where it drafted nothing or every
        cap (`REUSE_DECISIONS`). `extra_logit_rows`: rows of `base_rows` besides one a request that
        compute logits (drafts decided elsewhere: a pinned request's, `SamplingParams.speculative_adaptive`)."""
        top = max(caps, default=0)
        if not req_ids or top == 0:
            self.last_decision = ""
            return list(caps)
        # (`drafted_near` asks for min_drafting_steps of the window's steps, so of the engine's life
        # too; a lookup runs no drafter pass: its drafting steps are those that verified drafts)
        if (not self.costs.measured_near(base_rows)
                or not self.costs.drafted_near(base_rows, self.min_drafting_steps, self.drafter_passes)):
            self._quiet_from = None  # drafting every cap
            self.last_decision = "static"
            return list(caps)
        if top > self.k:
            caps = [min(c, self.k) for c in caps]
        if 0 in caps:  # those that may draft, and their caps, in batch order
            key = (tuple(r for r, c in zip(req_ids, caps) if c), base_rows)
            own_caps = [c for c in caps if c]
        else:  # every request (the common case: plain tuple and list copies, no filtering)
            key, own_caps = (tuple(req_ids), base_rows), list(caps)
        grid = self.costs.grid_point(base_rows)
        self._decisions += 1
        reused = self._reuse(key, caps, own_caps, grid)
        if reused is not None:
            self.last_decision = "reused"
            return reused
        self.last_decision = "fresh"
        step_cost, first_cost, pass_cost = self.costs.step_cost(base_rows, sum(caps), len(req_ids) + extra_logit_rows)
        request_cost = self.costs.request_cost(base_rows)
        if not self.drafter_passes:  # a lookup: no passes (what verifying any drafts costs stays)
            pass_cost = 0.0
        if len(req_ids) * self.k <= SMALL_PROBLEM:  # plain Python: cheaper between forward passes
            rates = self.acceptance.rate_rows(req_ids, caps)
            lengths = choose_draft_lengths_small(rates, caps, step_cost, pass_cost, first_cost, DRAFT_MIN_GAIN,
                                                 request_cost)
        else:
            rates = self.acceptance.rates(req_ids, caps)
            lengths = choose_draft_lengths(rates, np.asarray(caps, dtype=np.int64), np.asarray(step_cost),
                                           pass_cost, first_cost, DRAFT_MIN_GAIN, request_cost).tolist()
        optimum = lengths
        lengths = prefer_uniform(rates, optimum, caps, step_cost, pass_cost, first_cost, request_cost,
                                 UNIFORM_MARGIN, DRAFT_MIN_GAIN)
        clear = True
        if any(lengths) and lengths == caps:  # the corner stands for long only where it wins clearly
            clear = (step_rate(rates, lengths, step_cost, pass_cost, first_cost, request_cost=request_cost)
                     >= (1.0 + CORNER_CLEAR_GAIN) * step_rate(rates, [0] * len(caps), step_cost, pass_cost))
        elif not any(lengths):  # so does drafting nothing, where no draft length is predicted to pay at all
            by_depth = uniform_rates(rates, caps, step_cost, pass_cost, first_cost, request_cost)
            clear = max(by_depth[1:]) <= by_depth[0]
        if self.explain:
            self.last_prediction = self._predict(rates, lengths, caps, step_cost, pass_cost, first_cost,
                                                 request_cost, base_rows, optimum)
        self._last = Decision(key, own_caps, [n for n, c in zip(lengths, caps) if c], self._decisions, grid, clear)
        if any(lengths):
            self._quiet_from = None
        elif self._quiet_from is None:
            self._quiet_from, self._quiet_rows = self._decisions, base_rows
        else:
            self._quiet_rows = min(self._quiet_rows, base_rows)
        if (self._decisions % QUIET_EXPLORE_EVERY == EXPLORE_EVERY and any(lengths)
                and self.costs.only_drafted_near(base_rows, QUIET_STEPS)):
            self.last_decision = "quiet"
            return [0] * len(caps)
        if self._decisions % WIDE_EXPLORE_EVERY == 0 and lengths != caps:
            waiting = sum(lag for lag, n, c in zip(lags, lengths, caps) if c > 0 and n == 0) if lags else 0
            catch_up = self.costs.catch_up_cost(base_rows) * waiting if waiting else 0.0
            deep = step_rate(rates, caps, step_cost, pass_cost, first_cost, catch_up, request_cost)
            if deep >= WIDE_EXPLORE_MARGIN * step_rate(rates, lengths, step_cost, pass_cost, first_cost,
                                                       request_cost=request_cost):
                self.last_decision = "wide"
                return list(caps)
        if self._decisions % EXPLORE_EVERY == 0:
            explored = list(lengths)
            i = explore(explored, caps, lags)
            if i is None:
                return lengths
            # a request that did not draft catches its drafter up first: its wait is part of the price
            lag = lags[i] if lags and lengths[i] == 0 else 0
            catch_up = self.costs.catch_up_cost(base_rows) * lag if lag else 0.0
            if (self._decisions % COSTLY_EXPLORE_EVERY == 0
                    or step_rate(rates, explored, step_cost, pass_cost, first_cost, catch_up, request_cost)
                    >= EXPLORE_MARGIN * step_rate(rates, lengths, step_cost, pass_cost, first_cost,
                                                  request_cost=request_cost)):
                self.last_decision = "explore"
                return explored
        return lengths

    def _predict(self, rates: np.ndarray | list[list[float]], lengths: list[int], caps: list[int],
                 step_cost: np.ndarray | list[float], pass_cost: float, first_cost: float, request_cost: float,
                 base_rows: int, optimum: list[int]) -> dict[str, float]:
        """What the cost model predicts for a fresh decision (`explain`): tokens per second of the
        lengths chosen, of drafting nothing and of every cap, and the drafting costs' scale; the
        parts of the chosen lengths' predicted time in milliseconds (`ms_step`: the step without
        drafts, `ms_rows`: what their rows add, `ms_first`, `ms_passes`, `ms_requests`: the
        first pass, the later passes, the drafting requests); where a uniform choice replaced a
        mixed optimum (`UNIFORM_MARGIN`), the optimum's tokens per second too."""
        def rate(d: list[int]) -> float:
            return round(step_rate(rates, d, step_cost, pass_cost, first_cost, request_cost=request_cost), 2)
        drafts, depth = sum(lengths), max(lengths, default=0)
        predicted = {"chosen": rate(lengths), "none": rate([0] * len(caps)), "caps": rate(list(caps)),
                     "base_rows": base_rows, "draft_rows": drafts,
                     "draft_scale": round(self.costs.draft_scale(base_rows), 3),
                     "ms_step": round(1e3 * float(step_cost[0]), 3),
                     "ms_rows": round(1e3 * float(step_cost[drafts] - step_cost[0]), 3),
                     "ms_first": round(1e3 * first_cost, 3) if depth else 0.0,
                     "ms_passes": round(1e3 * pass_cost * max(depth - 1, 0), 3),
                     "ms_requests": round(1e3 * request_cost * sum(1 for n in lengths if n), 3)}
        if optimum != lengths:
            predicted["mixed"] = rate(optimum)
        return predicted

    def _reuse(self, key: tuple[tuple[str, ...], int], caps: list[int], own_caps: list[int], grid: int
               ) -> list[int] | None:
        """The last fresh decision's lengths for this batch where it still stands
        (`REUSE_DECISIONS`), None where the batch is decided afresh (always when an exploration is
        due). One that drafted nothing where no draft length was predicted to pay stands for any
        batch near its grid point until the next exploration; one that gave every request its cap
        and wins clearly, until the next exploration too, for any batch within CORNER_GRID_REACH
        grid points of its own whose requests it knew have no higher caps and none deeper than its
        deepest (a new request gets its cap); any other, for REUSE_DECISIONS decisions, for the
        same requests and base rows while the caps that fell still hold its lengths."""
        last = self._last
        if last is None or self._decisions % EXPLORE_EVERY == 0:
            return None
        age = self._decisions - last.at
        if not any(last.lengths) and last.clear:
            return [0] * len(caps) if age < EXPLORE_EVERY and last.grid == grid else None
        if last.lengths == last.caps and last.clear:
            if age >= EXPLORE_EVERY or abs(last.grid - grid) > CORNER_GRID_REACH:
                return None
            if own_caps == last.caps and key[0] == last.key[0]:  # the same requests (the common case)
                return list(caps)
            if max(own_caps) > max(last.caps):
                return None
            known = dict(zip(last.key[0], last.caps))
            return list(caps) if all(c <= known.get(r, c) for r, c in zip(key[0], own_caps)) else None
        if age >= REUSE_DECISIONS:
            return None
        if last.key != key or not all(n <= c <= was for n, c, was in zip(last.lengths, own_caps, last.caps)):
            return None
        it = iter(last.lengths)
        return [next(it) if c else 0 for c in caps]

    def observe_verification(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.observe(req_id, num_drafts, num_accepted)

    def observe_verifications(self, verified: list[tuple[str, int, int]]) -> None:
        """A step's verifications, (req_id, num_drafts, num_accepted) each, in batch order."""
        self.acceptance.observe_all(verified)

    def observe_step(self, num_rows: int, seconds: float, drafter_seconds: float, drafter_passes: int,
                     num_logit_rows: int | None = None, num_draft_rows: int = 0, drafter_rows: int | None = None,
                     forward_seconds: float | None = None, drafter_pass_rows: int = 0, drafting_reqs: int = 0
                     ) -> None:
        self.costs.observe(num_rows, seconds, drafter_seconds, drafter_passes, num_logit_rows, num_draft_rows,
                           drafter_rows, forward_seconds, drafter_pass_rows, drafting_reqs)

    def forget(self, req_id: str) -> None:
        self.acceptance.forget(req_id)


def explore(lengths: list[int], caps: list[int], lags: list[int] | None = None) -> int | None:
    """One draft more, in place, for a request below its cap: the one with the shortest drafter
    catch-up waiting (`lags`; a drafting request has none), among those the longest length (a row
    more, and a pass more when it was the deepest), the first such in batch order. Returns its
    index (None: every request is at its cap)."""
    room = [i for i, (n, c) in enumerate(zip(lengths, caps)) if n < c]
    if not room:
        return None
    lag = lags if lags is not None else [0] * len(lengths)
    i = min(room, key=lambda i: (lag[i], -lengths[i], i))
    lengths[i] += 1
    return i
