"""The proposer protocol, the batch every proposer receives, and the registry.

Owns: `Proposer` (the one interface the model runner calls), `ProposeBatch`, `build_proposer`.
Does not own: any particular drafting method (``ngram``, ``draft_model``, ``eagle``), or the
verification of drafts (``sample.rejection``).

Contract. After the target verified this step, the runner hands the proposer the step's batch:
every scheduled request with its token ids *after* appending this step's accepted tokens, the
position where this step's tokens started (`num_computed`), how many of them hold valid target
state (`num_valid`: scheduled minus rejected drafts), and how many drafts it gets (`num_drafts`:
0 for a request that produced no token this step, else the scheduler's draft length, 0..k). The
proposer returns up to that many greedy drafts per request (one-hot drafts: the rejection sampler
treats them as deterministic, which keeps verification lossless for random requests too).

Model-based proposers run pass 1 when some request feeds the drafter (it catches the drafter's KV
up and drafts token 1), then pass j for j = 2.. while some request wants a j-th draft; pass j feeds
only those requests (the deepest first, so pass j's rows are a prefix of pass j-1's). In
data-parallel lockstep the passes and their padded sizes are the voted ones instead
(`pass_sizes`), whatever the batch holds: with nothing to do a pass runs on padding alone. That is
what lets lockstep ranks run the drafter together (DESIGN §5 rule 3).

Deferred catch-up (outside lockstep). A request that gets no drafts this step does not feed the
drafter its new positions: they wait (`feed_range`) until it drafts again, and are fed then, in
one pass with its new ones. Under load, where the policy (or `disable_by_batch_size`) drafts for
few requests or none, pass 1 then runs for the drafting requests only, or not at all, instead of
over the whole batch every step; a request that never drafts again never pays for it. Prompt
positions are always fed: a request's blocks past its drafter KV go to the prefix cache marked
without it (`drafter_kv_ends`, read by the scheduler), and a request that may draft takes hits only
up to the first such block, so a hit it takes always brings the drafter's KV along; a prompt that
waited would make every later request sharing it (a system prompt, an earlier turn) recompute
it. A wait that would grow past the proposer's `max_lag`
positions is caught up at once: for an EAGLE head, the positions whose raw target features fit
in `MAX_WAIT_BYTES` (the memory it keeps per waiting request); for a draft model, which keeps
nothing per position, `MAX_DRAFT_MODEL_LAG`.

A request opted out of speculation by its own parameters (`speculative: false`, a cap of 0) never
feeds the drafter, not even its prompt (outside lockstep): the runner leaves it out of the batch,
so the drafter costs it nothing, not even a row of a proposer's loop. Its blocks go to the prefix
cache marked without drafter KV (the runner reports its drafter KV as ending at 0); requests that
draft take hits only up to the first such block (``core.block_pool``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch

from phalanx.attention.metadata import AttentionMetadata, build_attention_metadata
from phalanx.config import ModelConfig
from phalanx.distributed.group import DPGroup
from phalanx.spec_decode.config import SpeculativeConfig


@dataclass
class ProposeBatch:
    req_ids: list[str]
    token_ids: list[list[int]]  # per request: prompt + outputs incl. this step's accepted tokens
    num_computed: list[int]  # per request: position of the first token scheduled this step
    num_valid: list[int]  # per request: scheduled tokens whose target state is valid (minus rejected)
    num_drafts: list[int]  # per request: drafts wanted after this step (0: none), at most k
    block_table: torch.Tensor  # [R, max_blocks] int64 (the step's, with `table_rows`), covering the lookahead slots too
    token_offsets: list[int]  # per request: first row of its tokens in target_hidden
    prompt_lens: list[int]  # per request: its prompt's length (prompt positions are never deferred)
    target_hidden: torch.Tensor | None = None  # [T, H] the target's final (normed) hidden states
    target_aux: list[torch.Tensor] = field(default_factory=list)  # EAGLE-3: [T, H] per aux layer
    # Lockstep: the padded token count of each drafter pass, decided by the vote (the proposer runs
    # exactly these passes, padding or even entirely dummy). None: run only the passes needed.
    pass_sizes: tuple[int, ...] | None = None
    # Wraps drafter pass j (labels the collectives it issues for the debug checker).
    pass_context: Callable[[int], AbstractContextManager[None]] = lambda j: nullcontext()
    # per request: its row of `block_table` where that is the whole step's (the runner leaves
    # opted-out requests out of the batch, not out of the table); None: row i is request i's
    table_rows: list[int] | None = None

    def table(self, rows: list[int]) -> torch.Tensor:
        """[len(rows), max_blocks] the block-table rows of these requests."""
        index = rows if self.table_rows is None else [self.table_rows[r] for r in rows]
        return self.block_table[torch.tensor(index, dtype=torch.int64)]


class Proposer(Protocol):
    num_speculative_tokens: int
    # Extra KV slots the scheduler allocates past the scheduled tokens (where drafts are written).
    num_lookahead_slots: int
    # Target layers whose entering residual stream the proposer consumes (EAGLE-3).
    aux_layer_ids: tuple[int, ...]
    needs_target_hidden: bool
    # Drafter forwards the last `propose` ran (0: none), the positions its first pass fed (this
    # step's and any caught up on) and those its later passes fed (`later_pass_rows`).
    passes_run: int
    rows_fed: int
    pass_rows: int

    def kv_cache_spec(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each drafter layer that needs a paged KV cache."""
        ...

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None: ...

    def start_request(self, req_id: str, num_computed: int) -> None:
        """A request is (re)scheduled from `num_computed` (new, or resumed after preemption)."""
        ...

    def finish_request(self, req_id: str) -> None: ...

    def propose(self, batch: ProposeBatch) -> list[list[int]]:
        """Drafts per request of the batch ([] for requests that did not sample)."""
        ...

    def drafter_kv_ends(self) -> dict[str, int]:
        """Each request whose catch-up is deferred: the first position without drafter KV (its
        blocks from there on go to the prefix cache marked without it). Requests caught up are
        absent (and those the runner leaves out, opted out: it reports them itself)."""
        ...


def build_proposer(
    spec: SpeculativeConfig,
    target_model: torch.nn.Module,
    target_cfg: ModelConfig,
    expert_shard: tuple[int, int] | None = None,
    group: DPGroup | None = None,
) -> Proposer:
    """`expert_shard` / `group`: an MoE draft model joins the target's expert parallelism."""
    from phalanx.spec_decode.draft_model import DraftModelProposer
    from phalanx.spec_decode.eagle import EagleProposer
    from phalanx.spec_decode.ngram import NgramProposer

    if spec.method == "draft_model":  # the one drafter that may hold MoE experts: loads its shard only
        return DraftModelProposer(spec, target_model, target_cfg, expert_shard, group)
    registry: dict[str, type] = {"ngram": NgramProposer, "eagle": EagleProposer, "eagle3": EagleProposer}
    return registry[spec.method](spec, target_model, target_cfg)  # type: ignore[no-any-return]


# The most bytes of raw target features an EAGLE head keeps for one waiting request: a wait that
# would hold more is caught up at once (module docstring). 2 MiB: 606 positions on SmolLM2's
# EAGLE-3 head (3 x 576 bf16 a position), 85 on Llama-3-8B's (3 x 4096), 4,096 on the demo's
# EAGLE-1 (256 bf16) — beside the target's KV for the same positions (23 KB a position on
# SmolLM2, 131 KB on Llama-3-8B), a sixth to a fifth of it.
MAX_WAIT_BYTES = 2 << 20
# A draft model keeps nothing per waiting position (it re-reads the tokens): its wait is bounded
# only so that one catch-up pass stays the size of a prefill chunk.
MAX_DRAFT_MODEL_LAG = 2048


def max_lag(row_bytes: int) -> int:
    """The most positions a wait of a drafter that keeps `row_bytes` per waiting position may reach."""
    return max(MAX_WAIT_BYTES // max(row_bytes, 1), 1)


def feed_range(
    caught_up: int,  # the first position without drafter KV (the request's num_computed if none waits)
    end: int,  # the end of the positions the drafter could take now
    prompt_len: int,
    drafting: bool,
    may_defer: bool,  # False in lockstep: the vote sized pass 1 for every position
    lag: int,  # the proposer's bound on a wait, in positions
) -> int:
    """Where this step's feed ends: the drafter takes [caught_up, result) now and [result, end)
    waits. A drafting request takes everything; otherwise only prompt positions, unless the wait
    would grow past `lag`."""
    if drafting or not may_defer or end - caught_up > lag:
        return end
    return min(end, max(caught_up, prompt_len))


class Feed(NamedTuple):
    """One request's input to a drafter's first pass: its tokens at consecutive positions."""

    row: int  # the request's row in the ProposeBatch
    token_ids: list[int]  # the tokens fed, one per position
    start: int  # the position of the first one


@dataclass
class DrafterPass:
    """The flat input of one drafter forward: real feeds, then padding up to the agreed size."""

    input_ids: torch.Tensor  # [T_real + num_pad] int64
    meta: AttentionMetadata
    last_rows: list[int]  # per feed, the row of its last token
    num_pad: int


def drafter_pass(
    feeds: list[Feed],
    batch: ProposeBatch,
    block_size: int,
    pad_to: int | None,
) -> DrafterPass:
    q_lens = [len(f.token_ids) for f in feeds]
    num_real = sum(q_lens)
    num_pad = 0 if pad_to is None else pad_to - num_real
    if num_pad < 0:
        raise RuntimeError(f"drafter pass has {num_real} tokens, more than the agreed {pad_to}")
    table = batch.table([f.row for f in feeds]).numpy()
    meta = build_attention_metadata(q_lens, [f.start for f in feeds], table, block_size, num_pad)
    ids = [t for f in feeds for t in f.token_ids] + [0] * num_pad
    last_rows = list(itertools.accumulate(q_lens, initial=-1))[1:]
    return DrafterPass(torch.tensor(ids, dtype=torch.int64), meta, last_rows, num_pad)


def one_token_pass(
    tokens: torch.Tensor,  # [n] int64: each drafting request's input token
    positions: torch.Tensor,  # [n] int64: its position
    block_table: torch.Tensor,  # [n, max_blocks]: its block-table row
    block_size: int,
    pad_to: int | None,
) -> DrafterPass:
    """A drafter pass of one token per request (passes 2..k), built from tensors (no per-pass
    lists), padded with token 0 up to the agreed size like `drafter_pass`."""
    n = tokens.shape[0]
    num_pad = 0 if pad_to is None else pad_to - n
    if num_pad < 0:
        raise RuntimeError(f"drafter pass has {n} tokens, more than the agreed {pad_to}")
    meta = build_attention_metadata(np.ones(n, dtype=np.int64), positions, block_table, block_size, num_pad)
    ids = torch.cat([tokens, tokens.new_zeros(num_pad)]) if num_pad else tokens
    return DrafterPass(ids, meta, list(range(n)), num_pad)


def deepest_first(drafting: list[int], depth_of: Callable[[int], int]) -> list[int]:
    """`drafting` ordered by draft length, longest first (stable), so that the requests drafting a
    j-th token are always a prefix: [a:1, b:3, c:2] -> [b, c, a]."""
    return sorted(drafting, key=lambda f: -depth_of(f))


def draft_rest(
    batch: ProposeBatch,
    drafts: list[list[int]],
    rows: list[int],  # batch rows of the drafting requests, deepest first (`deepest_first`)
    tokens: torch.Tensor,  # [n] their draft 1
    positions: torch.Tensor,  # [n] where draft 1 is fed
    block_size: int,
    passes: int,
    forward: Callable[[DrafterPass, int], torch.Tensor],  # (pass, real rows) -> rows to draft from
    greedy: Callable[[torch.Tensor], torch.Tensor],  # [n, H] -> [n] token ids
) -> list[list[int]]:
    """Passes 2..`passes` of a model drafter: pass j feeds draft j-1 one position further and
    drafts token j for the requests that want a j-th draft (a prefix of `rows`; every pass runs,
    padded to the voted size in lockstep, even with nothing to draft); appends each request's
    drafts to `drafts` (one tolist per pass at the end) and returns it.
    Depths [3, 2, 1]: pass 2 feeds rows 0-1, pass 3 row 0."""
    depths = [min(batch.num_drafts[r], passes) for r in rows]  # (lockstep: the vote covers every depth)
    table = batch.table(rows)
    out = [tokens]
    for j in range(1, passes):
        n = sum(1 for d in depths if d > j)  # requests drafting token j + 1
        p = one_token_pass(tokens[:n], positions[:n] + (j - 1), table[:n], block_size, pass_size(batch, j))
        with batch.pass_context(j + 1):
            hidden = forward(p, n)
        tokens = greedy(hidden[:n]) if n else tokens[:0]
        out.append(tokens)
    if rows:
        per_pass = [t.tolist() for t in out]
        for i, (row, depth) in enumerate(zip(rows, depths)):
            drafts[row].extend(per_pass[j][i] for j in range(depth))
    return drafts


# Drafting chains and draft lengths. A chain runs all its passes for every row it holds, so with
# requests of different lengths it drafts the deepest length for all of them and keeps each one's
# own (`chain_grid`, `chain_rest`); the pass-by-pass path feeds pass j only the requests drafting
# that deep. The drafts are the same; the chain also writes the drafter's KV one position past a
# shorter request's drafts per extra pass. Those positions are at or past the request's next
# `num_computed`, where the next step's catch-up writes the drafter's KV before any pass reads it
# (a pass reads only earlier positions), exactly like the KV of rejected drafts.


def uniform_grid(feeds: list[Feed], drafting: list[int]) -> int:
    """q when every fed request drafts and feeds the same q positions (pass 1 is one [R, q] grid,
    so a drafting chain can run all passes in one call); 0 otherwise."""
    q = len(feeds[0].token_ids) if feeds else 0
    return q if len(drafting) == len(feeds) > 0 and all(len(f.token_ids) == q for f in feeds) else 0


def chain_grid(
    batch: ProposeBatch,
    feeds: list[Feed],
    drafts: list[list[int]],
    chain: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],  # (ids, start, table) -> [R, k]
) -> list[list[int]]:
    """All passes of a uniform grid (`uniform_grid`) through a drafting chain; appends the drafts."""
    rows = [f.row for f in feeds]
    ids = torch.tensor([t for f in feeds for t in f.token_ids], dtype=torch.int64)
    start = torch.tensor([f.start for f in feeds], dtype=torch.int64)
    out = chain(ids, start, batch.table(rows))
    for row, toks in zip(rows, out.tolist()):
        drafts[row].extend(toks[: batch.num_drafts[row]])  # the chain drafts the deepest length for all
    return drafts


def chain_rest(
    batch: ProposeBatch,
    drafts: list[list[int]],
    rows: list[int],
    tokens: torch.Tensor,  # [n] draft 1
    chain: Callable[[torch.Tensor], torch.Tensor],  # table [n, W] -> drafts 2..k [n, k - 1]
) -> list[list[int]]:
    """Passes 2..k through a drafting chain after a pass 1 run pass by pass; appends all drafts."""
    rest = chain(batch.table(rows))
    for row, toks in zip(rows, torch.cat([tokens[:, None], rest], dim=1).tolist()):
        drafts[row].extend(toks[: batch.num_drafts[row]])  # the chain drafts the deepest length for all
    return drafts


def num_passes(batch: ProposeBatch, deepest: int, fed: bool = True) -> int:
    """Lockstep: exactly the voted passes. Alone: pass 1 whenever some request feeds the drafter
    (the catch-up), then one per draft position of the deepest drafting request; none when nothing
    is fed (every request is caught up and none drafts)."""
    if batch.pass_sizes is not None:
        return len(batch.pass_sizes)
    return max(deepest, 1) if fed else 0


class PassPlan(NamedTuple):
    """The passes a model drafter runs this step (`plan_passes`)."""

    drafting: list[int]  # indices into the feeds of the requests that get drafts, deepest first
    passes: int  # drafter forwards (0: none)
    rows_fed: int  # positions the first pass feeds (this step's and any caught up on)
    pass_rows: int  # positions passes 2.. feed (`later_pass_rows`)
    chained: bool  # every pass in one drafting chain (the proposer's `_chains`); False without passes


def plan_passes(batch: ProposeBatch, feeds: list[Feed], drafting: list[int],
                chains: Callable[[ProposeBatch], bool]) -> PassPlan:
    """How many passes the model drafter runs for `feeds` (`drafting`: those that get drafts), and
    what they feed, for the step-cost model."""
    drafting = deepest_first(drafting, lambda f: batch.num_drafts[feeds[f].row])
    passes = num_passes(batch, batch.num_drafts[feeds[drafting[0]].row] if drafting else 0, bool(feeds))
    rows_fed = sum(len(f.token_ids) for f in feeds)
    if passes == 0:
        return PassPlan(drafting, 0, rows_fed, 0, False)
    chained = chains(batch)
    depths = [batch.num_drafts[feeds[f].row] for f in drafting]
    return PassPlan(drafting, passes, rows_fed, later_pass_rows(batch, depths, passes, chained), chained)


def later_pass_rows(batch: ProposeBatch, depths: list[int], passes: int, chained: bool) -> int:
    """Positions passes 2..`passes` feed, for the step-cost model (`depths`: the drafting requests'
    draft lengths): in lockstep each pass's voted size (padding runs too); through a drafting chain
    every drafting request in every pass (`chain_grid`, `chain_rest`); pass by pass, pass j those
    drafting j or more (`draft_rest`)."""
    if passes <= 1:
        return 0
    if batch.pass_sizes is not None:
        return sum(batch.pass_sizes[1:])
    if chained:
        return len(depths) * (passes - 1)
    return sum(min(d, passes) - 1 for d in depths if d > 1)


def pass_size(batch: ProposeBatch, j: int) -> int | None:
    return None if batch.pass_sizes is None else batch.pass_sizes[j]


def drafter_room(spec: SpeculativeConfig, target_cfg: ModelConfig) -> int:
    """The drafter's context limit (its own max_model_len, never beyond the target's)."""
    limit = target_cfg.max_model_len
    if spec.max_model_len is not None:
        limit = min(limit, spec.max_model_len)
    return limit
