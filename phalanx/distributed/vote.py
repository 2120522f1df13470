"""The lockstep vote: each rank's local facts in one fixed-shape row, and the pure function that
turns the gathered table into the step every rank runs.

Owns: the vote row layout (`VoteField`), `local_row`, `StepPlan`, `decide`.
Does not own: issuing the collective (``distributed.group``) or running the step (``engine``).

DESIGN §5 rules 1–4 live here: one row per rank per loop iteration; every decision below reads only
the gathered table, so all ranks derive the same plan; padding and the drafter's pass count and
pass sizes are part of the plan, never local choices.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class VoteField(enum.IntEnum):
    HAS_WORK = 0  # 1 if the rank holds unfinished requests
    NUM_TOKENS = 1  # tokens the rank's scheduler handed out this iteration
    NUM_REQS = 2  # requests in the rank's batch
    NUM_SAMPLING = 3  # requests that get drafts this step (reach their end; drafting not disabled)
    SHUTDOWN = 4  # 1 if the rank is stopping
    STEP = 5  # the rank's lockstep iteration counter (all must agree)


NUM_FIELDS = len(VoteField)


def local_row(
    has_work: bool, num_tokens: int, num_reqs: int, num_sampling: int, shutdown: bool, step: int
) -> torch.Tensor:  # [NUM_FIELDS] int64
    row = torch.zeros(NUM_FIELDS, dtype=torch.int64)
    row[VoteField.HAS_WORK] = int(has_work)
    row[VoteField.NUM_TOKENS] = num_tokens
    row[VoteField.NUM_REQS] = num_reqs
    row[VoteField.NUM_SAMPLING] = num_sampling
    row[VoteField.SHUTDOWN] = int(shutdown)
    row[VoteField.STEP] = step
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
    """table [dp, NUM_FIELDS] -> the plan. A pure function: equal tables give equal plans.

    * A forward runs when any rank scheduled tokens; all pad to the largest batch (rule 4).
    * A model drafter runs pass 1 with every forward (it catches its KV up on the verified
      tokens), sized max(tokens + reqs) — a draft model also feeds each request's new token; it
      runs passes 2..k, sized max(sampling requests), iff any rank has a request to draft for
      (rule 3: all ranks or none, k uniform).
    """
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
        sampling = int(table[:, VoteField.NUM_SAMPLING].max())
        sizes = (first,) + ((sampling,) * (num_spec_tokens - 1) if sampling > 0 else ())
    return StepPlan(run_forward=run, num_tokens=num_tokens if run else 0, draft_pass_sizes=sizes,
                    shutdown=shutdown, step=step, any_work=bool(table[:, VoteField.HAS_WORK].any()))
