"""Sampler specification: every logits transform against a naive per-row reference, greedy == argmax,
seeded rows independent of the batch, raw logprobs and ranks."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.sample import (
    Sampler,
    SamplingMetadata,
    apply_penalties_and_bans,
    compute_token_logprobs,
    process_logits,
)
from phalanx.sampling_params import SamplingParams

VOCAB = 32
EOS = 3


def make_meta(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    seeds: list[int | None] | None = None,
    eos: set[int] | None = None,
) -> SamplingMetadata:
    n = len(params)
    generators = [
        None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [p.seed for p in params])
    ]
    return SamplingMetadata.from_params(
        params,
        generators,
        prompts if prompts is not None else [[1, 2]] * n,
        outputs if outputs is not None else [[]] * n,
        {EOS} if eos is None else eos,
        "cpu",
    )


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ----------------------------------------------------------------------------- naive references


def ref_top_k(row: list[float], k: int) -> list[float]:
    if k == 0:
        return row
    kth = sorted(row, reverse=True)[k - 1]
    return [x if x >= kth else -math.inf for x in row]


def ref_softmax(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in row]
    s = sum(e)
    return [x / s for x in e]


def ref_top_p(row: list[float], p: float) -> list[float]:
    if p >= 1.0:
        return row
    probs = ref_softmax(row)
    keep, mass = set(), 0.0
    for i in sorted(range(len(row)), key=lambda i: -probs[i]):
        if mass >= p:
            break
        keep.add(i)
        mass += probs[i]
    return [x if i in keep else -math.inf for i, x in enumerate(row)]


def ref_min_p(row: list[float], min_p: float) -> list[float]:
    probs = ref_softmax(row)
    top = max(probs)
    return [x if probs[i] >= min_p * top else -math.inf for i, x in enumerate(row)]


def ref_penalties(
    row: list[float],
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> list[float]:
    out = list(row)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        count = output.count(t)
        out[t] -= frequency * count + presence * (1.0 if count else 0.0)
    return out


def assert_rows_close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    expected_t = torch.tensor(expected, dtype=torch.float32)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected_t)), "masked token sets differ"
    finite = ~torch.isinf(expected_t)
    torch.testing.assert_close(actual[finite], expected_t[finite], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- greedy / temperature


def test_greedy_equals_argmax() -> None:
    logits = random_logits(6)
    meta = make_meta([SamplingParams(temperature=0.0)] * 6)
    assert meta.all_greedy and not meta.all_random
    out = Sampler(seed=0)(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_greedy_rows_in_mixed_batch_are_argmax_and_untouched_by_temperature() -> None:
    logits = random_logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=3)] * 2
    meta = make_meta(params)
    processed = process_logits(logits, meta)
    torch.testing.assert_close(processed[0], logits[0])
    torch.testing.assert_close(
        processed[1][~torch.isinf(processed[1])], (logits[1] / 0.7)[~torch.isinf(processed[1])]
    )
    out = Sampler(seed=0)(logits, meta)
    assert out.sampled_token_ids[0] == logits[0].argmax() and out.sampled_token_ids[2] == logits[2].argmax()


def test_process_logits_does_not_mutate_raw_logits() -> None:
    logits = random_logits(3)
    before = logits.clone()
    meta = make_meta(
        [SamplingParams(temperature=0.5, top_p=0.5, repetition_penalty=1.3, min_tokens=2)] * 3,
        outputs=[[4], [5, 5], []],
    )
    process_logits(logits, meta)
    Sampler(seed=0)(logits, meta)
    assert torch.equal(logits, before)


# ----------------------------------------------------------------------------- truncation masks


@pytest.mark.parametrize("top_k", [1, 2, 5, 0, VOCAB, VOCAB + 10])
def test_top_k_masks_exactly_the_reference_tokens(top_k: int) -> None:
    logits = random_logits(5, seed=1)
    # A k beyond the vocabulary keeps everything; the last row has top-k disabled.
    meta = make_meta([SamplingParams(temperature=1.0, top_k=top_k)] * 4 + [SamplingParams()])
    expected = [ref_top_k(r, min(top_k, VOCAB)) for r in logits[:4].tolist()] + [logits[4].tolist()]
    assert_rows_close(process_logits(logits, meta), expected)


def test_top_k_keeps_ties_at_the_boundary() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    meta = make_meta([SamplingParams(top_k=2)])
    out = process_logits(logits, meta)
    assert torch.isinf(out).tolist() == [[True, False, False, False, True]]


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_top_p_masks_exactly_the_reference_tokens(top_p: float) -> None:
    logits = random_logits(8, seed=2)
    meta = make_meta([SamplingParams(top_p=top_p)] * 8)
    expected = [ref_top_p(r, top_p) for r in logits.tolist()]
    assert_rows_close(process_logits(logits, meta), expected)


def test_top_p_one_keeps_tokens_with_negligible_mass() -> None:
    """top_p=1.0 means disabled: rounding in the cumulative sum must not drop the far tail."""
    logits = torch.tensor([[30.0, 30.0, -30.0, -40.0], [0.0, 0.0, 0.0, 0.0]])
    meta = make_meta([SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)])
    meta.top_p = torch.tensor([1.0, 0.5])
    out = process_logits(logits, meta)
    assert not torch.isinf(out[0]).any()
    assert torch.isinf(out[1]).sum() == 2


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_min_p_masks_exactly_the_reference_tokens(min_p: float) -> None:
    logits = random_logits(6, seed=3)
    meta = make_meta([SamplingParams(min_p=min_p)] * 6)
    expected = [ref_min_p(r, min_p) for r in logits.tolist()]
    assert_rows_close(process_logits(logits, meta), expected)


def test_temperature_then_top_k_then_top_p_then_min_p_per_row() -> None:
    """Different settings per row in one batch equal the naive composition row by row."""
    logits = random_logits(6, seed=4)
    params = [
        SamplingParams(temperature=0.5, top_k=10, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1.5, top_k=0, top_p=0.6, min_p=0.0),
        SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=20, top_p=0.95, min_p=0.01),
        SamplingParams(temperature=0.9),
    ]
    meta = make_meta(params)
    expected = []
    for row, p in zip(logits.tolist(), params):
        if p.greedy:
            expected.append(row)
            continue
        r = [x / p.temperature for x in row]
        r = ref_min_p(ref_top_p(ref_top_k(r, p.top_k), p.top_p), p.min_p)
        expected.append(r)
    assert_rows_close(process_logits(logits, meta), expected)


def test_random_rows_never_sample_masked_tokens() -> None:
    logits = random_logits(64, seed=5)
    meta = make_meta([SamplingParams(temperature=1.0, top_k=3, top_p=0.9)] * 64)
    allowed = ~torch.isinf(process_logits(logits, meta))
    sampler = Sampler(seed=1)
    for _ in range(5):
        tokens = sampler(logits, meta).sampled_token_ids
        assert allowed[torch.arange(64), tokens].all()


# ----------------------------------------------------------------------------- penalties and bans


def test_penalties_match_naive_reference() -> None:
    logits = random_logits(4, seed=6)
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.0, repetition_penalty=0.8),
        SamplingParams(),
    ]
    prompts = [[1, 2, 2, 9], [4, 5], [7, 7, 8], [0, 1]]
    outputs = [[3, 3, 10], [5, 5, 5, 11], [7, 12, 12], [1, 1]]
    meta = make_meta(params, prompts=prompts, outputs=outputs, eos=set())
    expected = [
        ref_penalties(r, pr, o, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        for r, pr, o, p in zip(logits.tolist(), prompts, outputs, params)
    ]
    assert_rows_close(apply_penalties_and_bans(logits, meta), expected)


def test_no_penalties_means_no_prompt_ids_kept() -> None:
    meta = make_meta([SamplingParams()] * 2)
    assert meta.prompt_token_ids is None
    assert (
        meta.presence_penalty is None and meta.frequency_penalty is None and meta.repetition_penalty is None
    )


def test_greedy_uses_penalised_logits() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    meta = make_meta([SamplingParams(temperature=0.0, repetition_penalty=2.0)], prompts=[[1]], eos=set())
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [2]


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(4, 8)
    logits[:, EOS] = 10.0
    logits[:, 6] = 9.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6]),  # 1 output token: banned
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6]),  # 2 output tokens: free
        SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True),  # ignore_eos: EOS not banned
        SamplingParams(temperature=0.0, min_tokens=3),  # EOS banned, 6 is no stop id here
    ]
    meta = make_meta(params, outputs=[[1], [1, 2], [], []])
    assert meta.min_tokens_stop_ids == {0: [EOS, 6], 3: [EOS]}
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [0, EOS, EOS, 6]


def test_min_tokens_supports_several_eos_ids() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 2], logits[0, 3], logits[0, 4] = 9.0, 8.0, 7.0
    meta = make_meta([SamplingParams(temperature=0.0, min_tokens=1)], eos={2, 3})
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [4]


# ----------------------------------------------------------------------------- random sampling


def test_seeded_row_is_independent_of_batch_and_position() -> None:
    logits = random_logits(8, seed=7)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    target_row = logits[0:1]
    alone = Sampler(seed=0)(target_row, make_meta([seeded])).sampled_token_ids.item()

    for engine_seed, position in [(0, 5), (9, 0), (3, 7)]:
        perm = [i for i in range(1, 8)]
        rows = perm[:position] + [0] + perm[position:]
        params = [seeded if r == 0 else other for r in rows]
        out = Sampler(seed=engine_seed)(logits[rows], make_meta(params))
        assert out.sampled_token_ids[position].item() == alone

    # And over many steps: the same generator sequence yields the same token sequence.
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    meta_a = SamplingMetadata.from_params([seeded], [gen_a], [[1]], [[]], set(), "cpu")
    meta_b = SamplingMetadata.from_params([other, seeded], [None, gen_b], [[1], [1]], [[], []], set(), "cpu")
    seq_a = [Sampler(seed=0)(target_row, meta_a).sampled_token_ids.item() for _ in range(20)]
    seq_b = [Sampler(seed=1)(logits[[3, 0]], meta_b).sampled_token_ids[1].item() for _ in range(20)]
    assert seq_a == seq_b
    assert len(set(seq_a)) > 1, "a seeded stream must not repeat one token"


def test_unseeded_rows_follow_the_engine_seed() -> None:
    logits = random_logits(16, seed=8)
    meta = make_meta([SamplingParams(temperature=1.0)] * 16)
    a = Sampler(seed=42)(logits, meta).sampled_token_ids
    b = Sampler(seed=42)(logits, meta).sampled_token_ids
    assert torch.equal(a, b)
    # the engine seed is what decides them (a sampler with a seed of its own would pass the above)
    assert not torch.equal(a, Sampler(seed=43)(logits, meta).sampled_token_ids)


def test_random_sampling_matches_the_processed_distribution() -> None:
    """Chi-square goodness of fit of 40k samples (one big batch) against softmax(processed)."""
    num_samples = 40_000
    row = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -3.0, 0.2, 1.5]])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
    meta = make_meta([params] * num_samples)
    logits = row.expand(num_samples, -1).contiguous()
    probs = torch.softmax(process_logits(row, make_meta([params])), dim=-1)[0]
    counts = torch.bincount(Sampler(seed=3)(logits, meta).sampled_token_ids, minlength=8).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support].double() * num_samples
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()
    assert p_value > 1e-3, (stat, df, p_value)


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_with_exact_ranks() -> None:
    logits = random_logits(5, seed=9)
    params = [SamplingParams(temperature=0.6, logprobs=3, repetition_penalty=1.4)] + [
        SamplingParams(temperature=0.0, logprobs=1, presence_penalty=1.0)
    ] * 4
    meta = make_meta(params, outputs=[[0, 1]] * 5)
    assert meta.max_num_logprobs == 3
    out = Sampler(seed=0)(logits, meta)
    assert out.logprobs is not None
    ref = torch.log_softmax(logits, dim=-1)  # raw: no penalties, no temperature
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprobs.token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], ref[torch.arange(5), sampled])
    top_lp, top_ids = ref.topk(3, dim=-1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], top_lp)
    for i in range(5):
        expected_rank = 1 + sum(1 for v in ref[i].tolist() if v > ref[i, sampled[i]].item())
        assert out.logprobs.ranks[i].item() == expected_rank


def test_compute_token_logprobs_zero_top_and_ties() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    lp = compute_token_logprobs(logits, torch.tensor([2, 3]), num_top=0)
    assert lp.token_ids.shape == (2, 1) and lp.logprobs.shape == (2, 1)
    assert lp.ranks.tolist() == [1, 1]  # ties do not push the rank down
    lp = compute_token_logprobs(logits, torch.tensor([0, 3]), num_top=2)
    assert lp.ranks.tolist() == [3, 1]
    torch.testing.assert_close(lp.logprobs[1], torch.full((3,), math.log(0.25)))


def test_logprobs_requested_zero_gives_only_sampled_column() -> None:
    logits = random_logits(2, seed=10)
    meta = make_meta([SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0)])
    out = Sampler()(logits, meta)
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (2, 1)
