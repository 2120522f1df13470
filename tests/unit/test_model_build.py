"""Served models are built unfilled and then loaded: no random initialisation is spent on weights
the checkpoint overwrites, and a checkpoint that lacks one is an error, never uninitialised memory
served."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from phalanx.config import ModelConfig
from phalanx.layers.linear import empty_embedding, empty_linear
from phalanx.models.llama import CausalLM
from phalanx.models.registry import load_model
from tests.tiny_models import make_model


def test_empty_layers_are_torch_layers_of_the_right_shape() -> None:
    lin = empty_linear(12, 5, bias=True, dtype=torch.bfloat16)
    assert isinstance(lin, nn.Linear) and lin.weight.shape == (5, 12) and lin.bias.shape == (5,)
    assert lin.weight.dtype == torch.bfloat16 and set(lin.state_dict()) == {"weight", "bias"}
    emb = empty_embedding(7, 3)
    assert isinstance(emb, nn.Embedding) and emb.weight.shape == (7, 3) and set(emb.state_dict()) == {"weight"}


def test_building_a_model_initialises_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig.from_hf(str(make_model("LlamaForCausalLM", tmp_path / "m")), "float32")

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a served model's weights were initialised at random")

    for name in ("kaiming_uniform_", "uniform_", "normal_"):
        monkeypatch.setattr(torch.nn.init, name, refuse)
    CausalLM(cfg)


def test_a_checkpoint_lacking_a_weight_is_an_error(tmp_path: Path) -> None:
    folder = make_model("LlamaForCausalLM", tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights for.*layers.1.mlp.down_proj"):
        load_model(ModelConfig.from_hf(str(folder), "float32"))


@pytest.mark.parametrize("drop", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"])
def test_a_checkpoint_lacking_one_part_of_a_fused_weight_is_an_error(tmp_path: Path, drop: str) -> None:
    """q / k / v load into one qkv_proj and gate / up into one gate_up_proj: a missing part names
    the fused parameter and the part, rather than leaving those rows unfilled."""
    folder = make_model("LlamaForCausalLM", tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[drop]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    part = "k" if "k_proj" in drop else "up"
    with pytest.raises(ValueError, match=rf"lacks weights for.*_proj.weight \({part}\)"):
        load_model(ModelConfig.from_hf(str(folder), "float32"))


def test_a_moe_checkpoint_lacking_one_experts_half_is_an_error(tmp_path: Path) -> None:
    folder = make_model("MixtralForCausalLM", tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("experts.1.w3.weight"))
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for.*w13 \(1:up\)"):
        load_model(ModelConfig.from_hf(str(folder), "float32"))
