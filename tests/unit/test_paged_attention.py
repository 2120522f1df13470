"""The paged attention backend against a dense per-request reference, on random mixed batches
(fresh prompts, chunks over cached context, decodes, uniform verification batches, lockstep
padding): every path of `paged_attention` (uniform grid, decode group, prefills) must agree, with the
decode group on the reference matmuls and on the fused C++ kernel (``ops.cpu``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.attention.metadata import DECODE_GROUP_MAX_QUERY, build_attention_metadata
from phalanx.attention.torch_paged import kv_cache_shape, paged_attention

H, KVH, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 96


def _reference(q, k_all, v_all, nc, scale):  # q [q, H, D], k_all/v_all [nc + q, KVH, D]
    g = H // KVH
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        keys = k_all[: nc + i + 1].repeat_interleave(g, dim=1)  # [L, H, D]
        vals = v_all[: nc + i + 1].repeat_interleave(g, dim=1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[i], keys) * scale, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", w, vals)
    return out


@st.composite
def batches(draw):
    uniform = draw(st.booleans())
    n = draw(st.integers(1, 5))
    if uniform:  # every request decodes or verifies the same number of tokens over its context
        q = draw(st.integers(1, DECODE_GROUP_MAX_QUERY))
        reqs = [(draw(st.integers(0, 30)), q) for _ in range(n)]
    else:
        reqs = [(draw(st.integers(0, 30)), draw(st.integers(1, 24))) for _ in range(n)]
    return reqs, draw(st.sampled_from([0, 0, 3])), draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=batches())
def test_paged_attention_matches_dense_reference(backend, case, monkeypatch) -> None:
    monkeypatch.setenv("PHALANX_KERNELS", backend)
    reqs, num_pad, seed = case
    gen = torch.Generator().manual_seed(seed)
    scale = D**-0.5
    kv = torch.zeros(kv_cache_shape(NUM_BLOCKS, BS, KVH, D))  # [2, KVH, blocks, BS, D]
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # blocks in scattered order
    max_blocks = max((nc + q + BS - 1) // BS for nc, q in reqs)
    table = torch.zeros(len(reqs), max_blocks, dtype=torch.int64)
    full_k, full_v, qs = [], [], []
    for r, (nc, q) in enumerate(reqs):
        nb = (nc + q + BS - 1) // BS
        table[r, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
        k_all, v_all = torch.randn(nc + q, KVH, D, generator=gen), torch.randn(nc + q, KVH, D, generator=gen)
        for pos in range(nc):  # the cached context
            kv[0, :, table[r, pos // BS], pos % BS] = k_all[pos]
            kv[1, :, table[r, pos // BS], pos % BS] = v_all[pos]
        full_k.append(k_all)
        full_v.append(v_all)
        qs.append(torch.randn(q, H, D, generator=gen))
    q_lens = torch.tensor([q for _, q in reqs])
    meta = build_attention_metadata(q_lens, torch.tensor([nc for nc, _ in reqs]), table, BS, num_pad)
    if num_pad == 0 and len(set(q_lens.tolist())) == 1 and int(q_lens[0]) <= DECODE_GROUP_MAX_QUERY:
        assert meta.uniform_decode_len == int(q_lens[0])
    else:
        assert meta.uniform_decode_len == 0
    pad = [torch.randn(num_pad, H, D, generator=gen)] if num_pad else []
    pad_kv = [torch.randn(num_pad, KVH, D, generator=gen)] if num_pad else []
    q_flat = torch.cat(qs + pad)
    k_new = torch.cat([k[nc:] for k, (nc, _) in zip(full_k, reqs)] + pad_kv)
    v_new = torch.cat([v[nc:] for v, (nc, _) in zip(full_v, reqs)] + pad_kv)
    out = paged_attention(q_flat, k_new, v_new, kv, meta, scale)
    assert out.shape == q_flat.shape
    row = 0
    for (nc, q), qr, k_all, v_all in zip(reqs, qs, full_k, full_v):
        torch.testing.assert_close(out[row : row + q], _reference(qr, k_all, v_all, nc, scale), atol=1e-5, rtol=1e-4)
        row += q
    # the new tokens' K/V landed in their slots
    for r, (nc, q) in enumerate(reqs):
        for pos in range(nc, nc + q):
            assert torch.equal(kv[0, :, table[r, pos // BS], pos % BS], full_k[r][pos])
            assert torch.equal(kv[1, :, table[r, pos // BS], pos % BS], full_v[r][pos])


def test_prefill_through_the_kernel_is_query_count_invariant(monkeypatch) -> None:
    """With the C++ kernel, prefill chunks run the decode kernel over the paged cache: a prompt's
    attention outputs are bitwise the same whether it is prefilled whole, in two chunks, or its last
    tokens decoded one by one (bf16), so chunking never changes a token."""
    from phalanx.ops import cpu as cpu_ops

    monkeypatch.setenv("PHALANX_KERNELS", "auto")
    if cpu_ops.kernel_for(torch.bfloat16) is None:
        pytest.skip("C++ kernels unavailable")
    gen = torch.Generator().manual_seed(0)
    n, h, kvh, d, bs = 40, 4, 2, 64, 16
    q = torch.randn(n, h, d, generator=gen).bfloat16()
    k = torch.randn(n, kvh, d, generator=gen).bfloat16()
    v = torch.randn(n, kvh, d, generator=gen).bfloat16()
    table = torch.tensor([[3, 0, 5]])

    def run(splits: list[int]) -> torch.Tensor:
        kv = torch.zeros(kv_cache_shape(8, bs, kvh, d), dtype=torch.bfloat16)
        outs, start = [], 0
        for size in splits:
            meta = build_attention_metadata(torch.tensor([size]), torch.tensor([start]), table, bs)
            sl = slice(start, start + size)
            outs.append(paged_attention(q[sl], k[sl], v[sl], kv, meta, d**-0.5))
            start += size
        return torch.cat(outs)

    whole = run([n])
    assert torch.equal(run([23, 17]), whole)
    assert torch.equal(run([36, 1, 1, 1, 1]), whole)
    ref = _reference(q.float(), k.float(), v.float(), 0, d**-0.5)
    torch.testing.assert_close(whole.float(), ref, atol=2e-2, rtol=2e-2)


def test_every_layer_shares_the_forwards_memo(monkeypatch) -> None:
    """What one forward's layers share is built once, by the first layer (``ForwardMemo``): the
    reference path's mask and K/V gather index, the kernel choice, the fused layer's plan."""
    monkeypatch.setenv("PHALANX_KERNELS", "torch")
    gen = torch.Generator().manual_seed(1)
    meta = build_attention_metadata(torch.tensor([1, 3, 20]), torch.tensor([9, 4, 2]),
                                    torch.arange(1, 19).view(3, 6), BS)
    q = torch.randn(24, H, D, generator=gen)
    k, v = torch.randn(24, KVH, D, generator=gen), torch.randn(24, KVH, D, generator=gen)
    kv = torch.zeros(kv_cache_shape(NUM_BLOCKS, BS, KVH, D))
    first = paged_attention(q, k, v, kv, meta, 0.3)
    mask, index = meta.memo.dec_mask, dict(meta.memo.gather_index)
    assert mask is not None and len(index) == 2  # the decode group's table and the chunk's (over cached keys)
    assert meta.memo.attention_kernels == {(torch.float32, "cpu"): None}
    assert torch.equal(paged_attention(q, k, v, kv, meta, 0.3), first)  # a second layer: nothing rebuilt
    assert meta.memo.dec_mask is mask and all(meta.memo.gather_index[key] is t for key, t in index.items())
    plan = meta.fused_plan()
    assert meta.memo.fused_plan_built and meta.fused_plan() is plan
