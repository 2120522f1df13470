"""A drafter's KV in prefix-cached blocks: a request that hits blocks computed by a request too
long to draft, or by one opted out of speculation, drafts exactly as well as on a cache miss.

Regression: the draft-model proposer skipped requests past its context (`len + k > drafter
max_model_len`) entirely, so their blocks (a long prompt's, say) were cached with target KV but no
draft KV. A later request sharing that prompt's prefix got the blocks from the prefix cache, its
drafter attended to empty KV there, and its acceptance collapsed (here: 4 of 20 drafts accepted
against 8 of 8 on a miss) while its output stayed right (verification is lossless)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx import LLM, SamplingParams
from phalanx.core.block_pool import BlockPool
from tests.tiny_models import make_eagle_head, make_model

DRAFT_LEN = 48  # the drafter's own max_model_len
K = 3
BLOCK = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("LlamaForCausalLM", tmp_path_factory.mktemp("draftkv") / "target", num_hidden_layers=2)


def _llm(target: Path) -> LLM:
    # The draft is the target itself: on a miss it agrees with every token, so any lost acceptance
    # on a hit comes from missing draft KV.
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": K, "max_model_len": DRAFT_LEN}
    return LLM(str(target), dtype="float32", max_model_len=128, block_size=BLOCK, speculative_config=spec)


def test_prefix_hit_drafts_as_well_as_a_miss(target: Path) -> None:
    long_prompt = [(7 * i + 3) % 300 + 3 for i in range(70)]  # 70 + K > DRAFT_LEN: never drafts
    short_prompt = long_prompt[:24] + [11, 12, 13, 14]  # shares 3 blocks with it, then drafts
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    miss = _llm(target).generate([{"prompt_token_ids": short_prompt}], params, use_tqdm=False)[0]
    llm = _llm(target)
    llm.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": short_prompt}], params, use_tqdm=False)[0]

    assert hit.num_cached_tokens == 24 and miss.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids  # lossless either way
    assert miss.outputs[0].num_accepted_tokens == miss.outputs[0].num_draft_tokens > 0
    assert hit.outputs[0].num_draft_tokens == miss.outputs[0].num_draft_tokens
    assert hit.outputs[0].num_accepted_tokens == miss.outputs[0].num_accepted_tokens


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_an_opted_out_request_never_feeds_the_drafter(method: str, target: Path, tmp_path: Path) -> None:
    """A request with `speculative: false` never reaches the drafter, prompt included. Its blocks
    go to the prefix cache without drafter KV: another opted-out request hits all of them, a
    speculating one none (and drafts as on a miss); once a speculating request has computed the
    same blocks, theirs (with drafter KV) are the ones the cache serves."""
    if method == "draft":  # the draft is the target itself: exact drafts iff its KV is right
        spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": K}
    else:
        spec = {"model": str(make_eagle_head(target, tmp_path / "eagle3", "eagle3")), "num_speculative_tokens": K}
    llm = LLM(str(target), dtype="float32", block_size=BLOCK, speculative_config=spec)
    proposer = llm.engine.runner.proposer
    fed: list[tuple[int, int]] = []  # per proposal: (rows fed, passes run)
    propose = proposer.propose

    def spy(batch):  # noqa: ANN001, ANN202
        drafts = propose(batch)
        fed.append((proposer.rows_fed, proposer.passes_run))
        return drafts

    proposer.propose = spy
    greedy = {"temperature": 0.0, "ignore_eos": True}
    prompt = [(5 * i + 7) % 300 + 3 for i in range(20)]
    first = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=24, speculative=False, **greedy),
                         use_tqdm=False)[0]
    assert not fed  # the drafter is never reached: not one row, prompt included
    assert first.outputs[0].num_draft_tokens == 0

    second = {"prompt_token_ids": prompt + list(first.outputs[0].token_ids) + [9, 10, 11]}
    whole = (len(second["prompt_token_ids"]) - 1) // BLOCK * BLOCK
    out_params = SamplingParams(max_tokens=12, speculative=False, **greedy)
    params = SamplingParams(max_tokens=12, **greedy)
    plain = LLM(str(target), dtype="float32", block_size=BLOCK).generate([second], params, use_tqdm=False)[0]
    miss = LLM(str(target), dtype="float32", block_size=BLOCK, speculative_config=spec).generate(
        [second], params, use_tqdm=False)[0]
    opted_out = llm.generate([second], out_params, use_tqdm=False)[0]
    drafting = llm.generate([second], params, use_tqdm=False)[0]  # computes the blocks with drafter KV
    again = llm.generate([second], params, use_tqdm=False)[0]

    assert opted_out.num_cached_tokens == whole  # the first request's blocks, drafter KV or not
    assert drafting.num_cached_tokens == 0  # none of them: they lack drafter KV
    assert again.num_cached_tokens == whole  # the drafting request's blocks replaced them
    for out in (miss, opted_out, drafting, again):
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert miss.outputs[0].num_draft_tokens > 0
    for out in (drafting, again):  # as well as on a miss
        assert out.outputs[0].num_draft_tokens == miss.outputs[0].num_draft_tokens
        assert out.outputs[0].num_accepted_tokens == miss.outputs[0].num_accepted_tokens
    if method == "draft":
        assert miss.outputs[0].num_accepted_tokens == miss.outputs[0].num_draft_tokens


def test_block_pool_prefers_blocks_with_drafter_kv() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, 11, drafter_kv=False)
    assert pool.lookup(11) is a and not a.drafter_kv
    pool.cache_block(b, 11, drafter_kv=False)  # two without: the first stays
    assert pool.lookup(11) is a
    pool.cache_block(b, 11)  # b's catch-up arrived: b has it now, and is served
    assert b.drafter_kv and pool.lookup(11) is b
    pool.cache_block(c, 11)  # one with it is served already: the first stays
    assert pool.lookup(11) is b and c.drafter_kv
    pool.free([a, b, c])
    pool.allocate(4)  # evicts all three: hashes and flags reset
    assert pool.lookup(11) is None
    assert all(blk.block_hash is None and blk.drafter_kv for blk in pool.blocks)
