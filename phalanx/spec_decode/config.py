"""Speculative-decoding configuration with vLLM's field names, validated against the target.

Owns: `SpeculativeConfig.from_dict` — unknown keys, k < 1, a method that needs a model without
one, vocabulary / hidden-size mismatches, the draft's own max_model_len, `adaptive` (a boolean),
and detecting `method` from the draft checkpoint's `architectures` when it is omitted.
Does not own: building proposers (``spec_decode.proposer``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from phalanx.checkpoint import hf_config, is_gguf, resolve_model_path
from phalanx.config import ModelConfig

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
_MODEL_METHODS = ("draft_model", "eagle", "eagle3")
_FIELDS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "max_model_len",
    "draft_tensor_parallel_size",
    "disable_by_batch_size",
    "adaptive",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # resolved folder of the draft checkpoint
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    max_model_len: int | None = None  # the drafter's own context limit
    draft_tensor_parallel_size: int = 1
    # Draft only in steps whose batch holds at most this many requests (None: always), as vLLM's
    # field: above it verification's extra rows cost more than the accepted tokens save.
    disable_by_batch_size: int | None = None
    # Choose each request's draft length (0..k) every step from measured step costs and its running
    # acceptance (``spec_decode.policy``) instead of drafting k for every request.
    adaptive: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | str, target: ModelConfig) -> SpeculativeConfig:
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative config must be a JSON object, got {raw!r}")
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown speculative config field(s) {unknown}; valid fields: {list(_FIELDS)}")
        k = raw.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        tp = raw.get("draft_tensor_parallel_size", 1)
        if tp != 1:
            raise ValueError(f"draft_tensor_parallel_size must be 1 (phalanx has no tensor parallelism), got {tp!r}")
        method = raw.get("method")
        model = raw.get("model")
        if model is not None:
            model = resolve_model_path(str(model))
        if method is None:
            method = "ngram" if model is None else _detect_method(model)
        if method not in METHODS:
            raise ValueError(f"speculative method {method!r} is not supported; valid: {list(METHODS)}")
        if method in _MODEL_METHODS and model is None:
            raise ValueError(f"speculative method {method!r} needs a draft 'model' (a folder or built-in name)")
        if method in ("eagle", "eagle3") and model is not None and is_gguf(model):
            raise ValueError(f"an {method} head is a Hugging Face folder (config.json + safetensors), not a .gguf: {model!r}")
        if method == "ngram" and model is not None:
            raise ValueError("speculative method 'ngram' is model-free; remove 'model'")
        lo = raw.get("prompt_lookup_min")
        hi = raw.get("prompt_lookup_max")
        if method != "ngram" and (lo is not None or hi is not None):
            raise ValueError("prompt_lookup_min / prompt_lookup_max apply to method 'ngram' only")
        # vLLM's defaults: both unset -> 5 and 5; one unset -> equal to the other.
        if lo is None and hi is None:
            lo = hi = 5
        lo = int(lo if lo is not None else hi)  # type: ignore[arg-type]
        hi = int(hi if hi is not None else lo)
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        max_len = raw.get("max_model_len")
        if max_len is not None and (not isinstance(max_len, int) or max_len < 2):
            raise ValueError(f"speculative max_model_len must be an integer >= 2, got {max_len!r}")
        off = raw.get("disable_by_batch_size")
        if off is not None and (not isinstance(off, int) or isinstance(off, bool) or off < 2):
            raise ValueError(f"disable_by_batch_size must be an integer >= 2 (or null), got {off!r}")
        adaptive = raw.get("adaptive", False)
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {adaptive!r}")
        cfg = cls(method, k, model, lo, hi, max_len, 1, off, adaptive)
        if model is not None:
            _check_compatible(cfg, target)
        return cfg


def _read_config(path: str) -> dict[str, Any]:
    return hf_config(path)


def _detect_method(folder: str) -> str:
    archs = _read_config(folder).get("architectures") or []
    arch = archs[0] if archs else ""
    if "eagle3" in arch.lower():
        return "eagle3"
    if "eagle" in arch.lower():
        return "eagle"
    return "draft_model"


def _check_compatible(cfg: SpeculativeConfig, target: ModelConfig) -> None:
    assert cfg.model is not None
    draft = _read_config(cfg.model)
    if cfg.method == "draft_model":
        if int(draft.get("vocab_size", -1)) != target.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({draft.get('vocab_size')}) differs from the target's "
                f"({target.vocab_size}); a draft model must share the target's tokenizer"
            )
    else:
        hidden = int(draft.get("hidden_size", -1))
        if hidden != target.hidden_size:
            raise ValueError(
                f"EAGLE head hidden_size {hidden} does not match the target's hidden_size {target.hidden_size}"
            )
