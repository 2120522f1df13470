"""The batch-invariant bf16 GEMM (csrc/gemm.cpp): every output follows its path's stated summation
order bit for bit (a float32 reference of that order), so a row's result never depends on how many
rows the call has, which rows share it or how many threads run it; the AVX2 and AVX512-BF16 paths
share one order (the same bits), the AMX path has its own (the tiles' hardware order); and it is
close to the exact product. Each path is tested where this machine's build has it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from phalanx.ops import cpu as cpu_ops
from tests.emulated_amx import can_emulate_amx, emulated_amx_module

AMX, AVX512_BF16, AVX2 = (cpu_ops.GEMM_ISAS[name] for name in ("amx", "avx512_bf16", "avx2"))


def _kernel():  # noqa: ANN202
    module = cpu_ops.kernel_for(torch.bfloat16)
    if module is None:
        pytest.skip("the C++ kernels do not build here (no compiler, or PHALANX_KERNELS=torch)")
    return module


def _paths() -> list[int]:
    module = cpu_ops.kernel_for(torch.bfloat16)
    return [] if module is None else list(module.gemm_isas())


# The paths by name; "amx_emulated": the AMX path of the build whose tiles are software
# (csrc/amx_emulation.h), which any AVX512-BF16 CPU runs: the AMX code is tested without AMX too.
PATHS = [
    pytest.param("amx", id="amx", marks=pytest.mark.skipif(
        AMX not in _paths(), reason="this CPU has no AMX-BF16 (or the kernels do not build, or Linux refused "
                                    "the tile state)")),
    pytest.param("amx_emulated", id="amx_emulated", marks=pytest.mark.skipif(
        not can_emulate_amx(), reason="this CPU has no AVX512-BF16 (or the kernels do not build)")),
    pytest.param("avx512_bf16", id="avx512_bf16", marks=pytest.mark.skipif(
        AVX512_BF16 not in _paths(), reason="this CPU has no AVX512-BF16 (or the kernels do not build)")),
    pytest.param("avx2", id="avx2", marks=pytest.mark.skipif(
        AVX2 not in _paths(), reason="this CPU has no AVX2 + FMA (or the kernels do not build)")),
]


def _on(path: str):  # noqa: ANN202
    """The module and GEMM path id a PATHS name runs on."""
    if path == "amx_emulated":
        return emulated_amx_module(), AMX
    return _kernel(), cpu_ops.GEMM_ISAS[path]


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, isa: int = AVX2) -> torch.Tensor:
    """The order gemm.cpp states for path `isa`, in float32 torch ops (a bf16 product is exact in
    float32, so each add rounds once, as a fused multiply-add does), then the bias, then one rounding
    to bf16. AVX2 / AVX512-BF16: per output one accumulator; for each k pair the odd element's product
    added, then the even one's. AMX: K in steps of 16 pairs (zero-padded); per step the even
    elements' products summed in pair order, the odd ones' likewise, then the accumulator plus
    (even sum + odd sum)."""
    xf, wf = x.float(), w.float()
    pairs = (x.shape[1] + 1) // 2
    if isa == AMX:
        pairs = -(-pairs // 16) * 16
    pad = 2 * pairs - x.shape[1]  # an odd K's last pair is (x, 0) x (w, 0); AMX pads whole steps
    xf, wf = torch.cat([xf, xf.new_zeros(xf.shape[0], pad)], 1), torch.cat([wf, wf.new_zeros(wf.shape[0], pad)], 1)
    acc = torch.zeros(x.shape[0], w.shape[0])
    if isa == AMX:
        for step in range(pairs // 16):
            even, odd = torch.zeros_like(acc), torch.zeros_like(acc)
            for p in range(16 * step, 16 * step + 16):
                even = even + xf[:, 2 * p, None] * wf[None, :, 2 * p]
                odd = odd + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
            acc = acc + (even + odd)
    else:
        for p in range(pairs):
            acc = acc + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
            acc = acc + xf[:, 2 * p, None] * wf[None, :, 2 * p]
    if bias is not None:
        acc = acc + bias.float()
    return acc.bfloat16()


def _case(n: int, k: int, rows: int, seed: int, bias: bool):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    x = (torch.randn(rows, k, generator=g) * 2).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return w, x, b


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=40, deadline=None)
@example(n=1, k=2265, rows=3, bias=False, seed=445)  # one output column, long odd K
@example(n=17, k=1, rows=7, bias=True, seed=1)  # K = 1: a single half pair
@example(n=33, k=77, rows=11, bias=True, seed=2)  # the fewest rows whose chunk splits each weight panel once (AVX2)
@given(n=st.integers(1, 300), k=st.integers(1, 700), rows=st.integers(1, 40), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_gemm_follows_its_summation_order(path: str, n: int, k: int, rows: int, bias: bool, seed: int) -> None:
    module, isa = _on(path)
    w, x, b = _case(n, k, rows, seed, bias)
    assert torch.equal(module.gemm(x, module.pack_pairs(w, isa), n, b, isa), reference(x, w, b, isa))


@pytest.mark.parametrize("path", PATHS)
def test_the_order_is_pinned(path: str) -> None:
    """Other fixed orders — each pair's even element first; the other path family's order — round
    differently on a few of these 65536 outputs: the kernel matches its own stated order there too,
    so the order test pins that order, not just any fixed one."""
    module, isa = _on(path)
    w, x, _ = _case(1024, 1024, 64, 3, False)
    xf, wf = x.float(), w.float()
    even_first = torch.zeros(64, 1024)
    for p in range(512):
        even_first = even_first + xf[:, 2 * p, None] * wf[None, :, 2 * p]
        even_first = even_first + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
    want = reference(x, w, None, isa)
    assert not torch.equal(even_first.bfloat16(), want)
    assert not torch.equal(reference(x, w, None, AVX2 if isa == AMX else AMX), want)
    assert torch.equal(module.gemm(x, module.pack_pairs(w, isa), 1024, None, isa), want)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (2816, 512), (100, 33)])
def test_a_rows_result_is_the_same_for_every_row_count_and_thread_count(path: str, n: int, k: int) -> None:
    """Batch invariance: row r of an M-row call equals the same row computed alone, inside any
    sub-batch, and with one thread instead of two (M from 1 past the 96-row work item; on AMX across
    the 16-row tiles)."""
    module, isa = _on(path)
    w, x, b = _case(n, k, 203, n + k, True)
    packed = module.pack_pairs(w, isa)
    full = module.gemm(x, packed, n, b, isa)
    for r in (0, 5, 6, 95, 96, 97, 202):
        assert torch.equal(module.gemm(x[r : r + 1], packed, n, b, isa), full[r : r + 1])
    for lo, hi in ((0, 4), (3, 9), (1, 100), (90, 203)):
        assert torch.equal(module.gemm(x[lo:hi], packed, n, b, isa), full[lo:hi])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(module.gemm(x, packed, n, b, isa), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [1024, 1040])
def test_a_large_output_follows_the_order(path: str, n: int) -> None:
    """Outputs of 4 MiB and more: the AMX path writes them past the caches in whole 64-byte lines
    when N is a multiple of 32 (N = 1024; with N = 1040 it stores as usual) — the same bits as the
    order, and as the rows computed alone."""
    module, isa = _on(path)
    w, x, b = _case(n, 64, 2048, n, True)
    packed = module.pack_pairs(w, isa)
    full = module.gemm(x, packed, n, b, isa)
    assert torch.equal(full, reference(x, w, b, isa))
    assert torch.equal(module.gemm(x[1000:1003], packed, n, b, isa), full[1000:1003])


def test_the_avx2_and_avx512_bf16_paths_compute_the_same_bits() -> None:
    """The AVX2 path emulates the AVX512-BF16 dot product's steps: the same results, so ranks on
    CPUs with and without AVX512-BF16 agree (an AMX CPU agrees with them on its AVX512-BF16 path,
    PHALANX_CPU_ISA=avx512_bf16)."""
    module = _kernel()
    if not {AVX512_BF16, AVX2} <= set(module.gemm_isas()):
        pytest.skip("needs both paths: a CPU with AVX512-BF16")
    for n, k, rows in ((1024, 1024, 64), (49, 1537, 5), (3072, 576, 1)):
        w, x, b = _case(n, k, rows, k, rows % 2 == 1)
        packed = module.pack_pairs(w, AVX2)
        assert torch.equal(module.gemm(x, packed, n, b, AVX2), module.gemm(x, packed, n, b, AVX512_BF16))


def test_the_amx_packing_pads_whole_tile_steps() -> None:
    """The AMX path reads the weights in steps of 16 pairs: its packing puts zero pairs after each
    column block's pairs up to whole steps (a view of the same shape whose block stride skips them;
    the other paths' packing has none), and each path refuses the other's packing where they
    differ, and a weight of another K that pads to the same steps."""
    module = _kernel()
    w = torch.randn(40, 70).bfloat16()  # 35 pairs: 48 on AMX
    plain, amx = module.pack_pairs(w, AVX2), module.pack_pairs(w, AMX)
    assert plain.shape == amx.shape == (3, 35, 16, 2)
    assert plain.stride(0) == 35 * 32 and amx.stride(0) == 48 * 32
    assert torch.equal(amx, plain)
    whole = amx.as_strided((3, 48, 16, 2), (48 * 32, 32, 2, 1))
    assert torch.equal(whole[:, :35], plain) and not whole[:, 35:].any()
    assert module.pack_pairs(w[:, :64], AMX).is_contiguous()  # whole steps: no padding
    with pytest.raises(RuntimeError, match="isa 4 is not a GEMM path"):
        module.pack_pairs(w, 4)
    for isa in module.gemm_isas():
        other = plain if isa == AMX else amx
        with pytest.raises(RuntimeError, match=f"pack_pairs of an \\[N, K\\] weight for path {isa}"):
            module.gemm(torch.randn(2, 70).bfloat16(), other, 40, None, isa)
        with pytest.raises(RuntimeError, match=f"pack_pairs of an \\[N, K\\] weight for path {isa}"):
            module.gemm(torch.randn(2, 72).bfloat16(), module.pack_pairs(w, isa), 40, None, isa)


@pytest.mark.parametrize("path", PATHS)
def test_gemm_is_close_to_the_exact_product(path: str) -> None:
    module, isa = _on(path)
    w, x, b = _case(1000, 1408, 9, 0, True)
    got = module.gemm(x, module.pack_pairs(w, isa), 1000, b, isa).double()
    exact = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(got, exact, atol=2e-2, rtol=1e-2)  # one bf16 rounding (2^-9) and float32 sums


def test_gemm_refuses_mismatched_inputs() -> None:
    module = _kernel()
    isa = module.gemm_isas()[0]
    packed = module.pack_pairs(torch.randn(32, 16).bfloat16(), isa)
    with pytest.raises(RuntimeError, match=f"weight for path {isa} with K = x.size\\(1\\) = 18"):
        module.gemm(torch.randn(2, 18).bfloat16(), packed, 32, None, isa)
    with pytest.raises(RuntimeError, match="expects bfloat16"):
        module.gemm(torch.randn(2, 16), packed, 32, None, isa)
    with pytest.raises(RuntimeError, match="bias must be \\[32\\]"):
        module.gemm(torch.randn(2, 16).bfloat16(), packed, 32, torch.zeros(31).bfloat16(), isa)
    with pytest.raises(RuntimeError, match="path 7 is not in this build"):
        module.gemm(torch.randn(2, 16).bfloat16(), packed, 32, None, 7)
    assert module.gemm(torch.randn(0, 16).bfloat16(), packed, 32, None, isa).shape == (0, 32)


def test_embedding_rows_reads_a_packed_table_back() -> None:
    """A tied model's token lookup reads the logits head's packed table: the same rows as the
    row-major table (odd K, a vocabulary that does not fill its last block of 16), ids checked
    against the real row count, not the padded one."""
    module = _kernel()
    g = torch.Generator().manual_seed(5)
    for v, k in ((49, 577), (16, 64), (1, 1), (300, 2)):
        table = torch.randn(v, k, generator=g).bfloat16()
        ids = torch.cat([torch.tensor([0, v - 1]), torch.randint(0, v, (29,), generator=g)])
        for isa in (AVX2, AMX):  # the AMX packing pads K to whole tile steps: the rows are the same
            packed = module.pack_pairs(table, isa)
            assert torch.equal(module.embedding_rows(packed, ids, k, v), table[ids])
        assert torch.equal(module.embedding_rows(table, ids, k, v), table[ids])
        assert module.embedding_rows(packed, ids[:0], k, v).shape == (0, k)
    packed = module.pack_pairs(torch.randn(49, 8).bfloat16(), AVX2)
    for bad in (49, 63, -1):  # 49..63 are the last block's zero padding: still out of range
        with pytest.raises(RuntimeError, match=f"token id {bad} is out of range \\[0, 49\\)"):
            module.embedding_rows(packed, torch.tensor([3, bad]), 8, 49)
    with pytest.raises(RuntimeError, match="ids must be a 1-D int64 tensor"):
        module.embedding_rows(packed, torch.tensor([3], dtype=torch.int32), 8, 49)
    with pytest.raises(RuntimeError, match="pack_pairs of a bfloat16 \\[V, K\\] table with K = 10"):
        module.embedding_rows(packed, torch.tensor([3]), 10, 49)
    with pytest.raises(RuntimeError, match="V = 65 rows, but the packed table holds 64"):
        module.embedding_rows(packed, torch.tensor([3]), 8, 65)


def test_the_isa_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """PHALANX_CPU_ISA caps the GEMM path (auto: the best this build has); onednn selects oneDNN;
    with the kernels off there is no GEMM path at all."""
    module = _kernel()
    best = module.gemm_isas()[0]
    monkeypatch.setenv("PHALANX_CPU_ISA", "auto")
    assert cpu_ops.gemm_isa() == best
    monkeypatch.setenv("PHALANX_CPU_ISA", "avx2")
    assert cpu_ops.gemm_isa() == (AVX2 if AVX2 in module.gemm_isas() else 0)
    monkeypatch.setenv("PHALANX_CPU_ISA", "avx512_bf16")
    assert cpu_ops.gemm_isa() == next(i for i in module.gemm_isas() if i <= AVX512_BF16)
    monkeypatch.setenv("PHALANX_CPU_ISA", "amx")
    assert cpu_ops.gemm_isa() == best
    monkeypatch.setenv("PHALANX_CPU_ISA", "onednn")
    assert cpu_ops.gemm_isa() == 0
    monkeypatch.setenv("PHALANX_CPU_ISA", "amx_emulated")
    if cpu_ops.emulated_amx() is not None:  # the emulated build serves while the switch says so
        assert cpu_ops.gemm_isa() == AMX
        assert cpu_ops.kernel_for(torch.bfloat16) is cpu_ops.emulated_amx()
    monkeypatch.setenv("PHALANX_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="PHALANX_CPU_ISA='avx512' is not valid; valid: auto, amx, avx512_bf16, avx2, "
                                         "amx_emulated, onednn"):
        cpu_ops.gemm_isa()
    monkeypatch.setenv("PHALANX_CPU_ISA", "auto")
    assert cpu_ops.kernel_for(torch.bfloat16) is module
    monkeypatch.setenv("PHALANX_KERNELS", "torch")
    assert cpu_ops.gemm_isa() == 0


@pytest.mark.skipif(AMX not in _paths(), reason="this CPU has no AMX-BF16 to compare the emulated tiles with")
def test_the_emulated_tiles_compute_what_amx_does() -> None:
    """On an AMX CPU, the emulated build's AMX path gives the hardware's bits: across K steps, one and
    two row tiles and column blocks, odd shapes, denormal inputs (read as zero) and large outputs."""
    emulated = emulated_amx_module()
    module = _kernel()
    for n, k, rows in ((1, 2265, 3), (33, 77, 11), (300, 700, 40), (1024, 1024, 64), (1040, 64, 2048)):
        w, x, b = _case(n, k, rows, n + k, rows % 2 == 1)
        x[0, :3] = torch.tensor([1e-39, -3e-39, 2e-39]).bfloat16()
        packed = module.pack_pairs(w, AMX)
        assert torch.equal(emulated.gemm(x, packed, n, b, AMX), module.gemm(x, packed, n, b, AMX)), (n, k, rows)


def test_the_emulated_amx_build_refuses_a_cpu_without_avx512_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    with pytest.raises(ValueError, match="PHALANX_CPU_ISA='amx_emulated' needs a CPU with avx512_bf16 and avx512bw; "
                                         "this one lacks avx512_bf16, avx512bw"):
        cpu_ops.build_emulated_amx()
