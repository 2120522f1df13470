"""Rejection sampler specification: greedy accept-prefix logic, penalties inside verification equal
sequential decoding, batch-independent seeded requests, and the lossless property checked by a
chi-square goodness-of-fit test on a small vocabulary."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.sample import (
    Sampler,
    SamplingMetadata,
    process_logits,
    rejection_sample,
)
from phalanx.sampling_params import SamplingParams

EOS = 0


def make_meta(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(
        params,
        generators if generators is not None else [None] * n,
        prompts if prompts is not None else [[1]] * n,
        outputs if outputs is not None else [[]] * n,
        {EOS},
        "cpu",
    )


def logits_with_argmax(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    """[len(argmaxes), vocab] logits whose row i peaks at argmaxes[i]."""
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


GREEDY = SamplingParams(temperature=0.0)


# ----------------------------------------------------------------------------- greedy accept prefix


def test_greedy_all_accepted_emits_bonus() -> None:
    out = rejection_sample(
        [[1, 2, 3]], None, logits_with_argmax([1, 2, 3, 4]), make_meta([GREEDY]), Sampler()
    )
    assert out.output_token_ids == [[1, 2, 3, 4]]
    assert out.num_accepted == [3]


def test_greedy_first_mismatch_emits_target_argmax() -> None:
    out = rejection_sample(
        [[1, 2, 3]], None, logits_with_argmax([1, 5, 3, 4]), make_meta([GREEDY]), Sampler()
    )
    assert out.output_token_ids == [[1, 5]]
    assert out.num_accepted == [1]
    out = rejection_sample([[6, 2]], None, logits_with_argmax([1, 2, 3]), make_meta([GREEDY]), Sampler())
    assert out.output_token_ids == [[1]]  # a later match after a mismatch does not count


def test_greedy_batch_with_empty_and_varied_drafts() -> None:
    drafts = [[1, 2], [], [7], [4, 4, 4]]
    argmaxes = [1, 2, 6] + [5] + [3, 2] + [4, 4, 1, 7]
    out = rejection_sample(drafts, None, logits_with_argmax(argmaxes), make_meta([GREEDY] * 4), Sampler())
    assert out.output_token_ids == [[1, 2, 6], [5], [3], [4, 4, 1]]
    assert out.num_accepted == [2, 0, 0, 2]


def test_greedy_ignores_draft_probs() -> None:
    draft_probs = torch.full((2, 8), 1 / 8)
    out = rejection_sample(
        [[1, 2]], draft_probs, logits_with_argmax([1, 3, 4]), make_meta([GREEDY]), Sampler()
    )
    assert out.output_token_ids == [[1, 3]]


def test_random_rows_certain_accept_and_certain_reject_mixed_with_greedy() -> None:
    """top_k=1 makes a random row's p one-hot: a one-hot draft on the peak is always accepted and
    one elsewhere always rejected, with the recovered token forced to the peak."""
    top1 = SamplingParams(temperature=1.0, top_k=1)
    drafts = [[1, 2], [1, 6], [1, 6]]
    argmaxes = [1, 2, 3] + [1, 2, 3] + [1, 2, 3]
    meta = make_meta([top1, top1, GREEDY])
    for seed in range(5):
        out = rejection_sample(drafts, None, logits_with_argmax(argmaxes), meta, Sampler(seed))
        assert out.output_token_ids == [[1, 2, 3], [1, 2], [1, 2]]
        assert out.num_accepted == [2, 1, 1]


def test_empty_drafts_equal_plain_sampling() -> None:
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.8, seed=11),
        GREEDY,
        SamplingParams(temperature=1.2, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=5, seed=12),
        SamplingParams(temperature=0.5, min_p=0.1),
        SamplingParams(temperature=1.0),
    ]

    def meta() -> SamplingMetadata:
        gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
        return make_meta(params, generators=gens)

    plain = Sampler(seed=7)(logits, meta()).sampled_token_ids.tolist()
    spec = rejection_sample([[]] * 6, None, logits, meta(), Sampler(seed=7))
    assert spec.output_token_ids == [[t] for t in plain]
    assert spec.num_accepted == [0] * 6


# ----------------------------------------------------------------------------- exactness vs sequential


def test_expanded_rows_equal_sequential_metadata() -> None:
    """Row j of a request sees history output + drafts[:j]: its processed logits (penalties,
    min_tokens bans, temperature, truncation) equal a fresh per-step metadata's."""
    vocab = 12
    params = [
        SamplingParams(temperature=0.7, top_k=6, repetition_penalty=1.4, presence_penalty=0.5, min_tokens=3),
        SamplingParams(temperature=0.0, frequency_penalty=0.8, min_tokens=2, stop_token_ids=[5]),
    ]
    prompts, outputs = [[1, 2, 3], [4, 4]], [[2], []]
    drafts = [[EOS, 2, 7], [5, 5]]
    meta = make_meta(params, outputs=outputs, prompts=prompts)
    expanded = meta.expand_for_verification([4, 3], drafts)
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(1))
    got = process_logits(logits, expanded)
    row = 0
    for i in range(2):
        for j in range(len(drafts[i]) + 1):
            step_meta = make_meta([params[i]], outputs=[outputs[i] + drafts[i][:j]], prompts=[prompts[i]])
            torch.testing.assert_close(got[row : row + 1], process_logits(logits[row : row + 1], step_meta))
            row += 1
    assert expanded.min_tokens_stop_ids == {0: [EOS], 1: [EOS], 4: [EOS, 5], 5: [EOS, 5]}


def test_greedy_verification_with_penalties_equals_sequential_decoding() -> None:
    vocab = 10
    gen = torch.Generator().manual_seed(2)
    for trial in range(20):
        params = SamplingParams(
            temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.6, min_tokens=3, stop_token_ids=[9]
        )
        prompt, output = [1, 2], [3]
        logits = torch.randn(5, vocab, generator=gen)
        # Drafts = raw argmax per row, so without penalties everything would be accepted.
        drafts = logits[:4].argmax(dim=-1).tolist()
        out = rejection_sample(
            [drafts], None, logits, make_meta([params], outputs=[output], prompts=[prompt]), Sampler()
        )
        expected: list[int] = []
        for j in range(5):
            step = make_meta([params], outputs=[output + expected], prompts=[prompt])
            token = Sampler()(logits[j : j + 1], step).sampled_token_ids.item()
            expected.append(token)
            if j == 4 or token != drafts[j]:
                break
        assert out.output_token_ids == [expected], trial


def test_seeded_request_is_independent_of_batch() -> None:
    vocab = 16
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, vocab, generator=gen)
    draft_probs = torch.softmax(torch.randn(9, vocab, generator=gen), dim=-1)
    seeded = SamplingParams(temperature=1.0, seed=99)
    other = SamplingParams(temperature=0.9)
    drafts_a = [3, 1, 4]

    def run(batch: list[str], engine_seed: int) -> list[int]:
        drafts, params, gens, rows, qrows = [], [], [], [], []
        for name in batch:
            d = drafts_a if name == "a" else [2, 2]
            drafts.append(d)
            params.append(seeded if name == "a" else other)
            gens.append(torch.Generator().manual_seed(99) if name == "a" else None)
            # Request a always uses target rows 0..3 and draft rows 0..2; others reuse rows 4..6 / 3..4.
            rows += list(range(4)) if name == "a" else list(range(4, 7))
            qrows += list(range(3)) if name == "a" else list(range(3, 5))
        out = rejection_sample(
            drafts, draft_probs[qrows], logits[rows], make_meta(params, generators=gens), Sampler(engine_seed)
        )
        return out.output_token_ids[batch.index("a")]

    alone = run(["a"], 0)
    assert run(["b", "a", "b"], 5) == alone
    assert run(["b", "b", "b", "a"], 6) == alone


def test_logprobs_rows_are_raw_target_logprobs_of_emitted_tokens() -> None:
    vocab = 8
    drafts = [[1, 2, 3], [], [4]]
    argmaxes = [1, 5, 3, 4] + [6] + [4, 7]
    logits = logits_with_argmax(argmaxes, vocab) + torch.randn(
        7, vocab, generator=torch.Generator().manual_seed(4)
    )
    params = [SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.1)] * 3
    out = rejection_sample(drafts, None, logits, make_meta(params), Sampler())
    assert out.output_token_ids == [[1, 5], [6], [4, 7]]
    assert out.logprobs is not None
    emitted_rows = [0, 1, 4, 5, 6]
    tokens = [1, 5, 6, 4, 7]
    ref = torch.log_softmax(logits, dim=-1)[emitted_rows]
    assert out.logprobs.token_ids[:, 0].tolist() == tokens
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], ref[torch.arange(5), torch.tensor(tokens)])
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], ref.topk(2, dim=-1).values)
    per_req = out.logprobs_for(2)
    assert per_req is not None and per_req.token_ids[:, 0].tolist() == [4, 7]


# ----------------------------------------------------------------------------- lossless distribution


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of ``tokens`` against ``probs`` (no scipy needed: the
    chi-square survival function with df degrees of freedom is gammaincc(df / 2, stat / 2)).
    Tokens outside the support of ``probs`` fail outright."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support].double() * tokens.numel()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


# Threshold: with fixed seeds the test is deterministic; a correct sampler fails a given check with
# probability 1e-3 over seeds, while a lossy one (e.g. emitting drafts unverified) gives p ~ 0.
P_VALUE_THRESHOLD = 1e-3
NUM_TRIALS = 30_000
VOCAB = 8


def run_distribution_case(num_drafts: int, one_hot: bool, params: SamplingParams, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(num_drafts + 1, VOCAB, generator=gen)  # per position, fixed
    target_p = torch.softmax(process_logits(target_logits, make_meta([params] * (num_drafts + 1))), dim=-1)
    draft_q = torch.softmax(torch.randn(num_drafts, VOCAB, generator=gen) * 1.5, dim=-1)  # [k, V]
    if one_hot:  # deterministic drafter: always proposes the target's most likely token per position
        drafts = target_p[:num_drafts].argmax(dim=-1).expand(NUM_TRIALS, -1)
        draft_probs = None
    else:
        drafts = torch.stack(
            [
                torch.multinomial(draft_q[j], NUM_TRIALS, replacement=True, generator=gen)
                for j in range(num_drafts)
            ],
            dim=1,
        )  # [N, k]
        draft_probs = draft_q.repeat(NUM_TRIALS, 1)  # [N * k, V], row n*k + j = q_j
    # Every trial is one request; its target rows are positions 0..k.
    logits = target_logits.repeat(NUM_TRIALS, 1)  # [N * (k + 1), V]
    out = rejection_sample(
        drafts.tolist(), draft_probs, logits, make_meta([params] * NUM_TRIALS), Sampler(seed)
    )
    for position in range(num_drafts + 1):
        tokens = torch.tensor([o[position] for o in out.output_token_ids if len(o) > position])
        # Position j is reached only after j acceptances; check there were enough samples.
        assert tokens.numel() > 1_000, (position, tokens.numel())
        p_value = chi_square_p_value(tokens, target_p[position])
        assert p_value > P_VALUE_THRESHOLD, (num_drafts, one_hot, position, p_value)
    if not one_hot:  # power check: the raw drafts are visibly not target-distributed
        assert chi_square_p_value(drafts[:, 0], target_p[0]) < P_VALUE_THRESHOLD


def test_distribution_k1_draft_probs() -> None:
    run_distribution_case(1, one_hot=False, params=SamplingParams(temperature=1.0), seed=10)


def test_distribution_k2_draft_probs() -> None:
    run_distribution_case(2, one_hot=False, params=SamplingParams(temperature=1.0), seed=11)


def test_distribution_k1_one_hot_drafts() -> None:
    run_distribution_case(1, one_hot=True, params=SamplingParams(temperature=1.0), seed=12)


def test_distribution_k2_one_hot_drafts() -> None:
    run_distribution_case(2, one_hot=True, params=SamplingParams(temperature=1.0), seed=13)


def test_distribution_k2_with_temperature_and_truncation() -> None:
    """The target is the processed distribution: drafts outside top-k must never survive."""
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.97)
    run_distribution_case(2, one_hot=False, params=params, seed=14)


# ----------------------------------------------------------------------------- bookkeeping property


@st.composite
def verification_batches(draw: st.DrawFn) -> tuple:
    vocab = draw(st.integers(2, 6))
    num_reqs = draw(st.integers(1, 5))
    drafts = [draw(st.lists(st.integers(0, vocab - 1), max_size=4)) for _ in range(num_reqs)]
    temps = [draw(st.sampled_from([0.0, 0.5, 1.0])) for _ in range(num_reqs)]
    use_probs = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return vocab, drafts, temps, use_probs, seed


@settings(max_examples=60, deadline=None)
@given(verification_batches())
def test_accept_reject_bookkeeping(batch: tuple) -> None:
    vocab, drafts, temps, use_probs, seed = batch
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    num_drafts = sum(len(d) for d in drafts)
    draft_probs = torch.softmax(torch.randn(num_drafts, vocab, generator=gen), dim=-1) if use_probs else None
    params = [SamplingParams(temperature=t, logprobs=1) for t in temps]
    out = rejection_sample(drafts, draft_probs, logits, make_meta(params), Sampler(seed))

    assert len(out.output_token_ids) == len(drafts) == len(out.num_accepted)
    row = 0
    for d, emitted, n, t in zip(drafts, out.output_token_ids, out.num_accepted, temps):
        assert 0 <= n <= len(d)
        assert len(emitted) == n + 1  # always at least one token
        assert emitted[:n] == d[:n]
        assert all(0 <= tok < vocab for tok in emitted)
        if n < len(d):  # the token after a rejection is never the rejected draft
            assert emitted[n] != d[n]
        if t == 0.0:  # greedy: exact accept-prefix rule against the argmax
            argmax = logits[row : row + len(d) + 1].argmax(dim=-1).tolist()
            expected_n = next((j for j in range(len(d)) if d[j] != argmax[j]), len(d))
            assert n == expected_n and emitted[-1] == argmax[n]
        row += len(d) + 1
    assert out.logprobs is not None
    assert out.logprobs.token_ids.shape == (sum(len(e) for e in out.output_token_ids), 2)
    flat = [tok for e in out.output_token_ids for tok in e]
    assert out.logprobs.token_ids[:, 0].tolist() == flat
