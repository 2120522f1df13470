"""A draft model's KV in prefix-cached blocks: a request that hits blocks computed by a request too
long to draft drafts exactly as well as on a cache miss.

Regression: the draft-model proposer skipped requests past its context (`len + k > drafter
max_model_len`) entirely, so their blocks (a long prompt's, say) were cached with target KV but no
draft KV. A later request sharing that prompt's prefix got the blocks from the prefix cache, its
drafter attended to empty KV there, and its acceptance collapsed (here: 4 of 20 drafts accepted
against 8 of 8 on a miss) while its output stayed right (verification is lossless)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx import LLM, SamplingParams
from tests.tiny_models import make_model

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
