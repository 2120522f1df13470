"""Frozen, per-area engine configuration, validated at the boundary.

Owns: `ModelConfig` (normalises messy Hugging Face configs written by transformers v4 or v5),
`CacheConfig`, `SchedulerConfig`, `ParallelConfig` and the `EngineConfig` that bundles them.
Does not own: speculative-decoding configuration (``phalanx.spec_decode.config``) or anything that
needs torch at import time beyond dtype names.

Every error message quotes the offending value and says what would be valid.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx import checkpoint

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
# The MLP activations of the supported architectures (HF `hidden_act` names); every one of them is
# SiLU (x * sigmoid(x)), which is all the gated MLP and its kernels compute.
SUPPORTED_ACTIVATIONS = ("silu", "swish")

# Accepted dtype names -> torch attribute names (torch itself is imported only when a dtype is resolved,
# so the configuration and the scheduler stay importable without it).
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def dtype_name(dtype: str | torch.dtype, config_dtype: str | None) -> str:
    """`parse_dtype` without torch: the torch attribute name ("float32", "bfloat16", "float16") of a
    user dtype ("auto" / name / torch.dtype) resolved against the checkpoint's own dtype, with the
    same errors. The API server checks the configuration with it and never imports torch."""
    torch = sys.modules.get("torch")  # a torch.dtype exists only once torch is imported
    if torch is not None and isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return str(dtype).removeprefix("torch.")
    if dtype == "auto":
        if config_dtype is None:
            return "float32"
        name = str(config_dtype).removeprefix("torch.")
        return _DTYPES.get(name, "float32")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; valid: 'auto', 'float32', 'bfloat16', 'float16'")
    return _DTYPES[dtype]


def parse_dtype(dtype: str | torch.dtype, config_dtype: str | None) -> torch.dtype:
    """Resolve a user dtype ("auto" / name / torch.dtype) against the checkpoint's own dtype."""
    import torch

    return getattr(torch, dtype_name(dtype, config_dtype))


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about one checkpoint, normalised.

    Build with `ModelConfig.from_hf(path)`; the raw HF dict stays in `hf_config` for the rare
    model-specific field.
    """

    path: str
    architecture: str
    dtype: torch.dtype  # its name ("bfloat16") in a config built with resolve_dtype=False
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    # MoE (num_experts == 0 for dense models)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layer_ids: tuple[int, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def active_parameters(self) -> int:
        """Weights one token's forward multiplies by (attention, the MLP or the routed and shared
        experts it uses, the lm_head; not the embedding lookup): the model's compute per token."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = 3 * h * (self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size)
        moe_layers = set(self.moe_layer_ids) if self.is_moe else set()
        layers = sum(attn + (moe_mlp if i in moe_layers else dense_mlp) for i in range(self.num_layers))
        return layers + self.vocab_size * h

    @classmethod
    def from_hf(
        cls,
        path: str | os.PathLike[str],
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        *,
        resolve_dtype: bool = True,
    ) -> ModelConfig:
        """`resolve_dtype=False` (the API server, which never imports torch): `dtype` is the dtype's
        name (`dtype_name`), checked the same way; everything else is the same."""
        path = str(path)
        if not Path(path).exists():
            raise FileNotFoundError(
                f"model {path!r} does not exist; pass a local Hugging Face checkpoint folder (config.json and "
                "*.safetensors), a .gguf file, a hub id or a built-in model name"
            )
        hf = checkpoint.hf_config(path)
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} of {path!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        return cls._from_dict(path, arch, hf, dtype, max_model_len, resolve_dtype=resolve_dtype)

    @classmethod
    def _from_dict(
        cls,
        path: str,
        arch: str,
        hf: dict[str, Any],
        dtype: str | torch.dtype,
        max_model_len: int | None,
        *,
        resolve_dtype: bool = True,
    ) -> ModelConfig:
        text = hf.get("text_config") or {}
        hf = {**text, **hf} if text else hf
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or hidden // heads
        rope_params = hf.get("rope_parameters") or {}
        rope_scaling = hf.get("rope_scaling") or None
        if rope_params and not rope_scaling:
            rtype = rope_params.get("rope_type", rope_params.get("type", "default"))
            rope_scaling = None if rtype == "default" else dict(rope_params)
        rope_theta = float(hf.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        if rope_scaling is not None:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rtype not in ("llama3", "linear", "default", None):
                raise ValueError(f"rope scaling type {rtype!r} is not supported; supported: 'llama3', 'linear'")
        max_pos = int(hf.get("max_position_embeddings") or 2048)
        if max_model_len is None:
            max_model_len = max_pos
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if max_model_len > max_pos and not rope_scaling:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {max_pos}"
            )
        window = hf.get("sliding_window")
        window_on = hf.get("use_sliding_window", arch == "MistralForCausalLM") and bool(window)
        if window_on and window < max_model_len:
            # A window at least as long as the context is plain full attention, so that is allowed.
            raise ValueError(
                f"sliding-window attention (sliding_window={window!r}) is not supported; phalanx supports "
                f"full attention only: set max_model_len <= {window} (currently {max_model_len}) or "
                "disable the window in config.json"
            )
        hidden_act = str(hf.get("hidden_act") or hf.get("hidden_activation") or "silu")
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act {hidden_act!r} of {path!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        config_dtype = hf.get("dtype") or hf.get("torch_dtype")
        num_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
        num_layers = int(hf["num_hidden_layers"])
        moe_layers: tuple[int, ...] = ()
        if num_experts:
            step = int(hf.get("decoder_sparse_step") or 1)
            mlp_only = set(hf.get("mlp_only_layers") or [])
            moe_layers = tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)
        eos = _eos_token_ids(Path(path), hf)
        return cls(
            path=path,
            architecture=arch,
            dtype=parse_dtype(dtype, config_dtype) if resolve_dtype else dtype_name(dtype, config_dtype),
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(hf.get("intermediate_size") or 0),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            max_model_len=max_model_len,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)) or arch.startswith("Qwen2"),
            qk_norm=arch.startswith("Qwen3"),
            hidden_act=hidden_act,
            eos_token_ids=eos,
            num_experts=num_experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 0),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(hf.get("norm_topk_prob")),
            moe_layer_ids=moe_layers,
            hf_config=hf,
        )


def _eos_token_ids(folder: Path, hf: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json (preferred) and config.json; order kept, deduplicated."""
    ids: list[int] = []
    sources = [hf]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.insert(0, _read_json(gen))
    for src in sources:
        value = src.get("eos_token_id")
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            if int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_space: float = 1.0  # GiB of KV cache per engine rank
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None  # exact block count (tests use tiny caches)

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size!r}")
        if not self.kv_cache_space > 0:
            raise ValueError(f"kv_cache_space must be > 0 GiB, got {self.kv_cache_space!r}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_blocks override must be >= 1, got {self.num_gpu_blocks_override!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # MoE experts sharded across the DP ranks (ranks then run in lockstep).
    enable_expert_parallel: bool = False
    # Force lockstep for dense models too (testing the protocol, uniform step timing).
    dp_lockstep: bool = False
    dp_timeout_s: float = 60.0  # any collective waiting longer is a DPError
    check_collectives: bool = False  # debug: compare every collective's fingerprint across ranks

    def lockstep(self, model_is_moe: bool) -> bool:
        """Whether the ranks must run every forward together (DESIGN §5)."""
        return self.data_parallel_size > 1 and (self.dp_lockstep or (self.enable_expert_parallel and model_is_moe))

    def __post_init__(self) -> None:
        if not self.dp_timeout_s > 0:
            raise ValueError(f"dp_timeout must be > 0 seconds, got {self.dp_timeout_s!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size!r}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {self.data_parallel_rank} out of range [0, {self.data_parallel_size})"
            )
        # Accepted and ignored would be silent: one rank has no peer, independent ranks no collectives.
        if self.dp_lockstep and self.data_parallel_size == 1:
            raise ValueError("dp_lockstep (--dp-lockstep) needs data_parallel_size (-dp) > 1: a single rank has "
                             "no peer to step with")
        if self.check_collectives and not (self.data_parallel_size > 1
                                           and (self.dp_lockstep or self.enable_expert_parallel)):
            raise ValueError("check_collectives (--dp-check-collectives) compares the collectives of lockstep ranks: "
                             "it needs data_parallel_size (-dp) > 1 with dp_lockstep (--dp-lockstep) or "
                             "enable_expert_parallel (--enable-expert-parallel)")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0
    speculative: Any = None  # phalanx.spec_decode.config.SpeculativeConfig | None
