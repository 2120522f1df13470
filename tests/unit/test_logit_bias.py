"""`logit_bias` (OpenAI's field): validated, applied to the target's logits before sampling, and
lossless under speculative decoding (verification applies the same bias). Before it existed the
server answered 400 "unsupported field 'logit_bias'" and `SamplingParams` had no such field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.sample import Sampler, SamplingMetadata, process_logits, rejection_sample
from tests.tiny_models import VOCAB, make_model
from tests.unit.test_rejection_sampler import chi_square_p_value

P_VALUE_THRESHOLD = 1e-3


def _meta(params: list[SamplingParams]) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(params, [None] * n, [[1]] * n, [[]] * n, {0}, "cpu")


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({5: 101.0}, r"in \[-100, 100\]"),
        ({5: float("nan")}, r"in \[-100, 100\]"),
        ({-1: 1.0}, "token ids"),
        ({"7": 1.0}, "token ids"),
        ({2**64: 1.0}, "token ids"),
    ],
)
def test_bad_logit_bias_is_rejected(bias: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_bias_moves_the_greedy_pick_and_minus_100_bans() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=0.0, logit_bias={2: 2.5}), SamplingParams(temperature=0.0)]
    assert Sampler()(logits, _meta(params)).sampled_token_ids.tolist() == [2, 1]
    banned = SamplingParams(temperature=1.0, logit_bias={1: -100.0, 3: -100.0})
    probs = torch.softmax(process_logits(logits[:1], _meta([banned])), dim=-1)[0]
    assert probs[1] < 1e-40 and probs[3] < 1e-40
    assert torch.allclose(probs[[0, 2]], torch.softmax(torch.tensor([0.0, 1.0]), dim=0))


def test_bias_applies_to_every_verified_row() -> None:
    """Greedy verification: a draft equal to the *unbiased* argmax is rejected where the bias moved
    the argmax, and the emitted token is the biased one."""
    logits = torch.zeros(3, 6)
    logits[:, 1] = 3.0  # unbiased argmax 1 at every position
    params = SamplingParams(temperature=0.0, logit_bias={4: 5.0})
    out = rejection_sample([[1, 1]], None, logits, _meta([params]), Sampler())
    assert out.output_token_ids == [[4]]
    plain = rejection_sample([[1, 1]], None, logits, _meta([SamplingParams(temperature=0.0)]), Sampler())
    assert plain.output_token_ids == [[1, 1, 1]]


@pytest.mark.parametrize("one_hot", [True, False])
def test_verification_with_bias_samples_the_biased_target(one_hot: bool) -> None:
    """Lossless: tokens emitted by rejection sampling (drafts from an unbiased drafter) follow the
    biased target distribution at every position (chi-square), not the unbiased one."""
    vocab, k, trials = 8, 2, 30_000
    gen = torch.Generator().manual_seed(21)
    target_logits = torch.randn(k + 1, vocab, generator=gen)
    plain_p = torch.softmax(target_logits, dim=-1)
    # Ban one token and boost two, none of them an unbiased argmax (the one-hot drafter's proposals).
    others = [t for t in range(vocab) if t not in plain_p.argmax(dim=-1).tolist()]
    params = SamplingParams(temperature=1.0, logit_bias={others[0]: -100.0, others[1]: 2.0, others[2]: 1.0})
    biased_p = torch.softmax(process_logits(target_logits, _meta([params] * (k + 1))), dim=-1)
    if one_hot:  # a deterministic drafter proposing the unbiased argmax
        drafts = plain_p[:k].argmax(dim=-1).expand(trials, -1)
        draft_probs = None
    else:
        draft_q = torch.softmax(torch.randn(k, vocab, generator=gen), dim=-1)
        drafts = torch.stack([torch.multinomial(draft_q[j], trials, True, generator=gen) for j in range(k)], 1)
        draft_probs = draft_q.repeat(trials, 1)
    out = rejection_sample(
        drafts.tolist(), draft_probs, target_logits.repeat(trials, 1), _meta([params] * trials), Sampler(7)
    )
    for position in range(k + 1):
        tokens = torch.tensor([o[position] for o in out.output_token_ids if len(o) > position])
        assert tokens.numel() > 1_000
        assert chi_square_p_value(tokens, biased_p[position]) > P_VALUE_THRESHOLD, position
        assert chi_square_p_value(tokens, plain_p[position]) < P_VALUE_THRESHOLD, position  # power


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("LlamaForCausalLM", tmp_path_factory.mktemp("bias") / "target", num_hidden_layers=2)


PROMPTS = [{"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7, 8]}, {"prompt_token_ids": [20, 21, 22, 23]}]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_engine_bias_is_lossless_under_speculation(method: str, target: Path) -> None:
    """Greedy with a bias that changes the output: spec decoding (drafters know nothing of the
    bias) gives exactly the no-spec tokens, and the no-bias output differs."""
    llm = LLM(str(target), dtype="float32", block_size=8)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    unbiased = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    favourite = unbiased[0][3]
    bias = {favourite: 4.0, unbiased[1][0]: -100.0}
    biased_params = plain.clone(logit_bias=bias)
    biased = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, biased_params, use_tqdm=False)]
    assert biased != unbiased and unbiased[1][0] not in biased[1]
    spec = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
        if method == "ngram"
        else {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}
    )
    spec_llm = LLM(str(target), dtype="float32", block_size=8, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, biased_params, use_tqdm=False)]
    assert got == biased
    assert spec_llm.get_metrics()["spec_num_draft_tokens"] > 0


def test_engine_rejects_bias_outside_the_vocabulary(target: Path) -> None:
    llm = LLM(str(target), dtype="float32")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(PROMPTS[:1], SamplingParams(logit_bias={VOCAB: 1.0}), use_tqdm=False)
    # The engine keeps working.
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logit_bias={VOCAB - 1: 1.0}), use_tqdm=False)
