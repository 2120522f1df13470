"""HF architecture name -> model class, and the one function that builds a loaded model.

Owns: the registry dict and `load_model`. Variants are plain classes; no inheritance chains.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.config import SUPPORTED_ARCHITECTURES, ModelConfig
from phalanx.models.llama import CausalLM
from phalanx.models.loader import iterate_weights
from phalanx.ops import cpu as cpu_ops

# Every supported dense and MoE architecture shares the Llama-family decoder; the differences
# (qkv bias, q/k norm, MoE routing, shared experts) are switches in ModelConfig.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {arch: CausalLM for arch in SUPPORTED_ARCHITECTURES}


def load_model(cfg: ModelConfig, expert_shard: tuple[int, int] | None = None) -> CausalLM:
    """Build and load a model. `expert_shard` = (rank, size): keep only this rank's experts."""
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}")
    old = torch.get_default_dtype()
    torch.set_default_dtype(cfg.dtype)
    try:
        model = cls(cfg)
    finally:
        torch.set_default_dtype(old)
    if expert_shard is not None:
        from phalanx.distributed.expert_parallel import expert_range
        from phalanx.layers.moe import SparseMoE

        rank, size = expert_shard
        for module in model.modules():
            if isinstance(module, SparseMoE):
                if module.num_experts < size:
                    raise ValueError(
                        f"expert parallelism over {size} ranks needs >= {size} experts, the model has {module.num_experts}"
                    )
                module.shard(*expert_range(module.num_experts, rank, size))
    model.load_weights(iterate_weights(cfg.path))  # type: ignore[attr-defined]
    model.eval()
    model.prepack()  # type: ignore[attr-defined]
    cpu_ops.attach(model, cfg.dtype)  # fused norm / rotary kernels (bf16)
    return model  # type: ignore[return-value]
