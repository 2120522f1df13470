"""Pre-packed bf16 linears (layers.linear): bitwise the same as `F.linear`, and a bf16 model loaded
through the registry runs on them end to end (dense, tied head, MoE experts, EAGLE head) with the
same greedy tokens as the same model kept on plain `F.linear`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from phalanx import LLM, SamplingParams
from phalanx.layers.linear import (
    PAIR_MAX_ROWS,
    PAIR_MAX_WEIGHT_BYTES,
    PackedLinear,
    prepack_linears,
    prepack_supported,
)
from phalanx.models.llama import CausalLM
from phalanx.ops import cpu as cpu_ops
from tests.tiny_models import make_eagle_head, make_model

pytestmark = pytest.mark.skipif(not prepack_supported(torch.bfloat16), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bitwise_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(160, 96, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(160, generator=g))
    x = torch.randn(rows, 96, generator=g).bfloat16()
    packed = PackedLinear.from_linear(lin)
    assert torch.equal(packed(x), F.linear(x, lin.weight, lin.bias))
    assert torch.equal(packed(x[:, None, :]).squeeze(1), packed(x))  # leading dims


def _pair_module():
    module = cpu_ops.pair_linear_module()
    if module is None:
        pytest.skip("no C++ kernels with AVX512-BF16 here, or this CPU's oneDNN sums in another order")
    return module


def test_pair_kernel_is_off_where_it_would_not_match_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up check: a CPU whose oneDNN sums in another order keeps every linear on oneDNN."""
    _pair_module()
    monkeypatch.setattr(cpu_ops, "_pair_ok", None)
    monkeypatch.setattr(cpu_ops, "_pair_linear_matches_onednn", lambda module: False)
    assert cpu_ops.pair_linear_module() is None
    assert PackedLinear(torch.randn(96, 64).bfloat16(), None).pairs is None


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed linear, what PackedLinear runs above PAIR_MAX_ROWS rows."""
    return torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")


def test_one_output_linear_is_a_dot_product_in_f_linear() -> None:
    """F.linear with one output feature skips oneDNN's GEMM for a dot product that sums in another
    order: a case the property test found, where the two round to neighbouring bf16 values. So the
    property test compares against oneDNN's packed call, which pair_linear matches here too."""
    module = _pair_module()
    g = torch.Generator().manual_seed(445)
    w = (torch.randn(1, 2265, generator=g) / 2265**0.5).bfloat16()
    x = (torch.randn(3, 2265, generator=g) * 2).bfloat16()[1:2].contiguous()
    assert not torch.equal(F.linear(x, w), _onednn(x, w))
    assert torch.equal(module.pair_linear(x, module.pack_pairs(w), 1), _onednn(x, w))
    assert torch.equal(PackedLinear(w, None)(x), _onednn(x, w))
    wide = torch.cat([w, w])  # with two outputs F.linear is oneDNN's GEMM again
    assert torch.equal(F.linear(x, wide), _onednn(x, wide))


@settings(max_examples=80, deadline=None)
@example(n=1, k=2265, rows=3, seed=445)  # F.linear's one-output dot product differs here (see above)
@given(n=st.integers(1, 1200), k=st.integers(1, 2600), rows=st.integers(1, PAIR_MAX_ROWS), seed=st.integers(0, 2**16))
def test_pair_linear_is_bitwise_onednn_per_row(n: int, k: int, rows: int, seed: int) -> None:
    """The few-row kernel against oneDNN's packed linear to the last bit, odd sizes included: every row
    equals oneDNN's one-row result, and with K <= 512 the whole call equals oneDNN's at that row count
    (for K > 512 oneDNN's 2-4-row order is not its own one-row order, so only one can be matched;
    the kernel keeps 1-4 rows consistent instead). A request's tokens must not depend on whether its
    step ran 1 or 4 rows."""
    module = _pair_module()
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    x = (torch.randn(rows, k, generator=g) * 2).bfloat16()
    packed = module.pack_pairs(w)
    got = module.pair_linear(x, packed, n)
    for r in range(rows):
        assert torch.equal(got[r : r + 1], _onednn(x[r : r + 1], w))
        assert torch.equal(got[r : r + 1], module.pair_linear(x[r : r + 1].contiguous(), packed, n))
    if k <= 512:
        assert torch.equal(got, _onednn(x, w))


@pytest.mark.parametrize("n,k", [(512, 256), (1408, 256), (256, 704), (925, 256), (1024, 512), (512, 1408), (64, 2000)])
def test_pair_linear_on_model_shapes(n: int, k: int) -> None:
    module = _pair_module()
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    for rows in (1, 2, 3, 4):
        for _ in range(3):
            x = torch.randn(rows, k, generator=g).bfloat16()
            got = module.pair_linear(x, module.pack_pairs(w), n)
            assert all(torch.equal(got[r : r + 1], F.linear(x[r : r + 1], w)) for r in range(rows))
            if k <= 512:
                assert torch.equal(got, F.linear(x, w))


def test_pair_linear_refuses_mismatched_inputs() -> None:
    module = _pair_module()
    w = torch.randn(32, 16).bfloat16()
    with pytest.raises(RuntimeError, match="pack_pairs of an"):
        module.pair_linear(torch.randn(2, 18).bfloat16(), module.pack_pairs(w), 32)
    with pytest.raises(RuntimeError, match="expects bfloat16"):
        module.pair_linear(torch.randn(2, 16), module.pack_pairs(w), 32)


def test_packed_linear_uses_the_pair_kernel_for_few_rows_of_small_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    _pair_module()
    g = torch.Generator().manual_seed(0)
    small = PackedLinear(torch.randn(96, 64, generator=g).bfloat16(), None)
    assert small.pairs is not None
    assert PackedLinear(torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()).pairs is None  # bias
    big_n = PAIR_MAX_WEIGHT_BYTES // (2 * 64) + 16
    assert PackedLinear(torch.randn(big_n, 64).bfloat16(), None).pairs is None  # too big: oneDNN is faster
    calls = []
    real = small._pair_linear
    small._pair_linear = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    w = torch.ops.mkldnn._linear_pointwise(torch.eye(64).bfloat16(), small.packed, None, "none", [], "").t()
    for rows in (1, PAIR_MAX_ROWS, PAIR_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        assert torch.equal(small(x), F.linear(x, w))
    assert calls == [1, PAIR_MAX_ROWS]
    monkeypatch.setenv("PHALANX_KERNELS", "torch")
    assert PackedLinear(torch.randn(96, 64).bfloat16(), None).pairs is None


def test_prepack_swaps_only_bf16_linears() -> None:
    m = nn.Sequential(nn.Linear(4, 4, dtype=torch.bfloat16), nn.Sequential(nn.Linear(4, 4)), nn.LayerNorm(4))
    assert prepack_linears(m) == 1
    assert isinstance(m[0], PackedLinear) and isinstance(m[1][0], nn.Linear)


def _unpack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CausalLM, "prepack", lambda self: None)
    monkeypatch.setattr("phalanx.models.eagle.prepack_supported", lambda dtype: False)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MixtralForCausalLM"])
def test_packed_model_generates_what_the_plain_model_does(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = make_model(arch, tmp_path / "m", num_hidden_layers=2)
    head = make_eagle_head(target, tmp_path / "eagle", "eagle3") if arch == "LlamaForCausalLM" else None
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3} if head else None
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + 2 * i, 40, 7][: 2 + i]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    packed = LLM(str(target), dtype="bfloat16", speculative_config=spec)
    model = packed.engine.runner.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert model.tied_head is not None or model.lm_head is not None
    if head:
        assert isinstance(packed.engine.runner.proposer.head.fc, PackedLinear)
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params, use_tqdm=False)]

    with monkeypatch.context() as m:
        _unpack(m)
        plain = LLM(str(target), dtype="bfloat16", speculative_config=spec)
        assert isinstance(plain.engine.runner.model.model.layers[0].self_attn.qkv_proj, nn.Linear)
        ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == ref
