"""Numbers in `SamplingParams` are bounded where the engine needs them to be: every integer fits in
64 bits (it crosses process boundaries as msgpack int64 and seeds a torch.Generator), the
temperature is finite. Before, `seed=2**70` passed validation and failed later as "OverflowError:
can't serialize ints" (a 500 in the server), and `temperature=nan` reached the sampler."""

from __future__ import annotations

import math

import msgspec
import pytest

from phalanx.engine.engine_core import EngineCoreRequest
from phalanx.engine.output_processor import child_params
from phalanx.sampling_params import INT64_MAX, INT64_MIN, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(seed=2**70), "seed"),
        (dict(seed=INT64_MIN - 1), "seed"),
        (dict(max_tokens=2**70), "max_tokens"),
        (dict(max_tokens=None, min_tokens=2**64), "min_tokens"),
        (dict(top_k=2**63), "top_k"),
        (dict(n=2**63), "n"),
        (dict(logprobs=2**63), "logprobs"),
        (dict(prompt_logprobs=2**63), "prompt_logprobs"),
        (dict(stop_token_ids=[2**63]), "stop_token_ids"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
    ],
)
def test_out_of_range_numbers_are_refused(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_extreme_seeds_cross_the_wire_and_wrap_for_samples() -> None:
    params = SamplingParams(n=3, seed=INT64_MAX, temperature=1.0)
    seeds = [child_params(params, i).seed for i in range(3)]
    assert seeds == [INT64_MAX, INT64_MIN, INT64_MIN + 1]
    for i in range(3):
        req = EngineCoreRequest("r", [1, 2], child_params(params, i))
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest) == req
