"""phalanx: an LLM serving engine for exact speculative decoding served data-parallel.

`from phalanx import LLM, SamplingParams` mirrors vLLM's offline API.
"""

from phalanx.engine.llm import LLM
from phalanx.outputs import CompletionOutput, Logprob, RequestOutput
from phalanx.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
