"""The scheduler: one rule, a token budget, FCFS admission, preemption by recompute.

Owns: the waiting queue and running list, the per-step token budget, block allocation through
``KVCacheManager``, preemption, aborts, each sampling request's draft length for the next step
(`_draft_lengths`: its cap, or the adaptive policy's choice within it), and applying a step's
results to requests (appending tokens, stop / length checks, draft acceptance bookkeeping).
Does not own: tensors, sampling, text, drafting (it only stores the drafts a proposer returned), or
the adaptive policy's estimates (``spec_decode.adaptive``).

The one rule: each step every running request, then each waiting request in arrival order, is
given `min(num_tokens_with_spec - num_computed_tokens, remaining budget)` tokens. A fresh prompt,
a prefill chunk, a resumed preempted request, a decode and a verification of k drafts are all just
that. When blocks run out, the most recently admitted running request is preempted (its blocks
are freed, `num_computed_tokens` goes back to 0, it returns to the head of the queue).
"""

from __future__ import annotations

from collections import deque

from phalanx.config import CacheConfig, SchedulerConfig
from phalanx.core.kv_cache_manager import KVCacheManager
from phalanx.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from phalanx.request import FinishReason, Request, RequestStatus
from phalanx.spec_decode.adaptive import PROBE_EVERY, AdaptiveDrafting


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        num_spec_tokens: int = 0,
        num_lookahead_slots: int = 0,
        disable_by_batch_size: int | None = None,
        adaptive: AdaptiveDrafting | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.num_spec_tokens = num_spec_tokens
        self.num_lookahead_slots = num_lookahead_slots
        self.disable_by_batch_size = disable_by_batch_size
        self.adaptive = adaptive  # None: every request drafts its cap (static k)
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._runner_knows: set[str] = set()
        self._finished_for_runner: set[str] = set()
        self.num_preemptions = 0
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * max(num_spec_tokens, 0)
        self.spec_draft_lengths = [0] * (num_spec_tokens + 1) if num_spec_tokens > 0 else []
        self.spec_num_parked = 0
        self._since_probe = 0  # requests parked since the policy's last probe (`_parks`)
        # Requests whose drafter catch-up waits after the last step: the first position it lacks
        # (`ModelRunnerOutput.drafter_kv_end`); the adaptive policy's explorations read the waits.
        self._drafter_waiting: dict[str, int] = {}

    # ---- intake ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {req.num_prompt_tokens} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for output"
            )
        req.status = RequestStatus.WAITING
        req.own_draft_cap = req.sampling_params.draft_cap(self.num_spec_tokens) if self.num_spec_tokens else 0
        # Drafting its cap every step, whatever the adaptive policy chooses for the others.
        req.pinned = req.own_draft_cap > 0 and req.sampling_params.speculative_adaptive is False
        if req.own_draft_cap > 0 and not req.pinned and self._parks():
            req.own_draft_cap, req.parked = 0, True
            self.spec_num_parked += 1
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort_requests(self, req_ids: list[str]) -> list[Request]:
        aborted = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.spec_token_ids = []
        if self.adaptive is not None:
            self.adaptive.forget(req.req_id)
        self.kv.free(req)
        del self.requests[req.req_id]
        if req.req_id in self._runner_knows:
            self._runner_knows.discard(req.req_id)
            self._finished_for_runner.add(req.req_id)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req, forget_hashes=False)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False
        reaching_end: set[str] = set()

        # 1. Running requests catch up first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(
                req.num_tokens_with_spec - req.num_computed_tokens,
                budget,
                self.max_model_len - req.num_computed_tokens,
            )
            if num_new <= 0:
                i += 1
                continue
            lookahead = self.num_lookahead_slots
            new_block_ids = self.kv.allocate_slots(req, num_new, num_lookahead=lookahead)
            while new_block_ids is None:
                victim = self.running.pop()  # lowest priority: the latest admitted
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                new_block_ids = self.kv.allocate_slots(req, num_new, num_lookahead=lookahead)
            if new_block_ids is None:
                break
            num_scheduled[req.req_id] = num_new
            # Drafts that did not fit in the budget are dropped, not deferred.
            num_spec = max(0, num_new - (req.num_tokens - req.num_computed_tokens))
            if num_spec:
                spec[req.req_id] = req.spec_token_ids[:num_spec]
            req.spec_token_ids = req.spec_token_ids[:num_spec]
            cached_reqs.append(CachedRequestData(req.req_id, new_block_ids, req.num_computed_tokens))
            if req.num_computed_tokens + num_new - num_spec == req.num_tokens:
                reaching_end.add(req.req_id)
            budget -= num_new
            i += 1

        # 2. Admit waiting requests in arrival order (not in a step that had to preempt).
        held_back: list[Request] = []
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._sibling_prefilling(req):
                held_back.append(self.waiting.popleft())
                continue
            # a request that drafts needs its prefix's drafter KV too (one that never drafts does not)
            drafts = req.own_draft_cap > 0
            hit_blocks, num_hit = self.kv.get_computed_blocks(req, need_drafter_kv=drafts)
            num_new = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            new_block_ids = self.kv.allocate_slots(req, num_new, hit_blocks, self.num_lookahead_slots)
            if new_block_ids is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            self.kv.prefix_queries += req.num_tokens
            self.kv.prefix_hits += num_hit
            block_ids = self.kv.block_ids(req.req_id)
            if req.req_id in self._runner_knows:
                assert resumed
                cached_reqs.append(CachedRequestData(req.req_id, block_ids, num_hit, resumed=True))
            else:
                self._runner_knows.add(req.req_id)
                new_reqs.append(
                    NewRequestData(
                        req.req_id,
                        req.prompt_token_ids,
                        req.sampling_params,
                        block_ids,
                        num_hit,
                        list(req.output_token_ids),
                        req.own_draft_cap > 0,
                    )
                )
            num_scheduled[req.req_id] = num_new
            if num_hit + num_new == req.num_tokens:
                reaching_end.add(req.req_id)
            budget -= num_new
        self.waiting.extendleft(reversed(held_back))

        finished = self._finished_for_runner
        self._finished_for_runner = set()
        total = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            scheduled_spec_tokens=spec,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
            reaching_end=reaching_end,
            # The lengths are verified next step, in a batch of about one row per request of this
            # one (this step's prefill chunks are behind it; next step's are not known yet).
            draft_lengths=self._draft_lengths(num_scheduled, reaching_end, len(num_scheduled)),
        )

    def _draft_lengths(self, num_scheduled: dict[str, int], reaching_end: set[str], base_rows: int) -> dict[str, int]:
        """How many drafts each request reaching its end gets proposed after this step (verified in
        the next one): its cap — the engine's k, lowered by the request's own `speculative` /
        `num_speculative_tokens`, by the room left before max_tokens / max_model_len, and 0 for
        every request when the batch holds more than `disable_by_batch_size` — or, in adaptive
        mode, what the policy chooses within the caps. The one source of these lengths for the
        runner, the proposer and the lockstep vote."""
        k = self.num_spec_tokens
        if k == 0:
            return {}
        req_ids = [r for r in num_scheduled if r in reaching_end]  # batch order
        off = self.disable_by_batch_size is not None and len(num_scheduled) > self.disable_by_batch_size
        reqs = [self.requests[r] for r in req_ids]
        caps = [0] * len(reqs) if off else [self._draft_cap(req) if req.own_draft_cap else 0 for req in reqs]
        if self.adaptive is None or not any(caps):
            lengths = caps
        else:
            # A pinned request (`speculative_adaptive=False`) drafts its cap; the policy chooses for
            # the others (a cap of 0 to it), the pinned drafts part of their batch (verified in it,
            # base rows to the policy). Positions each request's drafter catch-up has waiting (fed
            # when it drafts again) go with it.
            own = [0 if req.pinned else cap for req, cap in zip(reqs, caps)]
            pinned_rows = sum(caps) - sum(own)
            if any(own):
                waiting = self._drafter_waiting
                lags = [max(req.num_computed_tokens - waiting.get(req.req_id, 1 << 62), 0) if cap else 0
                        for req, cap in zip(reqs, own)]
                chosen = self.adaptive.choose(req_ids, own, base_rows + pinned_rows, lags, extra_logit_rows=pinned_rows)
                # the policy gives 0 where its cap is 0: a pinned request's length is its cap
                lengths = [n + cap - o for n, cap, o in zip(chosen, caps, own)] if pinned_rows else chosen
            else:
                lengths = caps
        for d in lengths:
            self.spec_draft_lengths[d] += 1
        return dict(zip(req_ids, lengths))

    def _draft_cap(self, req: Request) -> int:
        """The request's own cap, and the room for drafts after this step's token (`_clip_drafts`
        with one new token: more tokens only leave less room, and the drafts are clipped then)."""
        out = len(req.output_token_ids)
        room = min(req.max_tokens - out, self.max_model_len - len(req.prompt_token_ids) - out) - 2
        return max(min(req.own_draft_cap, room), 0)

    def _parks(self) -> bool:
        """Whether a request that may draft, arriving now, is parked (it runs as opted out for good):
        the adaptive policy has drafted nothing for a while (`AdaptiveDrafting.parks`), and it is
        not the `PROBE_EVERY`-th such arrival since the last probe."""
        if self.adaptive is None or not self.adaptive.parks(len(self.running) + len(self.waiting) + 1):
            return False
        self._since_probe = (self._since_probe + 1) % PROBE_EVERY
        return self._since_probe != 0

    def _sibling_prefilling(self, req: Request) -> bool:
        """An n > 1 sample waits while a sibling computes the shared prompt (prefix cache on)."""
        if req.group_id is None or not self.kv.enable_caching:
            return False
        return any(
            r.group_id == req.group_id and r.num_computed_tokens < r.num_prompt_tokens for r in self.running
        )

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        self._drafter_waiting = out.drafter_kv_end
        verified: list[tuple[str, int, int]] = []  # (req_id, drafts, accepted): the adaptive policy's
        for i, req_id in enumerate(out.req_ids):
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            sampled = out.sampled_token_ids[i]
            drafts = sched.scheduled_spec_tokens.get(req_id, [])
            req.num_computed_tokens += sched.num_scheduled_tokens[req_id]
            if drafts:
                num_accepted = len(sampled) - 1
                req.num_computed_tokens -= len(drafts) - num_accepted
                self._record_acceptance(req, len(drafts), num_accepted)
                if self.adaptive is not None:
                    verified.append((req_id, len(drafts), num_accepted))
            req.spec_token_ids = []
            new_tokens: list[int] = []
            status = None
            for token in sampled:
                new_tokens.append(token)
                status = req.append_output(token)
                if status is not None:
                    break
            self.kv.cache_computed_blocks(req, out.drafter_kv_end.get(req_id))
            logprobs = out.logprobs[i][: len(new_tokens)] if out.logprobs is not None else None
            if status is not None:
                if verified:  # before _finish forgets the request
                    self.adaptive.observe_verifications(verified)
                    verified = []
                self.running.remove(req)
                self._finish(req, status)
            elif out.spec_token_ids is not None and new_tokens and out.spec_token_ids[i]:
                req.spec_token_ids = self._clip_drafts(req, out.spec_token_ids[i])
            prompt_lps = out.prompt_logprobs.get(req_id)
            if new_tokens or status is not None or prompt_lps:
                reason = FinishReason.of(status) if status is not None else None
                outputs.append(
                    EngineCoreOutput(
                        req_id=req_id,
                        new_token_ids=new_tokens,
                        new_logprobs=logprobs,
                        new_prompt_logprobs=prompt_lps,
                        finish_reason=reason.value if reason else None,
                        stop_reason=req.stop_reason,
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                        num_draft_tokens=req.num_draft_tokens,
                        num_accepted_tokens=req.num_accepted_tokens,
                        num_verify_steps=req.num_verify_steps,
                    )
                )
        if verified:
            self.adaptive.observe_verifications(verified)
        return outputs

    def _clip_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        """Drafts never reach past max_tokens (k + 1 new tokens at most) or max_model_len."""
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        return list(drafts[: max(room, 0)])

    def _record_acceptance(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += num_accepted
        req.num_verify_steps += 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            if pos < len(self.spec_accepted_per_pos):
                self.spec_accepted_per_pos[pos] += 1

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
            spec_draft_lengths=list(self.spec_draft_lengths),
            spec_num_parked=self.spec_num_parked,
        )
