"""Front-end request state: token ids -> text, stop strings, logprobs, `n` > 1 fan-out.

Owns: per-request front-end state (incremental detokenizer, stop-string checker, accumulated
tokens / text / logprobs), turning `EngineCoreOutput`s into cumulative `RequestOutput`s, naming
the engine requests that must be aborted because a stop string ended them, and forming the
`Replay` of an unfinished sample whose engine rank died: the same prompt and parameters plus the
output tokens received so far, which the engine continues (`EngineCoreRequest.output_token_ids`).
The detokenizer and stop-string state stay here, so a replayed sample's text goes on where it
stood: nothing repeated, nothing missing.
Does not own: the engine (callers forward `abort_ids` and send replays), HTTP or streaming formats.

Used by the offline `LLM` and by the API server alike, so both produce identical text.
A parent request with `n` samples becomes n engine requests "i_<parent id>" (i = 0..n-1); a
seeded parent gives child i the seed `seed + i`, as vLLM does, so samples differ but reproduce.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from phalanx.core.outputs import EngineCoreOutput, TokenLogprobs
from phalanx.engine.detokenizer import IncrementalDetokenizer, StopStringChecker, detokenize_logprobs
from phalanx.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from phalanx.sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.n == 1:
        return params
    # seed + index, wrapped to stay a 64-bit integer (2**63 - 1 + 1 -> -2**63)
    seed = None if params.seed is None else (params.seed + index + 2**63) % 2**64 - 2**63
    return dataclasses.replace(params, n=1, seed=seed)


@dataclass
class _Child:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    stop: StopStringChecker
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    # Replays: the engine's speculative counters restart at 0 on the rank that continues a sample;
    # these are the counts reached before (drafts, accepted, verify steps).
    num_replays: int = 0
    spec_base: tuple[int, int, int] = (0, 0, 0)

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_verify_steps=self.num_verify_steps,
        )


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    num_cached_tokens_known: bool = False  # from the first engine that ran it (replays hit more)
    # wall-clock times (time.time()), as vLLM's RequestMetrics: arrival, first / last token, finish
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.completion() for c in self.children],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=dict(self.metrics),
        )


@dataclass
class Replay:
    """An unfinished sample to send to another engine rank: it continues from `output_token_ids`."""

    engine_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int]


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]  # one per parent that changed, cumulative
    abort_ids: list[str]  # engine request ids to abort (a stop string ended them)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[_Parent, _Child]] = {}

    def __len__(self) -> int:
        return len(self._parents)

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[tuple[str, SamplingParams]]:
        """Register a parent request; returns the (engine request id, params) of each sample."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model folder has none")
        children = []
        engine_reqs = []
        for i in range(params.n):
            p = child_params(params, i)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, p.skip_special_tokens, p.spaces_between_special_tokens
                )
            child = _Child(i, p, detok, StopStringChecker(p.stop, p.include_stop_str_in_output))
            if p.logprobs is not None:
                child.logprobs = []
                child.cumulative_logprob = 0.0
            children.append(child)
            engine_reqs.append((child_request_id(request_id, i, params.n), p))
        parent = _Parent(request_id, prompt, list(prompt_token_ids), children, metrics={"arrival_time": time.time()})
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = []
        self._parents[request_id] = parent
        for (child_id, _), child in zip(engine_reqs, children):
            self._child_to_parent[child_id] = (parent, child)
        return engine_reqs

    def engine_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        n = len(parent.children)
        return [child_request_id(request_id, c.index, n) for c in parent.children if c.finish_reason is None]

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a parent (client went away); returns its unfinished engine request ids to abort."""
        ids = self.engine_ids(request_id)
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            n = len(parent.children)
            for c in parent.children:
                self._child_to_parent.pop(child_request_id(request_id, c.index, n), None)
        return ids

    def replays(self, engine_ids: Iterable[str]) -> dict[str, list[Replay]]:
        """Replays of the unfinished samples among `engine_ids` (the requests a dead rank held),
        grouped by parent request id (a parent's samples go to one rank together).

        Each keeps its parameters (its own seed: the engine advances the generator past the
        tokens already drawn) and carries the tokens received so far. Prompt logprobs are asked
        for again only when they had not all arrived (they are then collected afresh); a sample
        that already has output has them all."""
        groups: dict[str, list[Replay]] = {}
        for engine_id in engine_ids:
            entry = self._child_to_parent.get(engine_id)
            if entry is None:
                continue
            parent, child = entry
            if child.finish_reason is not None:
                continue
            params = child.params
            if params.prompt_logprobs is not None:
                lps = parent.prompt_logprobs
                if child.index == 0 and lps is not None and len(lps) < len(parent.prompt_token_ids):
                    parent.prompt_logprobs = []
                else:
                    params = params.clone(prompt_logprobs=None)
            child.num_replays += 1
            child.spec_base = (child.num_draft_tokens, child.num_accepted_tokens, child.num_verify_steps)
            replay = Replay(engine_id, parent.prompt_token_ids, params, list(child.token_ids))
            groups.setdefault(parent.request_id, []).append(replay)
        return groups

    def num_replays(self, request_id: str) -> int:
        """How many times the most replayed sample of a parent was replayed."""
        parent = self._parents.get(request_id)
        return max((c.num_replays for c in parent.children), default=0) if parent is not None else 0

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        changed: dict[str, _Parent] = {}
        abort_ids: list[str] = []
        now = time.time()
        for out in outputs:
            entry = self._child_to_parent.get(out.req_id)
            if entry is None:
                continue
            parent, child = entry
            if child.finish_reason is not None:
                continue
            if out.new_token_ids:
                parent.metrics.setdefault("first_token_time", now)
                parent.metrics["last_token_time"] = now
            if self._apply(parent, child, out):
                abort_ids.append(out.req_id)
            changed[parent.request_id] = parent
            if child.finish_reason is not None:
                del self._child_to_parent[out.req_id]
        results = []
        for parent in changed.values():
            if parent.finished:
                parent.metrics["finished_time"] = now
                del self._parents[parent.request_id]
            results.append(parent.output())
        return ProcessedOutputs(results, abort_ids)

    def _apply(self, parent: _Parent, child: _Child, out: EngineCoreOutput) -> bool:
        """Fold one engine output into the child; True if a stop string ended it early."""
        if child.index == 0:
            if not parent.num_cached_tokens_known:
                parent.num_cached_tokens = out.num_cached_tokens
                parent.num_cached_tokens_known = True
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is not None:
                parent.prompt_logprobs.extend(self._logprob_dicts(out.new_prompt_logprobs))
        drafts, accepted, steps = child.spec_base
        child.num_draft_tokens = drafts + out.num_draft_tokens
        child.num_accepted_tokens = accepted + out.num_accepted_tokens
        child.num_verify_steps = steps + out.num_verify_steps
        child.token_ids.extend(out.new_token_ids)
        if child.logprobs is not None and out.new_logprobs:
            for entry in self._logprob_dicts(out.new_logprobs):
                assert entry is not None
                child.logprobs.append(entry)
            child.cumulative_logprob = (child.cumulative_logprob or 0.0) + sum(
                lp.logprobs[0] for lp in out.new_logprobs
            )
        engine_finished = out.finish_reason is not None
        if child.detok is None:
            if engine_finished:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            return False
        before = len(child.token_ids) - len(out.new_token_ids)
        new_ids = out.new_token_ids
        if out.finish_reason == "stop" and new_ids and not child.params.include_stop_str_in_output:
            # As vLLM: the token that stopped the request (EOS or one of `stop_token_ids`) stays in
            # token_ids, and its text stays out of the output unless include_stop_str_in_output.
            new_ids = new_ids[:-1]
        min_tokens = child.params.min_tokens
        if before < min_tokens:
            # As vLLM: stop strings only count in text of tokens past the first `min_tokens`; the
            # text of those first tokens is released unchecked.
            head = min(min_tokens - before, len(new_ids))
            child.text += child.detok.add_tokens(new_ids[:head])
            delta = child.detok.add_tokens(new_ids[head:])
        else:
            delta = child.detok.add_tokens(new_ids)
        if engine_finished:
            delta += child.detok.flush()
        emit, matched = child.stop.process(delta)
        if matched is None and engine_finished:
            emit += child.stop.flush()
            matched = child.stop.matched
        child.text += emit
        if matched is not None:
            child.finish_reason, child.stop_reason = "stop", matched
            return not engine_finished
        if engine_finished:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _logprob_dicts(self, entries: list[TokenLogprobs | None]) -> list[dict[int, Logprob] | None]:
        result: list[dict[int, Logprob] | None] = []
        for e in entries:
            if e is None:
                result.append(None)
                continue
            texts = detokenize_logprobs(self.tokenizer, e.token_ids) if self.tokenizer is not None else None
            d: dict[int, Logprob] = {}
            for j, (tid, lp) in enumerate(zip(e.token_ids, e.logprobs)):
                if tid in d:
                    continue
                rank = e.rank if j == 0 else j
                d[tid] = Logprob(lp, rank, texts[j] if texts else None)
            result.append(d)
        return result
