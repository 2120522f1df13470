"""The lockstep vote: each rank's local facts in one fixed-shape row, and the pure function that
turns the gathered table into the step every rank runs.

Owns: the vote row layout (`VoteField`, then one column per draft depth 2..k), `local_row`,
`depth_counts`, `StepPlan`, `decide`.
Does not own: issuing the collective (``distributed.group``) or running the step (``engine``).

DESIGN §5 rules 1–4 live here: one row per rank per loop iteration; every decision below reads only
the gathered table, so all ranks derive the same plan; padding and the drafter's pass count and
pass sizes are part of the plan, never local choices. Draft lengths may differ per request (a
request's cap, the adaptive policy): each rank votes how many of its requests draft at least j
tokens for every depth j, and drafter pass j runs, on every rank, sized by the largest of those
counts, iff some rank has a request that drafts j tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class VoteField(enum.IntEnum):
    HAS_WORK = 0  # 1 if the rank holds unfinished requests
    NUM_TOKENS = 1  # tokens the rank's scheduler handed out this iteration
    NUM_REQS = 2  # requests in the rank's batch
    NUM_SAMPLING = 3  # requests that get drafts this step (at least one; depth 2.. follow the fields)
    SHUTDOWN = 4  # 1 if the rank is stopping
    STEP = 5  # the rank's lockstep iteration counter (all must agree)


NUM_FIELDS = len(VoteField)  # then k - 1 columns: requests drafting at least 2, 3, .., k tokens


def row_width(num_spec_tokens: int) -> int:
    return NUM_FIELDS + max(num_spec_tokens - 1, 0)


def depth_counts(draft_lengths: list[int], num_spec_tokens: int) -> list[int]:
    """Requests drafting at least j tokens, for j = 1..k: lengths [3, 1, 0, 2], k 3 -> [3, 2, 1]."""
    return [sum(1 for d in draft_lengths if d >= j) for j in range(1, num_spec_tokens + 1)]


def local_row(
    has_work: bool,
    num_tokens: int,
    num_reqs: int,
    num_sampling: int,
    shutdown: bool,
    step: int,
    deeper: list[int] | tuple[int, ...] = (),
) -> torch.Tensor:  # [NUM_FIELDS + len(deeper)] int64
    """`num_sampling`: requests drafting at least one token; `deeper`: at least 2, 3, .., k tokens
    (k - 1 counts: the row's width is fixed by the engine's k, the same on every rank)."""
    row = torch.zeros(NUM_FIELDS + len(deeper), dtype=torch.int64)
    row[VoteField.HAS_WORK] = int(has_work)
    row[VoteField.NUM_TOKENS] = num_tokens
    row[VoteField.NUM_REQS] = num_reqs
    row[VoteField.NUM_SAMPLING] = num_sampling
    row[VoteField.SHUTDOWN] = int(shutdown)
    row[VoteField.STEP] = step
    row[NUM_FIELDS:] = torch.tensor(list(deeper), dtype=torch.int64)
    return row


@dataclass(frozen=True)
class StepPlan:
    run_forward: bool  # every rank runs a target forward (idle ranks a padded dummy)
    num_tokens: int  # padded target batch size, the same on every rank
    # Padded token count of each drafter pass (empty: the drafter does not run this step).
    draft_pass_sizes: tuple[int, ...]
    shutdown: bool
    step: int
    any_work: bool  # some rank holds unfinished (or announced) requests


class VoteMismatch(RuntimeError):
    pass


def decide(table: torch.Tensor, num_spec_tokens: int, drafter_runs_passes: bool) -> StepPlan:
    """table [dp, row_width(k)] -> the plan. A pure function: equal tables give equal plans.

    * A forward runs when any rank scheduled tokens; all pad to the largest batch (rule 4).
    * A model drafter runs pass 1 with every forward (it catches its KV up on the verified
      tokens), sized max(tokens + reqs) — a draft model also feeds each request's new token; it
      runs pass j (j = 2..k), sized max over ranks of the requests drafting at least j tokens,
      iff that is > 0 (rule 3: all ranks or none; the passes are the deepest request's, agreed).
    """
    if table.shape[1] != row_width(num_spec_tokens):
        raise VoteMismatch(
            f"vote rows have {table.shape[1]} fields; k = {num_spec_tokens} needs {row_width(num_spec_tokens)}"
        )
    steps = table[:, VoteField.STEP]
    if not bool((steps == steps[0]).all()):
        raise VoteMismatch(f"ranks are at different lockstep iterations: {steps.tolist()}")
    step = int(steps[0])
    shutdown = bool(table[:, VoteField.SHUTDOWN].any())
    num_tokens = int(table[:, VoteField.NUM_TOKENS].max())
    run = num_tokens > 0 and not shutdown
    sizes: tuple[int, ...] = ()
    if run and drafter_runs_passes and num_spec_tokens > 0:
        first = int((table[:, VoteField.NUM_TOKENS] + table[:, VoteField.NUM_REQS]).max())
        # Column j - 2 of the tail: requests drafting at least j tokens; max over ranks per depth.
        deeper = table[:, NUM_FIELDS:].max(dim=0).values.tolist() if num_spec_tokens > 1 else []
        later = []
        for count in deeper:
            if count <= 0:  # nobody drafts this deep, so nobody drafts deeper either
                break
            later.append(int(count))
        sizes = (first, *later)
    return StepPlan(run_forward=run, num_tokens=num_tokens if run else 0, draft_pass_sizes=sizes,
                    shutdown=shutdown, step=step, any_work=bool(table[:, VoteField.HAS_WORK].any()))
