"""What a model drafter reports its later passes fed (``spec_decode.proposer.later_pass_rows``), the
positions the step-cost model prices a later pass's rows by (``spec_decode.adaptive``).

* pass by pass, pass j feeds the requests drafting j or more: requests capped at 0..3 drafts in one
  batch report exactly the rows the drafter's passes after the first ran (EAGLE and a draft model,
  counted at the drafter's forward);
* through a drafting chain every drafting request runs every pass; in lockstep every pass runs its
  voted size, padding included.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.spec_decode.proposer import ProposeBatch, later_pass_rows
from tests.tiny_models import VOCAB, make_eagle_head, make_model

K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pass_rows")
    target = make_model("LlamaForCausalLM", root / "target", num_hidden_layers=2)
    return {
        "target": target,
        "eagle": make_eagle_head(target, root / "eagle", "eagle"),
        "draft": make_model("LlamaForCausalLM", root / "draft", seed=5, num_hidden_layers=1),
    }


@pytest.mark.parametrize("method", ["eagle", "draft"])
def test_the_later_passes_rows_are_the_ones_the_drafter_ran(method: str, models: dict[str, Path]) -> None:
    kind = {"method": "draft_model"} if method == "draft" else {}
    llm = LLM(str(models["target"]), speculative_config={"model": str(models[method]), "num_speculative_tokens": K,
                                                         **kind})
    proposer = llm.engine.runner.proposer
    proposer._chains = lambda batch: False  # pass by pass: every pass goes through `_run`
    ran: list[int] = []
    run = proposer._run

    def counting_run(p, *rest):  # noqa: ANN001, ANN202
        ran.append(int(p.input_ids.shape[0]))
        return run(p, *rest)

    proposer._run = counting_run
    checked: list[tuple[int, int]] = []
    propose = proposer.propose

    def spy(batch: ProposeBatch) -> list[list[int]]:
        ran.clear()
        drafts = propose(batch)
        assert proposer.pass_rows == sum(ran[1:])
        assert proposer.passes_run == len(ran)
        checked.append((proposer.passes_run, proposer.pass_rows))
        return drafts

    proposer.propose = spy
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 12))]} for _ in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_speculative_tokens=i % (K + 1))
              for i in range(8)]
    llm.generate(prompts, params, use_tqdm=False)
    # Requests at different depths shared steps: later passes fed fewer rows than the drafting requests.
    assert any(passes == K and 0 < rows < (K - 1) * 6 for passes, rows in checked)


def _batch(num_drafts: list[int], pass_sizes: tuple[int, ...] | None = None) -> ProposeBatch:
    n = len(num_drafts)
    return ProposeBatch(req_ids=[str(i) for i in range(n)], token_ids=[[1]] * n, num_computed=[0] * n,
                        num_valid=[1] * n, num_drafts=num_drafts, block_table=torch.zeros(n, 1, dtype=torch.int64),
                        token_offsets=list(range(n)), prompt_lens=[1] * n, pass_sizes=pass_sizes)


def test_chains_and_lockstep_count_what_they_run() -> None:
    depths = [3, 2, 1, 1]
    assert later_pass_rows(_batch(depths), depths, 3, chained=False) == 2 + 1  # pass 2: two rows, pass 3: one
    assert later_pass_rows(_batch(depths), depths, 3, chained=True) == 4 * 2  # a chain runs every pass for all
    assert later_pass_rows(_batch(depths, (16, 8, 8)), depths, 3, chained=False) == 16  # the voted sizes
    assert later_pass_rows(_batch(depths), depths, 1, chained=True) == 0
    assert later_pass_rows(_batch([]), [], 0, chained=False) == 0
