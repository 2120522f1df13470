"""The fused C++ decode-attention kernel (``ops.cpu``): accuracy against float64 in
bf16 and fp32, agreement with the reference grouped matmuls, batch invariance (bitwise: a query's
output never depends on the batch or the query count around it) on each of its paths (the
register-tiled task; AMX tiles where the CPU has them), each path's summation order bit for bit
against a numpy model of it, and the backend switch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.attention.torch_paged import _decode_group_attention
from phalanx.ops import cpu as cpu_ops
from tests.emulated_amx import can_emulate_amx, emulated_amx_module


@pytest.fixture(scope="module")
def kernel():
    return cpu_ops.load(required=True)


# The attention's paths (its `isa` argument: the forward's GEMM path): any path but AMX runs the
# register-tiled task (AVX512-BF16, or AVX2 + FMA in its order); AMX runs bf16 on AMX tiles.
TILED, AMX = cpu_ops.GEMM_ISAS["avx512_bf16"], cpu_ops.GEMM_ISAS["amx"]


def _has_amx() -> bool:
    module = cpu_ops.kernel_for(torch.bfloat16)
    return module is not None and AMX in module.gemm_isas()


# By name; "amx_emulated": the AMX task of the build whose tiles are software (csrc/amx_emulation.h).
AMX_PATHS = [
    pytest.param("amx", id="amx", marks=pytest.mark.skipif(
        not _has_amx(), reason="this CPU has no AMX-BF16 (or the kernels do not build, or Linux refused the tile "
                               "state)")),
    pytest.param("amx_emulated", id="amx_emulated", marks=pytest.mark.skipif(
        not can_emulate_amx(), reason="this CPU has no AVX512-BF16 (or the kernels do not build)")),
]
ATTENTION_PATHS = [pytest.param("tiled", id="tiled"), *AMX_PATHS]


def _attention_on(path: str):  # noqa: ANN202
    """The module and `isa` an ATTENTION_PATHS name runs on."""
    if path == "amx_emulated":
        return emulated_amx_module(), AMX
    return cpu_ops.load(required=True), TILED if path == "tiled" else AMX


def _case(seed: int, seqs: int, qlen: int, kvh: int, group: int, head_dim: int, block_size: int,
          max_len: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    width = (max_len + block_size - 1) // block_size
    num_blocks = seqs * width + 3
    cache = torch.randn(2, kvh, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: seqs * width].view(seqs, width)
    lens = torch.randint(qlen, max_len + 1, (seqs,), generator=gen)
    visible = lens[:, None] - qlen + torch.arange(qlen)[None, :] + 1  # [S, Q] causal over the drafts
    q = torch.randn(seqs, qlen, kvh * group, head_dim, generator=gen).to(dtype)
    return q, cache, table, visible


def _truth(q, cache, table, visible, scale):  # float64, one query at a time
    s_, ql, h, d = q.shape
    kvh, bs = cache.shape[1], cache.shape[3]
    g = h // kvh
    out = torch.empty(s_, ql, h, d, dtype=torch.float64)
    for s in range(s_):
        for i in range(ql):
            n = int(visible[s, i])
            pos = torch.arange(n)
            blk, off = table[s, pos // bs], pos % bs
            for head in range(h):
                k = cache[0, head // g, blk, off].double()
                v = cache[1, head // g, blk, off].double()
                w = torch.softmax(k @ q[s, i, head].double() * scale, dim=0)
                out[s, i, head] = w @ v
    return out


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    seqs=st.integers(1, 5),
    qlen=st.integers(1, 5),
    kvh=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 24, 32, 64, 96, 128]),  # 32..128: the register-tiled bf16 task
    block_size=st.sampled_from([1, 4, 16]),
    max_len=st.integers(5, 70),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_kernel_matches_float64_and_the_reference(path, seed, seqs, qlen, kvh, group, head_dim, block_size,
                                                  max_len, dtype) -> None:
    kernel, isa = _attention_on(path)
    q, cache, table, visible = _case(seed, seqs, qlen, kvh, group, head_dim, block_size, max_len, dtype)
    scale = head_dim**-0.5
    out = cpu_ops.decode_attention(kernel, q, cache, table, visible, scale, isa)
    assert out.shape == q.shape and out.dtype == dtype
    truth = _truth(q, cache, table, visible, scale)
    # float32 math throughout; bf16 output rounding is 2^-9 relative
    tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    torch.testing.assert_close(out.double(), truth, **tol)
    key_pos = torch.arange(table.shape[1] * block_size)
    mask = (key_pos[None, None, :] >= visible[:, :, None])[:, :, None, :]
    ref = _decode_group_attention(q, cache, table, mask, scale, {})
    # the reference rounds scores and probabilities to bf16 in between: it is the less accurate one
    ref_tol = tol if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out.double(), ref.double(), **ref_tol)


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("head_dim", [24, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_batch_and_query_count_invariant(dtype, head_dim, path) -> None:
    kernel, isa = _attention_on(path)
    q, cache, table, visible = _case(7, seqs=6, qlen=4, kvh=2, group=2, head_dim=head_dim, block_size=16,
                                     max_len=90, dtype=dtype)
    full = kernel.decode_attention(q, cache, table, visible, 0.125, isa)
    for s in range(q.shape[0]):
        alone = kernel.decode_attention(q[s : s + 1], cache, table[s : s + 1], visible[s : s + 1], 0.125, isa)
        assert torch.equal(alone, full[s : s + 1])
        for i in range(q.shape[1]):  # one query token of a verification grid == the same query decoded alone
            one = kernel.decode_attention(q[s : s + 1, i : i + 1], cache, table[s : s + 1],
                                          visible[s : s + 1, i : i + 1], 0.125, isa)
            assert torch.equal(one[0, 0], full[s, i])
    # a wider block table (padding columns past every sequence's end) changes nothing
    wide = torch.cat([table, torch.zeros(table.shape[0], 3, dtype=torch.int64)], dim=1)
    assert torch.equal(kernel.decode_attention(q, cache, wide, visible, 0.125, isa), full)


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("block_size", [16, 32, 8])
def test_a_prompt_chunk_attends_as_its_queries_would_decoding(path, block_size) -> None:
    """A 70-token prompt chunk after 30 cached tokens (query blocks of 32 tokens x 3 heads: rows in
    several 16-row groups, keys read in place or staged): every query's output is bitwise the one it
    gets alone (decoding), and the one it gets in a chunk of another length."""
    kernel, isa = _attention_on(path)
    gen = torch.Generator().manual_seed(5)
    kvh, group, d, n, done = 2, 3, 64, 70, 30
    width = (done + n + block_size - 1) // block_size
    cache = torch.randn(2, kvh, width + 4, block_size, d, generator=gen).bfloat16()
    table = torch.randperm(width + 4, generator=gen)[:width].view(1, width)
    q = torch.randn(1, n, kvh * group, d, generator=gen).bfloat16()
    visible = (done + torch.arange(n) + 1).view(1, n)
    chunk = kernel.decode_attention(q, cache, table, visible, 0.125, isa)
    for i in range(n):
        one = kernel.decode_attention(q[:, i : i + 1], cache, table, visible[:, i : i + 1], 0.125, isa)
        assert torch.equal(one[0, 0], chunk[0, i]), f"query {i}"
    head = kernel.decode_attention(q[:, :23], cache, table, visible[:, :23], 0.125, isa)
    assert torch.equal(head, chunk[:, :23])


# ---- the register-tiled bf16 attention's summation order, step by step in numpy ------------------
_TINY = np.float32(2.0**-126)  # the smallest normal float32: below it DAZ / FTZ read and write zero


def _ftz(x: np.ndarray) -> np.ndarray:
    return np.where(np.abs(x) < _TINY, np.float32(0), x).astype(np.float32)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma: the exact a * b + c (a product of a float32 and a bf16 value is exact in 64-bit
    long double arithmetic) rounded once to float32."""
    return (a.astype(np.longdouble) * b.astype(np.longdouble) + c.astype(np.longdouble)).astype(np.float32)


def _exp_nonpositive(x: np.ndarray) -> np.ndarray:  # common.h's Cephes polynomial, op for op in float32
    f = np.float32
    x = np.maximum(x, f(-87.0))
    n = np.floor(x * f(1.44269504088896341) + f(0.5))
    r = (x - n * f(0.693359375)) + n * f(2.12194440e-4)
    y = np.full_like(x, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * r + f(c)
    y = ((y * r) * r + r) + f(1.0)
    scale = ((n.astype(np.int32) + 127) << 23).astype(np.int32).view(np.float32)
    return (y * scale).astype(np.float32)


def _tiled_row(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """One query row of the tiled bf16 task (csrc/attention.cpp) in numpy float32, every rounding
    where the kernel rounds: q [D], keys / values [L, D] (bf16 values as float32) -> float32 [D], the
    result before its rounding to bf16."""
    f = np.float32
    d = q.shape[0]
    qz, kz = _ftz(q), _ftz(keys)
    lanes = np.zeros((keys.shape[0], 16), np.float32)  # lane i: pairs (2i, 2i + 1) of each 32-chunk
    for c in range(d // 32):
        odd, even = 32 * c + 2 * np.arange(16) + 1, 32 * c + 2 * np.arange(16)
        lanes = _ftz(_fma(kz[:, odd], np.broadcast_to(qz[odd], kz[:, odd].shape), lanes))
        lanes = _ftz(_fma(kz[:, even], np.broadcast_to(qz[even], kz[:, even].shape), lanes))
    quarter = [(lanes[:, 4 * g] + lanes[:, 4 * g + 2]) + (lanes[:, 4 * g + 1] + lanes[:, 4 * g + 3]) for g in range(4)]
    scores = ((quarter[0] + quarter[1]) + (quarter[2] + quarter[3])) * f(scale)
    p = _softmax_row(scores)
    acc = np.zeros(d, np.float32)
    for i in range(scores.shape[0]):
        acc = _fma(np.full(d, p[i], np.float32), values[i], acc)
    return acc


def _softmax_row(scores: np.ndarray) -> np.ndarray:
    """common.h's softmax_row in numpy float32, op for op."""
    f = np.float32
    n = scores.shape[0]
    full = n // 16 * 16
    e = _exp_nonpositive(scores - scores.max())
    vsum = np.zeros(16, np.float32)
    for b in range(0, full, 16):
        vsum = vsum + e[b : b + 16]
    t3 = vsum[8:] + vsum[:8]
    t6 = t3[4:] + t3[:4]
    total = (t6[0] + t6[2]) + (t6[1] + t6[3])
    for i in range(full, n):
        total = total + e[i]
    return e * (f(1.0) / total)


def _exp2_amx(t: np.ndarray) -> np.ndarray:
    """attention.cpp's exp2_amx_ps op for op: n = t rounded to nearest even, a degree-5 polynomial of
    t - n by FMAs, times 2^n exactly."""
    f = np.float32
    n = np.rint(t).astype(f)
    r = (t - n).astype(f)
    y = np.full_like(t, f(1.3276470126584172e-3))
    for c in (9.675540961325169e-3, 5.550713464617729e-2, 2.4022120237350464e-1, 6.931469440460205e-1,
              1.0000001192092896):
        y = _fma(y, r, np.full_like(t, f(c)))
    return np.ldexp(y, n.astype(np.int32)).astype(f)


def _lane_sum(e: np.ndarray) -> np.float32:
    """16 lanes over the groups of 16 in order (a short last group zero-padded), then
    _mm512_reduce_add_ps's tree."""
    f = np.float32
    padded = np.zeros(-(-e.shape[0] // 16) * 16, f)
    padded[: e.shape[0]] = e
    vsum = np.zeros(16, f)
    for b in range(0, padded.shape[0], 16):
        vsum = vsum + padded[b : b + 16]
    t3 = vsum[8:] + vsum[:8]
    t6 = t3[4:] + t3[:4]
    return (t6[0] + t6[2]) + (t6[1] + t6[3])


def _amx_row(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """One query row of the AMX task (csrc/attention.cpp) in numpy float32: per 32-element step of
    the head (scores) or 32-key step (values) the even and the odd elements' products each summed
    from zero in pair order, then acc + (even + odd), under DAZ / FTZ; the softmax split as flash
    attention splits it (exps of the raw scores by exp2_amx_ps, rounded to bf16 for the value tiles,
    their float32 sum dividing the output)."""
    f = np.float32
    d, n = q.shape[0], keys.shape[0]
    qz, kz = _ftz(q), _ftz(keys)
    acc = np.zeros(n, f)
    for s in range(d // 32):
        even, odd = np.zeros(n, f), np.zeros(n, f)
        for p in range(16):
            e = 32 * s + 2 * p
            even = _ftz(even + kz[:, e] * qz[e])
            odd = _ftz(odd + kz[:, e + 1] * qz[e + 1])
        acc = _ftz(acc + _ftz(even + odd))
    c = f(scale) * f(1.44269504088896341)
    bias = -(acc.max() * c)
    t = np.maximum(_fma(acc, np.full(n, c, f), np.full(n, bias, f)), f(-125.0))
    exps = _exp2_amx(t)
    inv = f(1.0) / _lane_sum(exps)
    pb = _bf16_round_ftz(exps)  # as VCVTNE2PS2BF16 rounds
    vz = _ftz(values)
    out = np.zeros(d, f)
    for k0 in range(0, n, 32):
        even, odd = np.zeros(d, f), np.zeros(d, f)
        for j in range(k0, min(k0 + 32, n), 2):
            even = _ftz(even + pb[j] * vz[j])
            if j + 1 < n:
                odd = _ftz(odd + pb[j + 1] * vz[j + 1])
        out = _ftz(out + _ftz(even + odd))
    return (out * inv).astype(f)


def _tiled_reference(q, cache, table, visible, scale, row=None) -> torch.Tensor:
    s_, ql, h, d = q.shape
    kvh, bs = cache.shape[1], cache.shape[3]
    out = torch.empty(s_, ql, h, d, dtype=torch.float32)
    kc, vc, qf = cache[0].float().numpy(), cache[1].float().numpy(), q.float().numpy()
    for s in range(s_):
        for i in range(ql):
            pos = np.arange(int(visible[s, i]))
            blk, off = table[s].numpy()[pos // bs], pos % bs
            for head in range(h):
                kv_head = head // (h // kvh)
                got = (row or _tiled_row)(qf[s, i, head], kc[kv_head, blk, off], vc[kv_head, blk, off], scale)
                out[s, i, head] = torch.from_numpy(got)
    return out


def _attention_kernel_builds(kernel) -> list:
    """(name, module) of every register-tiled bf16 attention this CPU can run: this build's, and the
    AVX2 build (-march=haswell) where this CPU has AVX-512 too."""
    builds = [("native", kernel)]
    if {"avx512f", "avx2", "fma"} <= cpu_ops.cpu_flags():
        builds.append(("haswell", cpu_ops.build(name="phalanx_cpu_ops_avx2", march="haswell", variant="haswell")))
    return builds


@pytest.mark.parametrize("head_dim,max_len,qlen,group", [(64, 70, 3, 3), (32, 300, 1, 2), (128, 40, 2, 1),
                                                         (96, 33, 1, 4), (64, 530, 1, 1), (64, 150, 5, 3)])
def test_tiled_bf16_attention_is_its_order_bit_for_bit(kernel, head_dim, max_len, qlen, group) -> None:
    """The register-tiled bf16 task on AVX2 + FMA computes VDPBF16PS's pair steps under DAZ / FTZ, the
    same 16-lane tree, softmax and per-key FMAs as the AVX512-BF16 task: the numpy model of that order
    (above) gives its float32 result (`decode_attention_f32`) bit for bit, across 16-key groups,
    64-key blocks, 4-row tiles and their remainders, value blocks and a masked tail.
    Checked on every AVX2 build this CPU can run (an AVX512-BF16 CPU also runs the haswell build)."""
    q, cache, table, visible = _case(11 + head_dim, seqs=2, qlen=qlen, kvh=2, group=group, head_dim=head_dim,
                                     block_size=16, max_len=max_len, dtype=torch.bfloat16)
    cache[0, 0, 0, 0, :4] = torch.tensor([1e-39, -1e-39, 0.0, 3e-39]).bfloat16()  # denormal keys read as zero
    want = _tiled_reference(q, cache, table, visible, head_dim**-0.5)
    ran = 0
    for name, module in _attention_kernel_builds(kernel):
        if name == "native" and "avx512_bf16" in cpu_ops.cpu_flags():
            continue  # the AVX512-BF16 task: the same order by design, compared with the haswell build below
        got = module.decode_attention_f32(q, cache, table, visible, head_dim**-0.5, TILED)  # every float32 bit
        assert torch.equal(got, want), f"{name}: {(got != want).sum().item()} of {got.numel()} elements differ"
        assert torch.equal(module.decode_attention(q, cache, table, visible, head_dim**-0.5, TILED), want.bfloat16())
        ran += 1
    if not ran:
        pytest.skip("no AVX2 + FMA build can run on this CPU")


@pytest.mark.parametrize("path", AMX_PATHS)
@pytest.mark.parametrize("head_dim,max_len,qlen,group", [(64, 70, 3, 3), (32, 300, 1, 2), (128, 40, 2, 1),
                                                         (96, 33, 1, 4), (64, 530, 1, 1), (64, 150, 7, 3)])
def test_amx_attention_is_its_order_bit_for_bit(path, head_dim, max_len, qlen, group) -> None:
    """The AMX task's float32 result (`decode_attention_f32`) is the numpy model of its order
    (`_amx_row`) bit for bit: across 16-key score tiles, 32-key value steps, 16-row groups, staged
    and in-place keys, a masked tail and denormal keys (read as zero). The SDM leaves the tile
    instruction's internal order to the implementation: this checks it on the CPU that runs, and
    the emulated tiles (csrc/amx_emulation.h) against the same model on any AVX512-BF16 CPU."""
    kernel, _ = _attention_on(path)
    q, cache, table, visible = _case(11 + head_dim, seqs=2, qlen=qlen, kvh=2, group=group, head_dim=head_dim,
                                     block_size=16, max_len=max_len, dtype=torch.bfloat16)
    cache[0, 0, 0, 0, :4] = torch.tensor([1e-39, -1e-39, 0.0, 3e-39]).bfloat16()  # denormal keys read as zero
    want = _tiled_reference(q, cache, table, visible, head_dim**-0.5, row=_amx_row)
    got = kernel.decode_attention_f32(q, cache, table, visible, head_dim**-0.5, AMX)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} elements differ"
    assert torch.equal(kernel.decode_attention(q, cache, table, visible, head_dim**-0.5, AMX), want.bfloat16())


def _bf16_round_ftz(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 (as float32) the way VCVTNEPS2BF16 rounds: zero and denormals to signed zero,
    the rest to nearest even (no NaN in these tests)."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16) << 16
    tiny = (bits & np.uint32(0x7F800000)) == 0
    return np.where(tiny, bits & np.uint32(0x80000000), rounded).astype(np.uint32).view(np.float32)


def _silu_mul_model(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu_mul's vector steps (elementwise.cpp, the AVX512-BF16 build) in numpy float32."""
    f = np.float32
    x = f(0) - gate
    e = _exp_nonpositive(np.minimum(x, f(88.0)))  # exp_ps: the polynomial on [-87, 88], +inf above 88.72
    e = np.where(x > f(88.7228), f(np.inf), e)
    return _bf16_round_ftz(_bf16_round_ftz(gate / (f(1.0) + e)) * up)


@pytest.mark.parametrize("rows,inter", [(3, 48), (2, 1536)])
def test_silu_mul_avx2_is_its_order_bit_for_bit(kernel, rows, inter) -> None:
    """SiLU-and-multiply's AVX2 steps are the AVX512-BF16 build's (exp_ps's polynomial, a division,
    VCVTNEPS2BF16's rounding twice): a numpy model of them gives its output bit for bit, on every AVX2
    build this CPU can run (the whole row in 16-element steps: no scalar tail here)."""
    gu = _bf16((rows, 2 * inter), 21, 4.0)
    gu[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-39, 90.0, -90.0, 3.0]).bfloat16()
    gate, up = gu[:, :inter].float().numpy(), gu[:, inter:].float().numpy()
    want = torch.from_numpy(_silu_mul_model(gate, up)).bfloat16()
    ran = 0
    for name, module in _attention_kernel_builds(kernel):
        if name == "native" and "avx512f" in cpu_ops.cpu_flags():
            continue  # the AVX-512 steps: the same by design, compared through the haswell build's
        got = module.silu_mul(gu)
        assert torch.equal(got, want), f"{name}: {(got != want).sum().item()} of {got.numel()} differ"
        ran += 1
    if not ran:
        pytest.skip("no AVX2 build can run on this CPU")


def test_kernel_rejects_bad_inputs(kernel) -> None:
    q, cache, table, visible = _case(1, seqs=2, qlen=1, kvh=2, group=2, head_dim=8, block_size=4, max_len=9,
                                     dtype=torch.float32)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernel.decode_attention(q.bfloat16(), cache, table, visible, 1.0, TILED)
    with pytest.raises(RuntimeError, match="int64"):
        kernel.decode_attention(q, cache, table.int(), visible, 1.0, TILED)
    with pytest.raises(RuntimeError, match="dtype must be bfloat16 or float32"):
        kernel.decode_attention(q.half(), cache.half(), table, visible, 1.0, TILED)
    with pytest.raises(RuntimeError, match="batch sizes disagree"):
        kernel.decode_attention(q, cache, table[:1], visible, 1.0, TILED)
    bad = table.clone()
    bad[1, 0] = cache.shape[2]
    with pytest.raises(RuntimeError, match=f"block id {cache.shape[2]} outside the cache's {cache.shape[2]} blocks"):
        kernel.decode_attention(q, cache, bad, visible, 1.0, TILED)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        kernel.decode_attention(q, cache.transpose(2, 3), table, visible, 1.0, TILED)


def test_backend_switch(monkeypatch) -> None:
    monkeypatch.setenv("PHALANX_KERNELS", "torch")
    assert cpu_ops.kernel_for(torch.bfloat16) is None
    monkeypatch.setenv("PHALANX_KERNELS", "auto")
    assert cpu_ops.kernel_for(torch.float16) is None  # not a kernel dtype: the reference serves it
    assert cpu_ops.kernel_for(torch.bfloat16) is not None
    monkeypatch.setenv("PHALANX_KERNELS", "fastest")
    with pytest.raises(ValueError, match="PHALANX_KERNELS='fastest' is not valid; valid: auto, torch, cpp"):
        cpu_ops.kernel_for(torch.bfloat16)


# ---- the elementwise ops of a decoder layer (bf16) ------------------------------------------------
def _bf16(shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _close_to_reference(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Same rounding steps as the PyTorch ops: equal to the last bit except where float32 reduction
    order or exp's last ulp flips a rounding (one bf16 ulp, rarely)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype == torch.bfloat16
    diff = (got.float() - ref.float()).abs()
    ulp = ref.float().abs().clamp_min(1e-30) * 2.0**-7
    assert bool((diff <= ulp).all()), float((diff / ulp).max())
    assert (got == ref).float().mean() > 0.99


@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 256), (33, 200)])
def test_rms_norm_and_residual_add(kernel, rows: int, hidden: int) -> None:
    from phalanx.layers.norm import RMSNorm

    norm = RMSNorm(hidden, 1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(_bf16((hidden,), 1) + 1)
    x, res = _bf16((rows, hidden), 2, 3.0), _bf16((rows, hidden), 3)
    ref, ref_normed_sum = norm(x), norm(x + res)
    norm.kernel = kernel
    _close_to_reference(norm(x), ref)
    normed, total = norm.add_forward(x, res)
    assert torch.equal(total, x + res)  # one rounding, exactly torch's
    _close_to_reference(normed, ref_normed_sum)


def test_rotary_is_bitwise_the_reference_on_strided_views(kernel) -> None:
    from phalanx.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(64, 512, 10000.0, None)
    qkv = _bf16((9, (6 + 2 * 2) * 64), 5)  # fused projection: 6 query heads, 2 KV heads
    qk = qkv[:, : 8 * 64].view(9, 8, 64)  # a strided view, as the attention layer passes it
    positions = torch.tensor([0, 1, 2, 3, 100, 101, 5, 300, 511])
    ref = rot.rotate(positions, qk, {})
    rot.kernel = kernel
    assert torch.equal(rot.rotate(positions, qk, {}), ref)
    q, k = qk[:, :6], qk[:, 6:]
    rot.kernel = None
    ref_q, ref_k = rot(positions, q, k, {})
    rot.kernel = kernel
    got_q, got_k = rot(positions, q, k, {})
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


@pytest.mark.parametrize("rows,inter", [(1, 15), (3, 16), (5, 17), (33, 704), (2, 1408)])
def test_silu_mul_matches_the_reference(kernel, rows: int, inter: int) -> None:
    from phalanx.layers.mlp import GatedMLP

    x = _bf16((rows, 2 * inter), rows * inter, 4.0)
    x[0, : min(inter, 6)] = torch.tensor([0.0, -0.0, 95.0, -95.0, 300.0, -300.0])[: min(inter, 6)].bfloat16()
    gate, up = x.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    # a different exp polynomial than torch's Sleef can flip a bf16 rounding (one ulp, rarely)
    _close_to_reference(kernel.silu_mul(x), ref)
    mlp = GatedMLP(32, inter).bfloat16()
    with torch.no_grad():  # the served layers start unfilled (their weights load); fill these
        for p in mlp.parameters():
            p.copy_(_bf16(tuple(p.shape), 40 + p.shape[0], 0.2))
    h = _bf16((rows, 32), 9)
    with torch.no_grad():
        want = mlp(h)
        mlp.kernel = kernel
        torch.testing.assert_close(mlp(h), want, atol=2e-2, rtol=2e-2)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 6),
    vocab=st.sampled_from([1, 2, 15, 16, 17, 31, 33, 100, 925, 4099]),
    levels=st.sampled_from([2, 5, 1000]),  # few distinct values: many ties
    special=st.sampled_from(["none", "nan", "-inf", "+inf"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_argmax_is_torchs(seed, rows, vocab, levels, special, dtype) -> None:
    """The first index of the maximum, NaN counting as the maximum: exactly torch.argmax."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, vocab), generator=gen).float().to(dtype)
    if special != "none":
        value = {"nan": float("nan"), "-inf": float("-inf"), "+inf": float("inf")}[special]
        hit = torch.rand(rows, vocab, generator=gen) < 0.05
        x[hit] = value
        x[-1] = value  # a row of nothing else
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))
    wide = torch.cat([x, x], dim=1)[:, 1:]  # a strided view
    assert torch.equal(cpu_ops.argmax(wide), wide.argmax(dim=-1))


def test_argmax_falls_back_to_torch(monkeypatch) -> None:
    x = torch.randn(3, 50, dtype=torch.float64)  # a dtype the kernel does not serve
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))
    monkeypatch.setenv("PHALANX_KERNELS", "torch")
    y = torch.randn(3, 50)
    assert torch.equal(cpu_ops.argmax(y), y.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_is_the_two_index_copies(kernel, dtype) -> None:
    """Keys and values of N real tokens land where index_copy_ puts them (strided views of a fused
    projection, as the attention layer passes them); padding rows past N write nothing."""
    gen = torch.Generator().manual_seed(11)
    kvh, nb, bs, d, t = 2, 6, 4, 16, 7
    cache = torch.randn(2, kvh, nb, bs, d, generator=gen).to(dtype)
    qkv = torch.randn(t, (4 + 2 * kvh) * d, generator=gen).to(dtype)
    k = qkv[:, 4 * d : (4 + kvh) * d].view(t, kvh, d)
    v = qkv[:, (4 + kvh) * d :].view(t, kvh, d)
    slots = torch.tensor([5, 0, 23, 9, 17])  # 5 real tokens, 2 padding rows
    want = cache.clone()
    for plane, x in ((0, k), (1, v)):
        want[plane].view(kvh, nb * bs, d).index_copy_(1, slots, x[: len(slots)].transpose(0, 1))
    got = cache.clone()
    kernel.cache_write(got, k, v, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="slot 24 outside the cache's 24 slots"):
        kernel.cache_write(got, k, v, torch.tensor([24]))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernel.cache_write(got, k.float() if dtype != torch.float32 else k.double(), v, slots)


def test_elementwise_ops_reject_what_they_do_not_serve(kernel) -> None:
    with pytest.raises(RuntimeError, match="expects bfloat16"):
        kernel.rms_norm(torch.randn(2, 8), torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be bfloat16 \[8\]"):
        kernel.rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(4).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="must be \\[T, N, D\\] with even D"):
        kernel.rotary(torch.randn(2, 3, 7).bfloat16(), torch.ones(2, 1, 7).bfloat16(), torch.ones(2, 1, 7).bfloat16())
    with pytest.raises(RuntimeError, match=r"must be \[T, 2 \* I\]"):
        kernel.silu_mul(torch.randn(2, 7).bfloat16())
    with pytest.raises(RuntimeError, match="with V > 0"):
        kernel.argmax_rows(torch.randn(2, 0))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernel.argmax_rows(torch.randn(2, 3, dtype=torch.float64))


def test_attach_gives_bf16_models_the_kernels_only(monkeypatch) -> None:
    from phalanx.layers.mlp import GatedMLP
    from phalanx.layers.norm import RMSNorm
    from phalanx.layers.rotary import RotaryEmbedding

    def model():
        return torch.nn.ModuleList([RMSNorm(8), RotaryEmbedding(8, 16, 10000.0, None), GatedMLP(8, 16)])

    assert cpu_ops.attach(model(), torch.float32) == 0  # float32 keeps the reference ops (parity)
    m = model()
    assert cpu_ops.attach(m, torch.bfloat16) == 3 and all(x.kernel is not None for x in m)
    monkeypatch.setenv("PHALANX_KERNELS", "torch")
    assert cpu_ops.attach(model(), torch.bfloat16) == 0


def test_a_finished_build_is_imported_without_torchs_build_check(tmp_path, monkeypatch) -> None:
    """A build folder whose stamp says the build is the one asked for is imported directly (torch's
    ``load`` runs ninja first: 0.2-0.5 s of every engine start); a stamp for other flags, a missing
    stamp or a library that does not import go through torch's ``load``, which then stamps it."""
    import json
    import shutil

    import torch.utils.cpp_extension as extension

    if cpu_ops.load() is None:
        pytest.skip("the C++ kernels do not build here")
    built = cpu_ops.build_dir() / "phalanx_cpu_ops.so"
    monkeypatch.setenv("PHALANX_KERNEL_CACHE", str(tmp_path))
    folder = cpu_ops.build_dir()
    assert folder.parent == tmp_path
    shutil.copy(built, folder / "phalanx_cpu_ops.so")
    stamp = folder / cpu_ops.BUILD_STAMP
    as_asked = {"name": "phalanx_cpu_ops", "march": "native", "cflags": list(cpu_ops.CFLAGS)}
    calls: list[dict] = []
    monkeypatch.setattr(extension, "load", lambda **kwargs: calls.append(kwargs) or "through torch")

    stamp.write_text(json.dumps(as_asked))
    module = cpu_ops.build()
    assert calls == [] and hasattr(module, "gemm")
    for damage in (lambda: stamp.write_text(json.dumps({**as_asked, "cflags": ["-O0"]})),  # built otherwise
                   stamp.unlink):  # an interrupted or older build
        damage()
        assert cpu_ops.build() == "through torch"
        assert json.loads(stamp.read_text()) == as_asked  # stamped once torch's load returned
    assert len(calls) == 2 and calls[-1]["build_directory"] == str(folder)
    other = cpu_ops.build_dir("damaged")  # (a new path: the process has the first library mapped)
    (other / "phalanx_cpu_ops.so").write_bytes(b"not a library")
    (other / cpu_ops.BUILD_STAMP).write_text(json.dumps(as_asked))
    assert cpu_ops.build(variant="damaged") == "through torch" and calls[-1]["build_directory"] == str(other)


def test_a_stale_build_lock_is_removed_a_fresh_one_kept(tmp_path) -> None:
    import os
    import time

    lock = tmp_path / "lock"
    assert not cpu_ops.clear_stale_lock(tmp_path)  # no lock
    lock.write_text("")
    assert not cpu_ops.clear_stale_lock(tmp_path, max_age_s=600) and lock.exists()  # a builder is at work
    old = time.time() - 3600
    os.utime(lock, (old, old))  # left by a build killed an hour ago
    assert cpu_ops.clear_stale_lock(tmp_path, max_age_s=600) and not lock.exists()
    lock.write_text("")
    os.utime(lock, (old, old))
    cpu_ops._wait_for_other_builder(tmp_path, max_age_s=600)  # returns instead of waiting forever
    assert not lock.exists()


def test_missing_sources_are_a_clear_error(monkeypatch, tmp_path) -> None:
    """A package installed without its csrc/ folder says where the sources should be."""
    monkeypatch.setattr(cpu_ops, "CSRC", tmp_path / "csrc")
    with pytest.raises(FileNotFoundError, match=r"csrc/gemm.cpp.*pip install -e \."):
        cpu_ops.source_paths()


def test_the_portable_build_compiles_and_agrees(kernel) -> None:
    """Machines without AVX-512 get the plain C++ paths (-march=x86-64-v2 here): they must build and
    give the same results (bf16 outputs identical after rounding, fp32 within float32 noise)."""
    portable = cpu_ops.build(name="phalanx_cpu_ops_portable", march="x86-64-v2", variant="x86-64-v2")
    for dtype in (torch.bfloat16, torch.float32):
        q, cache, table, visible = _case(3, seqs=3, qlen=2, kvh=2, group=2, head_dim=64, block_size=16,
                                         max_len=150, dtype=dtype)
        got = portable.decode_attention(q, cache, table, visible, 0.125, TILED)
        want = kernel.decode_attention(q, cache, table, visible, 0.125, TILED)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6 if dtype == torch.float32 else 8e-3, rtol=1e-5)
    x, res, w = _bf16((5, 256), 1), _bf16((5, 256), 2), _bf16((256,), 3)
    assert torch.equal(portable.rms_norm(x, w, 1e-5), kernel.rms_norm(x, w, 1e-5))
    for a, b in zip(portable.add_rms_norm(x, res, w, 1e-5), kernel.add_rms_norm(x, res, w, 1e-5)):
        assert torch.equal(a, b)
    qk, cos, sin = _bf16((4, 6, 64), 4), _bf16((4, 1, 64), 5), _bf16((4, 1, 64), 6)
    assert torch.equal(portable.rotary(qk, cos, sin), kernel.rotary(qk, cos, sin))
    gu = _bf16((3, 2 * 40), 7, 4.0)
    _close_to_reference(portable.silu_mul(gu), kernel.silu_mul(gu))
    logits = torch.randint(0, 7, (4, 333)).float()
    for x in (logits, logits.bfloat16()):
        assert torch.equal(portable.argmax_rows(x), kernel.argmax_rows(x))
    w = _bf16((40, 33), 8)
    assert torch.equal(portable.pack_pairs(w, 1), kernel.pack_pairs(w, 1))
    assert portable.gemm_isas() == []  # no AVX2 + FMA: bf16 linears stay on oneDNN there


def test_the_avx2_build_computes_what_this_one_does(kernel) -> None:
    """A CPU with AVX2 + FMA but no AVX-512 (-march=haswell here) builds the GEMM's AVX2 path only,
    and it gives the bits this build's best non-AMX path gives (the paths share one summation order;
    the AMX tiles have their own)."""
    if not kernel.gemm_isas():
        pytest.skip("this CPU has no AVX2 + FMA: the haswell build could not run here")
    if "avx512f" not in cpu_ops.cpu_flags():
        pytest.skip("this CPU has no AVX-512: its own build is an AVX2 build (the order tests check it)")
    avx2 = cpu_ops.build(name="phalanx_cpu_ops_avx2", march="haswell", variant="haswell")
    assert avx2.gemm_isas() == [cpu_ops.GEMM_ISAS["avx2"]]
    w, x, b = _bf16((300, 577), 1), _bf16((40, 577), 2), _bf16((300,), 3)
    packed = kernel.pack_pairs(w, 1)
    assert torch.equal(avx2.pack_pairs(w, 1), packed)
    best = next(i for i in kernel.gemm_isas() if i != cpu_ops.GEMM_ISAS["amx"])
    assert torch.equal(avx2.gemm(x, packed, 300, b, 1), kernel.gemm(x, packed, 300, b, best))
    q, cache, table, visible = _case(3, seqs=3, qlen=2, kvh=2, group=2, head_dim=64, block_size=16, max_len=150,
                                     dtype=torch.bfloat16)
    got = avx2.decode_attention(q, cache, table, visible, 0.125, TILED)
    torch.testing.assert_close(got.float(), kernel.decode_attention(q, cache, table, visible, 0.125, TILED).float(),
                               atol=8e-3, rtol=1e-5)
