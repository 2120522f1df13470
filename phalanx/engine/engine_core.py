"""The engine core: one scheduler + one model runner, stepped in a loop. Token ids only.

Owns: request intake (validation against the vocabulary and context length, resolving
max_tokens), the step (`schedule -> execute -> update`), aborts and statistics.
Does not own: text (the front end's ``output_processor``), processes and sockets
(``engine.core_process``), the data-parallel loop (``distributed``).
"""

from __future__ import annotations

import json
import os
import time
from typing import TextIO

from phalanx.config import EngineConfig, ModelConfig
from phalanx.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from phalanx.core.scheduler import Scheduler
from phalanx.distributed.group import DPGroup
from phalanx.distributed.vote import StepPlan, decide, depth_counts, local_row
from phalanx.engine.protocol import EngineCoreRequest, validate_prompt_tokens, validate_resumed_tokens
from phalanx.request import Request
from phalanx.spec_decode.adaptive import AdaptiveDrafting
from phalanx.worker.model_runner import ModelRunner


def logit_share(model: ModelConfig) -> float:
    """The lm_head's share of a row's compute, relative to the rest of the model (per token)."""
    head = model.vocab_size * model.hidden_size
    return head / max(model.active_parameters() - head, 1)


# Debugging aid: a path; every engine process appends one JSON line per step to PATH.<pid> (`_log_step`).
STEP_LOG_ENV = "PHALANX_DEBUG_STEP_LOG"

# The adaptive policy's step-time profile runs batches of up to this many rows (beyond: extrapolated).
PROFILE_MAX_ROWS = 256

# A step whose engine thread got less CPU time than this share of the step's wall time was
# preempted (other processes on the same cores: the API server, a client) and tells the policy
# about them, not about what it chose: it is left out of the step-cost model (outside lockstep,
# whose steps wait for the other ranks by design). Alone, the thread runs >= 0.96 of every step
# (the demo and SmolLM2 offline, 2 threads); served at 32 requests on 2 cores with the benchmark's
# client beside it, single steps took 2-4x their neighbours' time, and fits on them had the policy
# draft nothing for spells of tens of steps where k = 3 paid ~1.5x.
MIN_CPU_SHARE = 2 / 3


class EngineCore:
    def __init__(self, cfg: EngineConfig, group: DPGroup | None = None) -> None:
        self.cfg = cfg
        self.group = group
        self.lockstep = cfg.parallel.lockstep(cfg.model.is_moe)
        if self.lockstep and group is None:
            raise ValueError("lockstep data parallelism needs the data-parallel group")
        self.runner = ModelRunner(cfg, group)
        spec = cfg.speculative
        # The adaptive draft-length policy learns from this engine's own step times (in lockstep:
        # of the padded steps it runs with the others) and its requests' acceptance.
        self.adaptive = (
            AdaptiveDrafting(spec.num_speculative_tokens, drafter_passes=self.runner.num_lookahead_slots > 0,
                             logit_share=logit_share(cfg.model),
                             lockstep=self.lockstep)
            if spec is not None and spec.adaptive
            else None
        )
        if self.adaptive is not None and self.runner.expert_shard is None:
            # The shape of step time against rows, measured now, while nothing else runs (3-5 s on
            # a 135M model on 2 cores; not under expert parallelism, whose forward has partners).
            # Also at k + 1 rows to a sequence, as the drafts are verified.
            self.adaptive.costs.set_profile(*self.runner.profile_step_curve(
                min(PROFILE_MAX_ROWS, cfg.scheduler.max_num_batched_tokens), group=spec.num_speculative_tokens + 1
            ))
        self.scheduler = Scheduler(
            cfg.scheduler,
            cfg.cache,
            self.runner.num_blocks,
            num_spec_tokens=spec.num_speculative_tokens if spec is not None else 0,
            num_lookahead_slots=self.runner.num_lookahead_slots,
            disable_by_batch_size=spec.disable_by_batch_size if spec is not None else None,
            adaptive=self.adaptive,
        )
        # the last step's observation for the adaptive policy, waiting for the next step's start
        self._last_step: tuple[dict, float, float, bool, bool] | None = None
        self.num_preempted_steps = 0  # steps left out of the step-cost model (MIN_CPU_SHARE)
        self.num_steps = 0
        self.step_seconds = 0.0  # wall time inside step(), for the engine-overhead figure
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        path = os.environ.get(STEP_LOG_ENV)
        self._step_log: TextIO | None = open(f"{path}.{os.getpid()}", "a", buffering=1) if path else None  # noqa: SIM115
        if self.adaptive is not None:
            self.adaptive.explain = self._step_log is not None
            if self._step_log is not None and self.adaptive.costs.measured_profile is not None:
                # the shape the policy prices rows on, so that a replay of the log prices them alike
                self._step_log.write(json.dumps({"profile": self.adaptive.costs.measured_profile._asdict(),
                                                 "logit_share": self.adaptive.costs.logit_share,
                                                 "feeds_every_row": self.adaptive.costs.feeds_every_row}) + "\n")

    @property
    def max_model_len(self) -> int:
        return self.cfg.scheduler.max_model_len

    @property
    def num_speculative_tokens(self) -> int:
        """The most drafts a request gets per step (0: no speculative decoding)."""
        spec = self.cfg.speculative
        return spec.num_speculative_tokens if spec is not None else 0

    @property
    def adaptive_speculation(self) -> bool:
        """Whether the draft length is the adaptive policy's (`"adaptive": true`)."""
        return self.adaptive is not None

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        validate_prompt_tokens(prompt_token_ids, self.cfg.model.vocab_size, self.max_model_len)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.validate_prompt(request.prompt_token_ids)
        params = request.sampling_params
        params.check_token_ids(self.cfg.model.vocab_size)
        params.check_speculation(self.num_speculative_tokens, self.adaptive is not None)
        room = params.check_room(len(request.prompt_token_ids), self.max_model_len)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        produced = request.output_token_ids
        if produced:
            validate_resumed_tokens(produced, self.cfg.model.vocab_size, max_tokens)
        req = Request(
            req_id=request.req_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.cfg.model.eos_token_ids,
            arrival_time=request.arrival_time or time.monotonic(),
            max_tokens=max_tokens,
            group_id=request.group_id,
            output_token_ids=list(produced),
        )
        self.scheduler.add_request(req)
        self.num_prompt_tokens += len(req.prompt_token_ids)

    def abort_requests(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        aborted = self.scheduler.abort_requests(req_ids)
        return [EngineCoreOutput(req_id=r.req_id, new_token_ids=[], finish_reason="abort") for r in aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _thread_time(self) -> float:
        """The engine thread's CPU seconds (`time.thread_time`, a system call) where something reads
        a step's CPU time (the adaptive policy, the step log); 0 elsewhere."""
        return time.thread_time() if self.adaptive is not None or self._step_log is not None else 0.0

    def step(self) -> list[EngineCoreOutput]:
        t0, cpu0 = time.perf_counter(), self._thread_time()
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.finished_req_ids:
            return []
        outputs = self._execute(sched, None, t0, cpu0)
        self.step_seconds += time.perf_counter() - t0
        return outputs

    def _execute(self, sched: SchedulerOutput, plan: StepPlan | None, t0: float, cpu0: float
                 ) -> list[EngineCoreOutput]:
        """Run the step; `t0`: when it began (its scheduling, and in lockstep its vote, included),
        `cpu0`: the engine thread's CPU time then (`time.thread_time`)."""
        drafter_before, forward_before = self.runner.drafter_seconds, self.runner.forward_seconds
        result = self.runner.execute(sched, plan)
        outputs = self.scheduler.update_from_output(sched, result)
        self.num_steps += 1
        emitted = sum(len(o.new_token_ids) for o in outputs)
        self.num_generation_tokens += emitted
        if self._step_log is None and self.adaptive is None:
            return outputs
        num_draft_rows = sum(len(d) for d in sched.scheduled_spec_tokens.values())
        if self._step_log is not None:
            self._log_step(sched, result, t0, cpu0, forward_before, drafter_before, num_draft_rows, emitted)
        if self.adaptive is not None:
            self._observe_step(t0, cpu0, dict(
                num_rows=plan.num_tokens if plan is not None else sched.total_num_scheduled_tokens,
                drafter_seconds=self.runner.drafter_seconds - drafter_before,
                forward_seconds=self.runner.forward_seconds - forward_before,
                drafter_passes=result.num_drafter_passes,
                drafter_rows=result.drafter_rows_fed,
                drafter_pass_rows=result.drafter_pass_rows,
                drafting_reqs=result.drafting_reqs,
                num_logit_rows=len(sched.reaching_end) + num_draft_rows,
                num_draft_rows=num_draft_rows,
            ))
        return outputs

    def _log_step(self, sched: SchedulerOutput, result: ModelRunnerOutput, t0: float, cpu0: float,
                  forward_before: float, drafter_before: float, num_draft_rows: int, emitted: int) -> None:
        """One JSON line for the step (``PHALANX_DEBUG_STEP_LOG``): `t0` / `t1` its start and end
        (perf_counter seconds: the gap to the next `t0` is the loop's work between steps), `rows` the
        tokens through the target, `logit_rows` those of them that compute logits, `reqs` the requests
        scheduled, `drafts` the draft rows verified, `passes` the drafter passes run for the next step,
        `drafter_rows` the positions its first fed and `drafter_pass_rows` those its later passes fed,
        `drafting` the requests it drafted for, `forward` / `drafter` the seconds in the target's forward
        and in the drafter, `tokens` the tokens the step emitted, `cpu` the engine thread's CPU seconds in
        it (below `t1 - t0`: preempted), `decision` how the adaptive policy chose the lengths this step's
        scheduling gave (`AdaptiveDrafting.last_decision`; empty: no choice to make, or no adaptive
        policy) and, for a fresh decision, `predicted`: the tokens per second the cost model gave the
        lengths chosen, drafting nothing and every cap (`AdaptiveDrafting.last_prediction`). What tells
        where a step's time goes, per batch shape, and which term tipped a decision. An adaptive engine's
        log starts with the profile its policy prices rows on (``benchmarks/step_log.py`` replays a log
        into a cost model on it)."""
        assert self._step_log is not None
        decision, predicted = "", None
        if self.adaptive is not None:  # a step that chose nothing records nothing
            decision, self.adaptive.last_decision = self.adaptive.last_decision, ""
            predicted, self.adaptive.last_prediction = self.adaptive.last_prediction, None
        self._step_log.write(json.dumps({
            "t0": t0, "t1": time.perf_counter(), "cpu": time.thread_time() - cpu0,
            "rows": sched.total_num_scheduled_tokens,
            "logit_rows": len(sched.reaching_end) + num_draft_rows,
            "reqs": len(sched.num_scheduled_tokens),
            "drafts": num_draft_rows,
            "passes": result.num_drafter_passes, "drafter_rows": result.drafter_rows_fed,
            "drafter_pass_rows": result.drafter_pass_rows, "drafting": result.drafting_reqs,
            "forward": self.runner.forward_seconds - forward_before,
            "drafter": self.runner.drafter_seconds - drafter_before,
            "tokens": emitted,
            "decision": decision,
            **({"predicted": predicted} if predicted is not None else {}),
        }) + "\n")

    def _observe_step(self, t0: float, cpu0: float, step: dict) -> None:
        """Give the adaptive policy the previous step, timed from its start to this one's when the
        engine went straight on (requests in flight): what the loop does between steps (sending
        outputs, taking new requests in, in an API server; detokenizing, offline) is paid once per
        step, so fewer, longer steps save it, and it belongs in the step's time. After an idle
        spell the previous step counts its own time only. This step waits for the next. A step
        preempted for more than a third of its own time (`MIN_CPU_SHARE`; not in lockstep) is
        left out."""
        assert self.adaptive is not None
        now = time.perf_counter()
        ran = self.lockstep or time.thread_time() - cpu0 >= MIN_CPU_SHARE * (now - t0)
        if not ran:
            self.num_preempted_steps += 1
        if self._last_step is not None:
            last, start, end, went_on, kept = self._last_step
            if kept:
                self.adaptive.observe_step(seconds=(t0 if went_on else end) - start, **last)
        self._last_step = (step, t0, now, self.has_unfinished_requests(), ran)

    # ---- data-parallel lockstep (DESIGN §5) ------------------------------------------------
    def step_lockstep(
        self, shutdown: bool = False, expecting_work: bool = False
    ) -> tuple[list[EngineCoreOutput], StepPlan]:
        """One lockstep iteration: schedule locally, vote (the iteration's one agreement
        collective), then run exactly what the plan says — a padded real step, a padded dummy
        step when this rank has nothing, or nothing at all. Every rank calls this every iteration,
        idle or not (rule 6)."""
        assert self.group is not None
        t0, cpu0 = time.perf_counter(), self._thread_time()
        sched = self.scheduler.schedule()
        k = self.num_speculative_tokens
        # Requests drafting at least 1, 2, .., k tokens: the drafter's passes are sized from these.
        counts = depth_counts(list(sched.draft_lengths.values()), k)
        row = local_row(
            has_work=self.has_unfinished_requests() or expecting_work,
            num_tokens=sched.total_num_scheduled_tokens,
            num_reqs=len(sched.num_scheduled_tokens),
            num_sampling=counts[0] if counts else 0,
            shutdown=shutdown,
            step=self.group.step,
            deeper=counts[1:],
        )
        table = self.group.vote(row)
        plan = decide(table, k, drafter_runs_passes=self.runner.num_lookahead_slots > 0)
        self.group.step += 1
        if plan.shutdown or not plan.run_forward:
            # Nothing scheduled anywhere; the runner still drops finished requests' state.
            self.runner.execute(sched, plan)
            return [], plan
        return self._execute(sched, plan, t0, cpu0), plan

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()
