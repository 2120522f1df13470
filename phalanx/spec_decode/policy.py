"""The adaptive draft-length policy: a pure function from acceptance estimates and step costs to
each request's draft length for the next step.

Owns: `choose_draft_lengths` (the decision), `choose_draft_lengths_small` (the same in plain
Python), `prefer_uniform` (a mixed-depth choice against the uniform ones: *Uniform first* below),
`uniform_rates`, `expected_tokens` (the objective's numerator) and `step_rate` (the objective).
Does not own: measuring anything (``spec_decode.adaptive`` keeps the running acceptance counts and
the step-cost curve), applying caps from the request or the batch (``core.scheduler``), or how
ranks in lockstep agree on the drafter passes (the vote: ``distributed.vote``).

The cost model. A step in which the R requests that reach their end get d_1..d_R drafts (verified
in the next step) yields, in expectation,

    tokens(d) = R + sum_i sum_{j <= d_i} g_ij,   g_ij = a_i1 * a_i2 * ... * a_ij

where a_ij is request i's acceptance rate at draft position j given that positions 1..j-1 were
accepted (g_ij is the probability that draft j is accepted: each request emits its accepted drafts
plus one token). It costs

    time(d) = step_cost[sum_i d_i] + first_cost * [d != 0] + pass_cost * max(max_i d_i - 1, 0)
              + request_cost * #{i : d_i > 0}

where step_cost[m] is the predicted time of the step with m draft rows added to the batch (the
target's verification of the extra rows, measured at the current batch size; non-decreasing in m),
first_cost what drafting anything costs besides its rows (a model drafter's first pass, run only
when some request drafts: the others' catch-up waits; and verifying drafts at all), pass_cost
one more drafter pass (n-gram lookup runs no passes: 0) and request_cost what a request drafting
at all costs besides its rows (the drafter's work per request: feeding it the positions its last
step accepted, building its rows of the pass; a lookup's search).
The policy maximises tokens per unit of time, tokens(d) / time(d), and drafts at all only where
that beats drafting nothing by more than `min_gain` (a share: the model's error margin).

Why the search is exact and small. For a fixed largest depth D and a fixed number of draft rows m
the time is fixed, so the best choice is the m largest gains among positions j <= min(cap_i, D);
since g_ij never increases with j, those m positions are a prefix of each request's positions
(ties are broken towards the earlier position), i.e. valid draft lengths. Every vector d is
dominated by the (D = max d, m = sum d) candidate, so the best over all (D, m) is the optimum.
Restricted to j <= D the gains keep one order for every D, so one sort of the R * k gains and one
[k, R * k] cumulative sum cover every candidate (about 20 numpy operations a step).

With a cost per drafting request the candidates are the same prefixes of the gain order, each
priced exactly (a position 1 taken adds request_cost). That is still exact where every candidate
drafts at most one deep (D = 1: each row is a request's first) or for one request; elsewhere a
choice that drafts deeper for fewer requests where the gain order takes the next request's first
draft first is not searched apart: on 20,000 random problems of up to 4 requests and 4
positions, with request costs up to a step's, the choice missed the brute-force optimum in 3, by
5 % at worst.

Uniform first. The optimum above may give requests different depths (their rates differ). Such a
choice carries costs the model leaves out: a request dropped to no drafts leaves its drafter
behind and pays the catch-up when it drafts again, one drafting deeper than the rest adds a pass
for the whole batch, and which requests get which depth turns on per-request estimates that
move every step, so the choice changes from step to step and is decided afresh where a uniform
one is reused. `prefer_uniform` keeps such a choice only where it beats every uniform choice
(each request min(j, its cap), j = 1..k) by more than a margin, and otherwise takes the best
uniform one (or nothing, where that does not beat drafting nothing by the minimum gain): where
the model cannot tell the choices apart by more than its error, the policy serves what a fixed
draft length would.
"""

from __future__ import annotations

import numpy as np


def expected_tokens(
    accept: np.ndarray | list[list[float]],  # [R, k] conditional acceptance rate per draft position
    lengths: np.ndarray | list[int],  # [R] draft lengths
) -> float:
    """Expected tokens the R requests emit in a step that verifies `lengths` drafts each (rates
    clipped to [0, 1]). In plain Python, request by request: the policy calls it between forward
    passes (`step_rate`), where each numpy call's first touch of cold caches costs more than this
    loop (~50 us a call at 16 requests through numpy, ~15 this way)."""
    rows = accept.reshape(len(lengths), -1).tolist() if isinstance(accept, np.ndarray) else accept
    tokens = float(len(lengths))
    for row, n in zip(rows, lengths):
        g = 1.0
        for j in range(int(n)):
            g *= min(max(row[j], 0.0), 1.0)
            tokens += g
    return tokens


def step_rate(
    accept: np.ndarray | list[list[float]],  # [R, k] conditional acceptance rate per draft position
    lengths: list[int],  # [R] draft lengths
    step_cost: list[float],  # [sum of lengths + 1 at least]
    pass_cost: float,
    first_cost: float = 0.0,
    extra_time: float = 0.0,  # anything else the choice costs (a catch-up it starts)
    request_cost: float = 0.0,
) -> float:
    """The objective of a choice: expected tokens per second of a step that drafts `lengths`."""
    tokens = expected_tokens(accept, lengths)
    depth = max(lengths, default=0)
    drafting = sum(1 for n in lengths if n > 0)
    time = (step_cost[sum(lengths)] + (first_cost + pass_cost * (depth - 1) if depth else 0.0)
            + request_cost * drafting + extra_time)
    return tokens / time


def choose_draft_lengths(
    accept: np.ndarray,  # [R, k] float in [0, 1]: P(draft j accepted | drafts 1..j-1 accepted)
    caps: np.ndarray,  # [R] int in [0, k]: the most drafts each request may get
    step_cost: np.ndarray,  # [M + 1], M = caps.sum(): step time with m draft rows, non-decreasing, > 0
    pass_cost: float,  # time of one drafter pass after the first (0: no passes)
    first_cost: float = 0.0,  # what drafting anything costs besides its rows (first pass, verification)
    min_gain: float = 0.0,  # drafting must beat drafting nothing by more than this share
    request_cost: float = 0.0,  # what each request that drafts at all costs besides its rows
) -> np.ndarray:  # [R] int64, 0 <= lengths <= caps
    """The draft lengths that maximise expected tokens per unit of step time (module docstring),
    or none where the best beats drafting nothing by `min_gain` or less. Pure: reads its arguments
    only, changes none of them. Among equally good choices it takes the one with the fewest
    passes, then the fewest draft rows."""
    num_reqs, k = accept.shape
    caps = np.minimum(np.asarray(caps, dtype=np.int64), k)  # [R]
    lengths = np.zeros(num_reqs, dtype=np.int64)
    max_depth = int(caps.max(initial=0))
    if num_reqs == 0 or max_depth == 0:
        return lengths
    if step_cost.shape[0] < int(caps.sum()) + 1:
        raise ValueError(f"step_cost needs {int(caps.sum()) + 1} entries (0..sum of caps), got {step_cost.shape[0]}")
    # Every allowed position once, largest gain first (earlier position on ties): for each depth D
    # the allowed positions j <= D keep this order, so one sort serves every D.
    gains = np.cumprod(np.clip(accept, 0.0, 1.0), axis=1)  # [R, k] non-increasing along each row
    position = np.arange(1, k + 1)  # [k]
    allowed = position[None, :] <= caps[:, None]  # [R, k]
    g, pos = gains[allowed], np.broadcast_to(position, (num_reqs, k))[allowed]  # [n] each
    order = np.lexsort((pos, -g))
    g, pos = g[order], pos[order]
    depths = np.arange(1, max_depth + 1)  # [D]
    within = pos[None, :] <= depths[:, None]  # [D, n]: position usable at depth cap D
    rows = np.cumsum(within, axis=1)  # [D, n] draft rows m after taking items 0..t at depth cap D
    total = np.cumsum(np.where(within, g[None, :], 0.0), axis=1)  # [D, n] their gain
    time = step_cost[rows] + first_cost + pass_cost * (depths[:, None] - 1)  # [D, n]
    if request_cost:  # each position 1 taken is one more request drafting
        time = time + request_cost * np.cumsum(within & (pos == 1)[None, :], axis=1)
    ratio = (num_reqs + total) / time  # [D, n]
    best = int(np.argmax(ratio))  # the first maximum: fewest passes, then fewest rows
    if not ratio.flat[best] > (num_reqs / float(step_cost[0])) * (1.0 + max(min_gain, 1e-12)):
        return lengths  # drafting nothing is at least as good (or not worse by more than min_gain)
    d, t = divmod(best, ratio.shape[1])
    chosen = np.nonzero(allowed)[0][order[: t + 1][within[d, : t + 1]]]  # request of each chosen position
    np.add.at(lengths, chosen, 1)  # a prefix of each request's positions: its length
    return lengths


def choose_draft_lengths_small(
    accept: list[list[float]],  # [R][k] conditional acceptance rate per draft position
    caps: list[int],  # [R]
    step_cost: list[float],  # [sum of caps + 1]
    pass_cost: float,
    first_cost: float = 0.0,
    min_gain: float = 0.0,
    request_cost: float = 0.0,
) -> list[int]:
    """`choose_draft_lengths` in plain Python, the same choice computed the same way (the same
    order, the same sums, the same ties): between forward passes, where the scheduler runs with cold
    caches, twenty numpy calls cost more than this loop up to ~190 candidate positions."""
    num_reqs = len(accept)
    k = len(accept[0]) if accept else 0
    gains: list[float] = []  # allowed positions, request by request, positions ascending
    pos: list[int] = []
    owner: list[int] = []
    for i, (row, cap) in enumerate(zip(accept, caps)):
        g = 1.0
        for j in range(min(cap, k)):
            g = g * min(max(row[j], 0.0), 1.0) if j else min(max(row[j], 0.0), 1.0)
            gains.append(g)
            pos.append(j + 1)
            owner.append(i)
    lengths = [0] * num_reqs
    if not gains:
        return lengths
    keys = list(zip([-g for g in gains], pos))
    order = sorted(range(len(gains)), key=keys.__getitem__)  # stable, like np.lexsort
    best_ratio, best = -1.0, (0, -1)
    for depth in range(1, max(pos) + 1):
        rows, total, firsts = 0, 0.0, 0
        for t, item in enumerate(order):
            if pos[item] <= depth:
                rows += 1
                total += gains[item]
                firsts += pos[item] == 1
            ratio = (num_reqs + total) / (step_cost[rows] + first_cost + pass_cost * (depth - 1)
                                          + request_cost * firsts)
            if ratio > best_ratio:  # the first maximum: fewest passes, then fewest rows
                best_ratio, best = ratio, (depth, t)
    if not best_ratio > (num_reqs / step_cost[0]) * (1.0 + max(min_gain, 1e-12)):
        return lengths
    depth, last = best
    for item in order[: last + 1]:
        if pos[item] <= depth:
            lengths[owner[item]] += 1
    return lengths


def _as_lists(accept: np.ndarray | list[list[float]], caps: list[int], step_cost: np.ndarray | list[float]
              ) -> tuple[list[list[float]], list[float]]:
    """The rates [R][k] and step costs as plain lists (the uniform-choice helpers loop in Python)."""
    rows_of = accept.reshape(len(caps), -1).tolist() if isinstance(accept, np.ndarray) else accept
    cost = step_cost.tolist() if isinstance(step_cost, np.ndarray) else step_cost
    return rows_of, cost


def uniform_rates(
    accept: np.ndarray | list[list[float]],  # [R, k] conditional acceptance rate per draft position
    caps: list[int],  # [R]
    step_cost: np.ndarray | list[float],  # [sum of caps + 1]
    pass_cost: float,
    first_cost: float = 0.0,
    request_cost: float = 0.0,
) -> list[float]:  # [max cap + 1]
    """Expected tokens per second of every uniform choice: [j] = every request drafting min(j, its
    cap), j = 0 (nothing) .. the largest cap. Plain Python, one pass over the rates."""
    rows_of, cost = _as_lists(accept, caps, step_cost)
    top = max(caps, default=0)
    tokens = [float(len(caps))] * (top + 1)  # [j]: what the batch emits
    rows = [0] * (top + 1)  # [j]: the draft rows it verifies
    for row, cap in zip(rows_of, caps):
        g, acc = 1.0, 0.0
        for j in range(1, top + 1):
            if j <= cap:
                g *= min(max(row[j - 1], 0.0), 1.0)
                acc += g
            tokens[j] += acc
            rows[j] += min(j, cap)
    drafting = sum(1 for c in caps if c > 0)
    return [tokens[0] / cost[0]] + [
        tokens[j] / (cost[rows[j]] + first_cost + pass_cost * (j - 1) + request_cost * drafting)
        for j in range(1, top + 1)
    ]


def prefer_uniform(
    accept: np.ndarray | list[list[float]],  # [R, k] conditional acceptance rate per draft position
    lengths: list[int],  # [R] the policy's choice (`choose_draft_lengths`)
    caps: list[int],  # [R]
    step_cost: np.ndarray | list[float],  # [sum of caps + 1]
    pass_cost: float,
    first_cost: float = 0.0,
    request_cost: float = 0.0,
    margin: float = 0.0,  # a choice of mixed depths must beat the best uniform one by more than this share
    min_gain: float = 0.0,  # a uniform choice must beat drafting nothing by more than this share
) -> list[int]:
    """`lengths` where it drafts nothing, is uniform (every request min(D, its cap) for one D), or
    beats every uniform choice by more than `margin` in expected tokens per second; otherwise the
    uniform choice with the most (the shallowest among equals), or nothing where that beats
    drafting nothing by `min_gain` or less (module docstring: *Uniform first*). Pure."""
    if not any(lengths):
        return list(lengths)
    deepest = max(lengths)
    if all(n == min(deepest, c) for n, c in zip(lengths, caps)):
        return list(lengths)
    rates = uniform_rates(accept, caps, step_cost, pass_cost, first_cost, request_cost)
    best_j, best = 0, rates[0] * (1.0 + max(min_gain, 1e-12))
    for j in range(1, len(rates)):
        if rates[j] > best:
            best_j, best = j, rates[j]
    rows_of, cost = _as_lists(accept, caps, step_cost)
    ours = step_rate(rows_of, lengths, cost, pass_cost, first_cost, request_cost=request_cost)
    if ours > best * (1.0 + margin):
        return list(lengths)
    return [min(best_j, c) for c in caps]
