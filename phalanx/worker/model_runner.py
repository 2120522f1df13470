"""The model runner: `execute(SchedulerOutput) -> ModelRunnerOutput`.

Owns: the model replica, its paged KV-cache tensors, the per-request state the runner keeps
between steps (token ids, block table, the seeded request's generator), building the flat batch
(input ids, attention metadata), running the forward, sampling / verifying drafts, prompt
logprobs, and asking the proposer for the next drafts.
Does not own: deciding what runs (``core.scheduler``), stop conditions or text.

The batch is built with one Python loop over the scheduled requests; everything per token is a
tensor op.
"""

from __future__ import annotations

import math
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from phalanx.attention.metadata import build_attention_metadata
from phalanx.attention.torch_paged import kv_cache_shape
from phalanx.config import EngineConfig, ModelConfig
from phalanx.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from phalanx.distributed.expert_parallel import install_expert_parallel
from phalanx.distributed.group import DPGroup
from phalanx.distributed.vote import StepPlan
from phalanx.models.loader import release_load_buffers
from phalanx.models.registry import load_model
from phalanx.ops import cpu as cpu_ops
from phalanx.sample.metadata import SamplingMetadata
from phalanx.sample.rejection import rejection_sample
from phalanx.sample.sampler import LogprobsTensors, Sampler, compute_token_logprobs
from phalanx.sampling_params import SamplingParams
from phalanx.spec_decode.adaptive import (
    GROUPED_PROFILE_ROWS,
    PROFILE_CONTEXT,
    PROFILE_MIN_ROWS,
    PROFILE_ROWS,
    StepProfile,
    profile_may_stop_after,
)
from phalanx.spec_decode.proposer import ProposeBatch, Proposer, build_proposer

_GIB = 1 << 30


@dataclass
class RunnerRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    token_ids: list[int] = field(default_factory=list)  # prompt + outputs, as known to the runner
    opted_out: bool = False  # never drafted for (opted out, or parked: `NewRequestData.may_draft`); never fed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]


def kv_cache_num_blocks(cfg: EngineConfig, layer_specs: list[tuple[int, int]], num_lookahead: int = 0) -> int:
    """Blocks that fit in kv_cache_space for all layers (target + drafter), each block holding K
    and V of `block_size` tokens per layer; `layer_specs` is (num_kv_heads, head_dim) per layer."""
    bs = cfg.cache.block_size
    elem = torch.finfo(cfg.model.dtype).bits // 8
    bytes_per_block = sum(2 * bs * kvh * hd * elem for kvh, hd in layer_specs)
    num_blocks = cfg.cache.num_gpu_blocks_override or int(cfg.cache.kv_cache_space * _GIB // bytes_per_block)
    need = cfg.scheduler.max_model_len + num_lookahead
    if num_blocks * bs < need:
        raise ValueError(
            f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks of {bs}), fewer than "
            f"max_model_len {cfg.scheduler.max_model_len} (+{num_lookahead} draft slots); "
            "raise kv_cache_space or lower max_model_len"
        )
    return num_blocks


def target_layer_specs(m: ModelConfig) -> list[tuple[int, int]]:
    return [(m.num_kv_heads, m.head_dim)] * m.num_layers


def allocate_kv_caches(
    layer_specs: list[tuple[int, int]], num_blocks: int, block_size: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    return [torch.zeros(kv_cache_shape(num_blocks, block_size, kvh, hd), dtype=dtype) for kvh, hd in layer_specs]


class ModelRunner:
    def __init__(self, cfg: EngineConfig, group: DPGroup | None = None) -> None:
        self.cfg = cfg
        self.group = group
        self.block_size = cfg.cache.block_size
        par = cfg.parallel
        # Expert parallelism: this rank keeps its share of every MoE layer's experts and exchanges
        # tokens with the other ranks (which is what forces lockstep).
        self.expert_shard = (
            (par.data_parallel_rank, par.data_parallel_size)
            if par.enable_expert_parallel and par.data_parallel_size > 1
            else None
        )
        if self.expert_shard is not None and group is None:
            raise ValueError("expert parallelism needs the data-parallel group")
        self.model = load_model(cfg.model, self.expert_shard if cfg.model.is_moe else None)
        if group is not None and self.expert_shard is not None:
            install_expert_parallel(self.model, group)
        self.proposer: Proposer | None = None
        if cfg.speculative is not None:
            self.proposer = build_proposer(cfg.speculative, self.model, cfg.model, self.expert_shard, group)
        release_load_buffers()  # the heap that loading freed goes back to the OS, not into the KV cache's RSS
        target_specs = target_layer_specs(cfg.model)
        draft_specs = self.proposer.kv_cache_spec() if self.proposer is not None else []
        self.num_lookahead_slots = self.proposer.num_lookahead_slots if self.proposer is not None else 0
        self.num_blocks = kv_cache_num_blocks(cfg, target_specs + draft_specs, self.num_lookahead_slots)
        self.kv_caches = allocate_kv_caches(target_specs, self.num_blocks, self.block_size, cfg.model.dtype)
        if self.proposer is not None:
            self.proposer.bind_kv_caches(
                allocate_kv_caches(draft_specs, self.num_blocks, self.block_size, cfg.model.dtype)
            )
        self.aux_layer_ids = self.proposer.aux_layer_ids if self.proposer is not None else ()
        self._pass_sizes: tuple[int, ...] | None = None  # this step's voted drafter pass sizes
        self.eos_token_ids = set(cfg.model.eos_token_ids)
        # Each data-parallel rank draws unseeded rows from its own stream: with one seed, two idle ranks
        # given the same unseeded request at once would sample the same "random" completion.
        self.sampler = Sampler(cfg.seed + par.data_parallel_rank)
        self._argmax = cpu_ops.argmax_fn(cfg.model.dtype)  # greedy picks over model-dtype logits
        self.requests: dict[str, RunnerRequestState] = {}
        self.num_tokens_run = 0  # tokens through the target forward, for tests and stats
        # Time split for the overhead figure: model forwards (target incl. lm_head) and drafting.
        self.forward_seconds = 0.0
        self.drafter_seconds = 0.0

    def _context(self, label: str, agreed_tokens: int | None = None) -> AbstractContextManager[None]:
        return self.group.context(label, agreed_tokens) if self.group is not None else nullcontext()

    def _pass_context(self, j: int) -> AbstractContextManager[None]:
        sizes = self._pass_sizes
        return self._context(f"drafter pass {j}", sizes[j - 1] if sizes and j <= len(sizes) else None)

    # ---- state diffs -----------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.proposer is not None:
                self.proposer.finish_request(req_id)
        for new in sched.new_reqs:
            params = new.sampling_params
            gen = None
            if params.seed is not None:
                gen = torch.Generator().manual_seed(params.seed)
                if not params.greedy:  # a resumed request's generator continues where it stood
                    Sampler.skip_draws(gen, len(new.output_token_ids), self.cfg.model.vocab_size)
            self.requests[new.req_id] = RunnerRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=params,
                generator=gen,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                opted_out=self.proposer is not None and not new.may_draft,
            )
            if self.proposer is not None:
                self.proposer.start_request(new.req_id, new.num_computed_tokens)
        for cached in sched.cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed:
                state.block_ids = list(cached.new_block_ids)
                if self.proposer is not None:
                    self.proposer.start_request(cached.req_id, cached.num_computed_tokens)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, plan: StepPlan | None = None) -> ModelRunnerOutput:
        """Run one step. With a lockstep `plan` the batch is padded to the agreed size (an empty
        schedule becomes an all-padding dummy step through this same path) and the drafter runs
        exactly the voted passes."""
        self._update_states(sched)
        req_ids = list(sched.num_scheduled_tokens)
        if not req_ids and (plan is None or not plan.run_forward):
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        # One loop over the batch: gather each request's tokens, lengths and block table row.
        input_ids: list[int] = []
        q_lens: list[int] = []
        num_computed: list[int] = []
        max_blocks = max((len(self.requests[r].block_ids) for r in req_ids), default=1)
        block_table_np = np.zeros((len(req_ids), max_blocks), dtype=np.int64)
        sampling: list[int] = []  # batch indices of requests that produce tokens this step
        drafts_of: list[list[int]] = []
        logit_rows: list[int] = []  # flat token index of every row to compute logits for
        prompt_lp_reqs: list[tuple[int, int, int]] = []  # (batch index, first prompt pos, count)
        offset = 0
        for i, req_id in enumerate(req_ids):
            st = self.requests[req_id]
            n = sched.num_scheduled_tokens[req_id]
            drafts = sched.scheduled_spec_tokens.get(req_id, [])
            nc = st.num_computed_tokens
            real_end = nc + n - len(drafts)
            input_ids.extend(st.token_ids[nc:real_end])
            input_ids.extend(drafts)
            q_lens.append(n)
            num_computed.append(nc)
            block_table_np[i, : len(st.block_ids)] = st.block_ids
            if st.sampling_params.prompt_logprobs is not None and nc < st.num_prompt_tokens - 1:
                count = min(real_end, len(st.prompt_token_ids) - 1) - nc
                prompt_lp_reqs.append((i, nc, count))
            if req_id in sched.reaching_end:
                assert real_end == len(st.token_ids), f"{req_id}: scheduler and runner disagree on its end"
                sampling.append(i)
                drafts_of.append(drafts)
                last = offset + n - 1
                logit_rows.extend(range(last - len(drafts), last + 1))
            offset += n

        self.num_tokens_run += len(input_ids)
        num_pad = 0 if plan is None else plan.num_tokens - len(input_ids)
        if num_pad < 0:
            raise RuntimeError(f"batch of {len(input_ids)} tokens exceeds the agreed {plan.num_tokens}")
        block_table = torch.from_numpy(block_table_np)
        meta = build_attention_metadata(q_lens, num_computed, block_table_np, self.block_size, num_pad)
        input_ids.extend([0] * num_pad)
        t0 = time.perf_counter()
        self._pass_sizes = plan.draft_pass_sizes if plan is not None else None
        with self._context("target forward", plan.num_tokens if plan is not None else None):
            hidden, aux = self.model(
                torch.tensor(input_ids, dtype=torch.int64), self.kv_caches, meta, aux_layer_ids=self.aux_layer_ids
            )
        self.forward_seconds += time.perf_counter() - t0

        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])
        if sampling:
            self._sample(req_ids, sampling, drafts_of, hidden[torch.tensor(logit_rows)], out)
        if prompt_lp_reqs:
            self._prompt_logprobs(req_ids, q_lens, prompt_lp_reqs, hidden, out)
        # A model drafter runs exactly the voted passes; n-gram lookup issues no collectives.
        model_drafter = self.num_lookahead_slots > 0
        if self.proposer is not None and (plan is None or not model_drafter or plan.draft_pass_sizes):
            pass_sizes = None if plan is None else plan.draft_pass_sizes
            t0 = time.perf_counter()
            out.spec_token_ids = self._propose(
                sched, req_ids, q_lens, num_computed, block_table, hidden, aux, out, pass_sizes
            )
            self.drafter_seconds += time.perf_counter() - t0
        return out

    @torch.inference_mode()
    def profile_step_curve(
        self, max_rows: int, context: int = PROFILE_CONTEXT, repeats: int = 3, budget_seconds: float = 3.0,
        retries: int = 2, group: int = 1,
    ) -> StepProfile:
        """Seconds of the target forward over r decode rows (each one token after `context` cached
        ones, in blocks of its own while the cache has them) and of the lm_head with greedy picks
        over r rows, for r on the grid `PROFILE_ROWS` up to `max_rows`: the fastest of `repeats`
        rounds over the grid, after a warm-up round up to 64 rows; rounds after the first only
        while the profile has taken under `budget_seconds` (SmolLM2 on 2 AMX cores: 2-3 rounds,
        3-5 s), and where the first round runs past it (a slow CPU), the
        grid ends at the next point where it may (``adaptive.profile_may_stop_after``: at least
        64 rows; on an AVX2-only CPU here ~4 s instead of 10-17 s for the whole grid). A point
        that took longer than the next larger one is measured again, up to `retries` times.
        Single runs are not to be trusted where the forward is fast: a run
        whose buffers get fresh pages from the kernel pays for faulting them in (~9 us a 4 KB page
        on a VM here: the lm_head over 192 rows took 45 ms instead of 6 in most calls), and glibc's
        allocator keeps or returns freed buffers by turns. It is the shape of step time against
        rows that the adaptive policy prices drafts on, measured before serving, while nothing
        else runs (its online fit scales it to the forwards the steps time). Call it before any
        request holds blocks: the rows write throw-away KV into the cache. Not under expert
        parallelism (the forward's collectives would have no partners on the other ranks).

        `group` > 1 (speculation with k = group - 1) also times, at the grid points of
        `GROUPED_PROFILE_ROWS`, the forward over as many rows held `group` to a sequence (the shape
        of a verification: a request's drafts follow its token): what a draft row costs against a
        row of its own sequence. Each sequence's attention reads its keys once whatever its query
        rows (they share its tiles), so on SmolLM2 (AMX, 150 cached tokens) 32 requests verifying
        one draft each took 38.6 ms where 64 requests of one row took 43.3; priced as the latter,
        the adaptive policy drafted nothing at 32 requests where one draft each ran 1.2x faster
        than none. The result unpacks into ``StepCostModel.set_profile``'s arguments."""
        if self.expert_shard is not None:
            raise RuntimeError("profile_step_curve runs the forward alone: not under expert parallelism")
        # blocks a sequence of `group` rows after `context` cached ones takes (a cache too small for
        # a whole sequence: a shorter context; for a verification's rows: none grouped)
        group = max(group, 1)
        nb = max(min((context + group + self.block_size - 1) // self.block_size, self.num_blocks), 1)
        if group > nb * self.block_size:
            group = 1
        context = max(min(context, nb * self.block_size - group), 0)
        grid = [r for r in PROFILE_ROWS if r < max_rows] + [max_rows]
        # the verification's shape at a few of them (at the largest where the grid holds none)
        grouped_grid = ({r for r in GROUPED_PROFILE_ROWS if r in grid} or {max_rows}) if group > 1 else set()
        fwd: dict[int, float] = {}
        head: dict[int, float] = {}
        grouped: dict[int, float] = {}

        def measure(r: int, keep: bool = True) -> None:
            t_fwd, t_head = self._time_rows(r, nb, context)
            t_grouped = self._time_rows(r, nb, context, group)[0] if r in grouped_grid else math.inf
            if keep:
                fwd[r], head[r] = min(fwd.get(r, math.inf), t_fwd), min(head.get(r, math.inf), t_head)
                if r in grouped_grid:
                    grouped[r] = min(grouped.get(r, math.inf), t_grouped)

        start = time.perf_counter()
        for rep in range(repeats + 1):  # round 0 warms the kernels and the allocator up and is not kept
            if rep > 1 and time.perf_counter() - start > budget_seconds:
                break
            for i, r in enumerate(list(grid)):
                if rep == 0 and r > PROFILE_MIN_ROWS:  # the warm-up covers the rows always measured
                    continue
                measure(r, keep=rep > 0)
                if (rep == 1 and i + 1 < len(grid) and time.perf_counter() - start > budget_seconds
                        and profile_may_stop_after(grid, i)):
                    grid = grid[: i + 1]  # the rest of the grid: extended (``adaptive._interp``)
                    break
        # A point measured slower than a larger batch was noise (a bigger batch never takes less):
        # measure it again, up to `retries` times, whatever the budget. A slow CPU measures each point
        # once: on Zen 1 a lone 319 ms at 49 rows (64 rows: less) made the curve flat from 49 to 64
        # rows, once kept monotone, and drafts there looked free.
        for _ in range(retries):
            above = [a for a, b in zip(grid, grid[1:]) if fwd[a] > fwd[b] or head[a] > head[b]]
            if not above:
                break
            for r in above:
                measure(r)
        rows_grouped = sorted(r for r in grouped_grid if r in grouped)  # a grid cut short measured fewer
        return StepProfile(grid, [fwd[r] for r in grid], [head[r] for r in grid],
                           rows_grouped or None, [grouped[r] for r in rows_grouped] or None, group)

    def _time_rows(self, rows: int, blocks: int, context: int, group: int = 1) -> tuple[float, float]:
        """Seconds of one target forward over `rows` decode rows (`group` to a sequence, the last one
        fewer where they do not divide: a token after `context` cached ones and drafts after it,
        each sequence in `blocks` blocks of its own while the cache has them) and of the lm_head
        with greedy picks over them."""
        q_lens = [group] * (rows // group) + ([rows % group] if rows % group else [])
        table = (np.arange(len(q_lens) * blocks, dtype=np.int64) % self.num_blocks).reshape(len(q_lens), blocks)
        meta = build_attention_metadata(q_lens, [context] * len(q_lens), table, self.block_size)
        ids = torch.zeros(rows, dtype=torch.int64)
        t0 = time.perf_counter()
        hidden, _ = self.model(ids, self.kv_caches, meta, aux_layer_ids=self.aux_layer_ids)
        t1 = time.perf_counter()
        self._argmax(self.model.compute_logits(hidden, float32=False))
        return t1 - t0, time.perf_counter() - t1

    def _propose(
        self,
        sched: SchedulerOutput,
        req_ids: list[str],
        q_lens: list[int],
        num_computed: list[int],
        block_table: torch.Tensor,
        hidden: torch.Tensor,  # [T, H]
        aux: list[torch.Tensor],
        out: ModelRunnerOutput,
        pass_sizes: tuple[int, ...] | None,
    ) -> list[list[int]]:
        assert self.proposer is not None
        # Outside lockstep a request opted out by its own parameters never reaches the drafter (not
        # even its prompt): it is left out of the proposer's batch. In lockstep the vote sized the
        # passes for every position, so every request feeds.
        leave_out = pass_sizes is None
        rows: list[int] = []  # the batch rows the proposer gets
        skipped: list[str] = []
        ids, token_ids, prompt_lens, nc, offsets, num_valid, num_drafts = [], [], [], [], [], [], []
        offset = 0
        for i, req_id in enumerate(req_ids):
            st = self.requests[req_id]
            if leave_out and st.opted_out:
                skipped.append(req_id)
                offset += q_lens[i]
                continue
            produced = len(out.sampled_token_ids[i])
            verified = len(sched.scheduled_spec_tokens.get(req_id, ()))
            rows.append(i)
            ids.append(req_id)
            token_ids.append(st.token_ids)
            prompt_lens.append(len(st.prompt_token_ids))
            nc.append(num_computed[i])
            # Rejected drafts' positions hold stale state: [a, d1, d2, d3] with 1 accepted -> 2 valid.
            num_valid.append(q_lens[i] - verified + max(produced - 1, 0))
            num_drafts.append(sched.draft_lengths.get(req_id, 0) if produced > 0 else 0)
            offsets.append(offset)
            offset += q_lens[i]
        drafts: list[list[int]] = []
        if ids or not leave_out:  # (every request opted out: nothing reaches the drafter)
            drafts = self.proposer.propose(ProposeBatch(
                req_ids=ids,
                token_ids=token_ids,
                num_computed=nc,
                num_valid=num_valid,
                num_drafts=num_drafts,
                block_table=block_table,
                token_offsets=offsets,
                prompt_lens=prompt_lens,
                target_hidden=hidden if self.proposer.needs_target_hidden else None,
                target_aux=aux,
                pass_sizes=pass_sizes,
                pass_context=self._pass_context,
                table_rows=rows if skipped else None,
            ))
            out.num_drafter_passes = self.proposer.passes_run  # for the step-cost model
            out.drafter_rows_fed = self.proposer.rows_fed
            out.drafter_pass_rows = self.proposer.pass_rows
            out.drafting_reqs = sum(1 for n in num_drafts if n > 0)
        # requests whose drafter catch-up waits: their blocks are published to the prefix cache only
        # up to where the drafter's KV is complete; those left out have none (a model drafter's)
        out.drafter_kv_end = self.proposer.drafter_kv_ends()
        if skipped:
            if self.num_lookahead_slots > 0:
                out.drafter_kv_end.update(dict.fromkeys(skipped, 0))
            every: list[list[int]] = [[] for _ in req_ids]
            for i, d in zip(rows, drafts):
                every[i] = d
            drafts = every
        return drafts

    def _logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """The lm_head (float32 logits, or the model dtype's), counted as model-forward time in the
        overhead figure."""
        t0 = time.perf_counter()
        logits = self.model.compute_logits(hidden, float32)
        self.forward_seconds += time.perf_counter() - t0
        return logits

    def _sample(
        self,
        req_ids: list[str],
        sampling: list[int],
        drafts_of: list[list[int]],
        hidden: torch.Tensor,  # [num logit rows, H]
        out: ModelRunnerOutput,
    ) -> None:
        states = [self.requests[req_ids[i]] for i in sampling]
        if all(_plain_greedy(s) for s in states):
            self._sample_greedy(sampling, states, drafts_of, hidden, out)
            return
        meta = SamplingMetadata.from_params(
            [s.sampling_params for s in states],
            [s.generator for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            self.eos_token_ids,
            hidden.device,
        )
        logits = self._logits(hidden)  # [rows, V] float32
        result = rejection_sample(drafts_of, None, logits, meta, self.sampler)
        want_logprobs = meta.max_num_logprobs is not None
        if want_logprobs:
            out.logprobs = [[] for _ in req_ids]
        for j, (i, st) in enumerate(zip(sampling, states)):
            tokens = result.output_token_ids[j]
            st.token_ids.extend(tokens)
            out.sampled_token_ids[i] = tokens
            if want_logprobs and st.sampling_params.logprobs is not None and out.logprobs is not None:
                lp = result.logprobs_for(j)
                assert lp is not None
                out.logprobs[i] = _to_token_logprobs(lp, st.sampling_params.logprobs)

    def _sample_greedy(
        self,
        sampling: list[int],
        states: list[RunnerRequestState],
        drafts_of: list[list[int]],
        hidden: torch.Tensor,  # [num logit rows, H]
        out: ModelRunnerOutput,
    ) -> None:
        """Fast path, same result as `rejection_sample` for greedy rows without bias, penalties, bans or
        logprobs: one argmax over all rows, then accept each request's drafts while they equal it."""
        targets = self._argmax(self._logits(hidden, float32=False)).numpy()  # [rows]
        num_drafts = np.array([len(d) for d in drafts_of], dtype=np.int64)  # [B]
        k = int(num_drafts.max())
        # Accepted prefix length per request, vectorised over the batch (numpy: a dozen tiny ops):
        # rows of request b are [start_b, start_b + k_b]; draft j is accepted iff drafts 0..j all
        # equal the target argmax at their row.
        starts = np.cumsum(num_drafts + 1) - (num_drafts + 1)  # [B]
        if k:
            cols = np.arange(k)
            valid = cols[None, :] < num_drafts[:, None]  # [B, k]
            rows = np.minimum(starts[:, None] + cols[None, :], targets.shape[0] - 1)
            drafts = np.array([d + [-1] * (k - len(d)) for d in drafts_of], dtype=np.int64)
            match = (drafts == targets[rows]) & valid
            accepted = np.cumprod(match, axis=1).sum(axis=1)  # [B]
        else:
            accepted = np.zeros_like(num_drafts)
        final = targets[starts + accepted].tolist()  # the recovered / bonus token per request
        for i, st, drafts_b, a, tok in zip(sampling, states, drafts_of, accepted.tolist(), final):
            tokens = drafts_b[:a] + [tok]
            st.token_ids.extend(tokens)
            out.sampled_token_ids[i] = tokens

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        q_lens: list[int],
        reqs: list[tuple[int, int, int]],
        hidden: torch.Tensor,  # [T, H]
        out: ModelRunnerOutput,
    ) -> None:
        starts = [0]
        for q in q_lens[:-1]:
            starts.append(starts[-1] + q)
        for i, first_pos, count in reqs:
            st = self.requests[req_ids[i]]
            num_top = st.sampling_params.prompt_logprobs or 0
            rows = hidden[starts[i] : starts[i] + count]
            targets = torch.tensor(st.prompt_token_ids[first_pos + 1 : first_pos + 1 + count], dtype=torch.int64)
            lp = compute_token_logprobs(self._logits(rows), targets, num_top)
            entries: list[TokenLogprobs | None] = [None] if first_pos == 0 else []
            entries.extend(_to_token_logprobs(lp, num_top))
            out.prompt_logprobs[req_ids[i]] = entries


def _plain_greedy(st: RunnerRequestState) -> bool:
    p = st.sampling_params
    return (
        p.greedy
        and p.logprobs is None
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and p.repetition_penalty == 1.0
        and not p.logit_bias
        and p.min_tokens <= len(st.token_ids) - len(st.prompt_token_ids)
    )


def _to_token_logprobs(lp: LogprobsTensors, num_top: int) -> list[TokenLogprobs]:
    ids = lp.token_ids[:, : num_top + 1].tolist()
    vals = lp.logprobs[:, : num_top + 1].tolist()
    ranks = lp.ranks.tolist()
    return [TokenLogprobs(a, b, r) for a, b, r in zip(ids, vals, ranks)]

