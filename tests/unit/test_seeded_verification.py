"""Seeded requests under speculative verification with one-hot drafts: the rejection sampler samples
the target position by position with the request's own generator, drawing exactly what plain
decoding draws, so a seeded request's tokens are the same with and without speculation — and the
rule stays lossless (chi-square against the target distribution at every position)."""

from __future__ import annotations

import torch

from phalanx.sample import Sampler, rejection_sample
from phalanx.sampling_params import SamplingParams
from tests.unit.test_rejection_sampler import P_VALUE_THRESHOLD, chi_square_p_value, make_meta

VOCAB = 8


def test_seeded_verification_draws_what_plain_decoding_draws() -> None:
    """A seeded request sampled step by step (Sampler) against the same request verifying drafts
    (some right, some wrong): the same tokens, whatever the drafts were."""
    params = SamplingParams(temperature=0.9, top_k=6, seed=5)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, VOCAB, generator=gen) * 2  # the target's logits at 12 positions

    plain_gen = torch.Generator().manual_seed(5)
    plain = [int(Sampler(1)(logits[i : i + 1], make_meta([params], generators=[plain_gen])).sampled_token_ids[0])
             for i in range(12)]
    for k in (1, 3, 5):
        spec_gen = torch.Generator().manual_seed(5)
        out, pos = [], 0
        while pos < 12:
            drafts = [plain[j] if (j + pos) % 3 else (plain[j] + 1) % VOCAB for j in range(pos, min(pos + k, 11))]
            rows = logits[pos : pos + len(drafts) + 1]
            res = rejection_sample([drafts], None, rows, make_meta([params], generators=[spec_gen]), Sampler(2))
            out += res.output_token_ids[0]
            pos += len(res.output_token_ids[0])
        assert out[:12] == plain, k


def test_seeded_verification_is_lossless() -> None:
    """10 000 seeded requests (their own seeds), k = 2 drafts from a deterministic drafter: the
    emitted token at every position is distributed as the target's processed distribution."""
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(10_000)]
    gen = torch.Generator().manual_seed(21)
    target_logits = torch.randn(3, VOCAB, generator=gen)
    target_p = torch.softmax(target_logits, dim=-1)
    drafts = [target_p[:2].argmax(dim=-1).tolist()] * len(params)
    gens = [torch.Generator().manual_seed(p.seed) for p in params]
    out = rejection_sample(drafts, None, target_logits.repeat(len(params), 1), make_meta(params, generators=gens),
                           Sampler(0))
    for position in range(3):
        tokens = torch.tensor([o[position] for o in out.output_token_ids if len(o) > position])
        assert tokens.numel() > 1_000, (position, tokens.numel())
        assert chi_square_p_value(tokens, target_p[position]) > P_VALUE_THRESHOLD, position
