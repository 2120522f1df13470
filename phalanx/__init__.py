"""phalanx: an LLM serving engine for exact speculative decoding served data-parallel.

`from phalanx import LLM, SamplingParams` mirrors vLLM's offline API. The names are imported on
first use (PEP 562), so `import phalanx.core` (the scheduler, KV-cache bookkeeping) or the CLI's
argument parsing never pull in torch or the model runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.engine.llm import LLM
    from phalanx.outputs import CompletionOutput, Logprob, RequestOutput
    from phalanx.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "phalanx.engine.llm",
    "SamplingParams": "phalanx.sampling_params",
    "RequestOutput": "phalanx.outputs",
    "CompletionOutput": "phalanx.outputs",
    "Logprob": "phalanx.outputs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
