"""Pre-packed bf16 linears (layers.linear): a `PackedLinear` computes what its GEMM path computes
(the kernels' batch-invariant GEMM by default, oneDNN's packed linear when selected), keeps one
packed copy of its weight, and a bf16 model loaded through the registry runs on them end to end —
dense layers, a tied and an untied logits head, MoE experts and router, an EAGLE head — every one
on the same path, with logits close to the same model on plain `F.linear`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx import LLM, SamplingParams
from phalanx.layers import linear as linear_module
from phalanx.layers.linear import (
    PackedEmbedding,
    PackedLinear,
    onednn_bf16_supported,
    prepack_linears,
    prepack_supported,
)
from phalanx.layers.moe import SparseMoE
from phalanx.models.llama import CausalLM
from phalanx.ops import cpu as cpu_ops
from tests.tiny_models import make_eagle_head, make_model

pytestmark = pytest.mark.skipif(not prepack_supported(torch.bfloat16), reason="PyTorch built without oneDNN")


def _gemm_path() -> int:
    isa = cpu_ops.gemm_isa()
    if not isa:
        pytest.skip("no batch-invariant GEMM here: the C++ kernels do not build, or the CPU lacks AVX2 + FMA")
    return isa


def _layer(rows: int, bias: bool, n: int = 160, k: int = 96):  # noqa: ANN202
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin, torch.randn(rows, k, generator=g).bfloat16()


@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_the_gemm(rows: int, bias: bool) -> None:
    isa = _gemm_path()
    lin, x = _layer(rows, bias)
    packed = PackedLinear.from_linear(lin)
    module = cpu_ops.load()
    assert packed.isa == isa and packed.packed.shape == (10, 48, 16, 2)  # the pairs layout, one copy
    want = module.gemm(x, module.pack_pairs(lin.weight, isa), 160, lin.bias, isa)
    assert torch.equal(packed(x), want)
    assert torch.equal(packed(x[:, None, :]).squeeze(1), want)  # leading dims
    torch.testing.assert_close(packed(x).float(), F.linear(x, lin.weight, lin.bias).float(), atol=3e-2, rtol=2e-2)


def _onednn_path() -> None:
    if not onednn_bf16_supported():
        pytest.skip("oneDNN's bf16 packed linear does not run on this CPU (needs AVX512BW/VL/DQ or AVX-NE-CONVERT)")


@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_the_onednn_path_is_bitwise_f_linear(rows: int, bias: bool) -> None:
    _onednn_path()
    lin, x = _layer(rows, bias)
    packed = PackedLinear.from_linear(lin, isa=0)
    assert packed._gemm is None
    assert torch.equal(packed(x), F.linear(x, lin.weight, lin.bias))
    assert torch.equal(packed(x[:, None, :]).squeeze(1), packed(x))


def test_prepack_swaps_only_bf16_linears() -> None:
    m = nn.Sequential(nn.Linear(4, 4, dtype=torch.bfloat16), nn.Sequential(nn.Linear(4, 4)), nn.LayerNorm(4))
    assert prepack_linears(m) == 1
    assert isinstance(m[0], PackedLinear) and isinstance(m[1][0], nn.Linear)


def test_the_path_follows_the_isa_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    _gemm_path()
    _onednn_path()
    monkeypatch.setenv("PHALANX_CPU_ISA", "onednn")
    assert PackedLinear(torch.randn(96, 64).bfloat16(), None).isa == 0
    monkeypatch.setenv("PHALANX_KERNELS", "torch")
    monkeypatch.setenv("PHALANX_CPU_ISA", "auto")
    assert PackedLinear(torch.randn(96, 64).bfloat16(), None).isa == 0


def test_without_onednn_bf16_path_zero_leaves_plain_linears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU where oneDNN cannot pack bf16 weights (AVX2 without AVX512BW/VL/DQ; simulated here) and
    the GEMM switched off: nothing is packed, the model serves on F.linear, a path-0 PackedLinear is
    a clear error, and with the GEMM on everything packs as usual."""
    monkeypatch.setattr(linear_module, "onednn_bf16_supported", lambda: False)
    monkeypatch.setenv("PHALANX_CPU_ISA", "onednn")
    assert not prepack_supported(torch.bfloat16)
    with pytest.raises(RuntimeError, match="path 0 .*does not run on this CPU.*valid paths here"):
        PackedLinear(torch.randn(96, 64).bfloat16(), None, isa=0)
    m = nn.Sequential(nn.Linear(4, 4, dtype=torch.bfloat16))
    assert prepack_linears(m, isa=0) == 0 and isinstance(m[0], nn.Linear)
    for arch in ("LlamaForCausalLM", "Qwen2MoeForCausalLM"):  # dense, tied head, MoE experts
        folder = make_model(arch, tmp_path / arch, num_hidden_layers=2)
        llm = LLM(str(folder), dtype="bfloat16")
        assert not _linears(llm.engine.runner.model)
        out = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 5
    monkeypatch.setenv("PHALANX_CPU_ISA", "auto")
    assert prepack_supported(torch.bfloat16) == bool(cpu_ops.gemm_isa())


def _linears(model: nn.Module) -> list[PackedLinear]:
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


def _plain_model(folder: Path, monkeypatch: pytest.MonkeyPatch) -> CausalLM:
    """The same checkpoint loaded without packing (logits from F.linear on the dense weights)."""
    with monkeypatch.context() as m:
        m.setattr(CausalLM, "prepack", lambda self: None)
        plain = LLM(str(folder), dtype="bfloat16").engine.runner.model
    assert plain.tied_head is None and not _linears(plain)
    return plain


@pytest.mark.parametrize("arch,tied", [("LlamaForCausalLM", True), ("LlamaForCausalLM", False),
                                       ("MixtralForCausalLM", False), ("Qwen2MoeForCausalLM", True)])
def test_a_loaded_model_runs_every_linear_on_one_path(arch: str, tied: bool, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense layers, the logits head (tied: the embedding packed as the head, no lm_head, and the
    lookup reading that packed table: no second copy), the MoE router, experts and shared expert all
    packed on the GEMM path; the logits of the whole model stay close to the plain model's (another
    summation order: not bitwise)."""
    isa = _gemm_path()
    folder = make_model(arch, tmp_path / "m", num_hidden_layers=2, tie_word_embeddings=tied)
    model = LLM(str(folder), dtype="bfloat16").engine.runner.model
    linears = _linears(model)
    assert linears and {x.isa for x in linears} == {isa}
    assert (model.lm_head is None) == tied and (model.tied_head is not None) == tied
    head = model.tied_head if tied else model.lm_head
    assert isinstance(head, PackedLinear) and head.out_features == model.config.vocab_size
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if moes:  # the experts' only copy is packed; the router and the shared expert are linears too
        assert all(m.packed_experts is not None and m.w13.numel() == 0 and m.w2.numel() == 0 for m in moes)
        assert all(e.isa == isa for m in moes for pair in m.packed_experts for e in pair)
        assert all(isinstance(m.gate, PackedLinear) for m in moes)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = model.compute_logits(hidden, float32=False)
    plain = _plain_model(folder, monkeypatch)
    torch.testing.assert_close(got.float(), plain.compute_logits(hidden, float32=False).float(), atol=0.1, rtol=3e-2)
    table = plain.model.embed_tokens.weight
    ids = torch.tensor([[0, 7, table.shape[0] - 1], [3, 3, 1]])
    assert torch.equal(model.embed(ids), table[ids])  # the lookup: the same rows, bit for bit
    if tied:  # the tied head is the embedding: its logits are hidden @ embed^T; the table is held once
        torch.testing.assert_close(got.float(), F.linear(hidden, table).float(), atol=0.1, rtol=3e-2)
        assert isinstance(model.model.embed_tokens, PackedEmbedding)
        assert not list(model.model.embed_tokens.parameters())
        assert model.embedding_table() is model.tied_head.packed
        with pytest.raises(RuntimeError, match=f"token id {table.shape[0]} is out of range"):
            model.embed(torch.tensor([table.shape[0]]))


def test_a_packed_embedding_needs_the_kernels_layout() -> None:
    """oneDNN's packed layout (path 0) cannot be read back: a tied model on it keeps its table."""
    head = SimpleNamespace(isa=0, out_features=8, in_features=4)
    with pytest.raises(ValueError, match="needs a head packed for the kernels' GEMM .*got isa 0"):
        PackedEmbedding(head)  # type: ignore[arg-type]


def test_an_eagle_head_packs_on_the_targets_path(tmp_path: Path) -> None:
    isa = _gemm_path()
    target = make_model("LlamaForCausalLM", tmp_path / "m", num_hidden_layers=2)
    head = make_eagle_head(target, tmp_path / "eagle", "eagle3")
    llm = LLM(str(target), dtype="bfloat16",
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    drafter = llm.engine.runner.proposer.head
    assert isinstance(drafter.fc, PackedLinear) and isinstance(drafter.lm_head, PackedLinear)
    assert {x.isa for x in _linears(drafter)} == {isa}
    assert drafter.chain_form() is not None  # the drafting chain runs on the same GEMM


def test_the_onednn_path_on_an_amx_cpu_capped_below_amx() -> None:
    """On an AMX CPU oneDNN runs bf16 on AMX tiles; ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (read when
    oneDNN starts: a fresh process) caps it at AVX512-BF16, the path of CPUs without AMX. The
    oneDNN path's tests pass there too."""
    import os
    import subprocess
    import sys

    _onednn_path()
    if "amx_bf16" not in cpu_ops.cpu_flags():
        pytest.skip("this CPU has no AMX: oneDNN already runs its AVX512-BF16 (or lower) path here")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)), "-k",
                           "onednn and not capped_below_amx"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1]
