"""Pre-packed bf16 linears (layers.linear): bitwise the same as `F.linear`, and a bf16 model loaded
through the registry runs on them end to end (dense, tied head, MoE experts, EAGLE head) with the
same greedy tokens as the same model kept on plain `F.linear`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx import LLM, SamplingParams
from phalanx.layers.linear import PackedLinear, prepack_linears, prepack_supported
from phalanx.models.llama import CausalLM
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
