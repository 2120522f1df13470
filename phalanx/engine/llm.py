"""The offline API, mirroring vLLM: `LLM(model, ...).generate(prompts, SamplingParams(...))`.

Owns: turning user prompts (strings, token-id dicts, chat conversations) into engine requests,
validating them before anything is queued, driving one in-process engine core to completion with
a progress bar, and returning `RequestOutput`s in input order.
Does not own: scheduling or model execution (``engine_core``), text handling (``output_processor``).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from phalanx.checkpoint import resolve_model_path
from phalanx.engine.args import EngineArgs
from phalanx.engine.engine_core import EngineCore, EngineCoreRequest
from phalanx.engine.output_processor import OutputProcessor
from phalanx.engine.tokenizer import eos_token_ids_of, load_tokenizer, render_chat
from phalanx.outputs import RequestOutput
from phalanx.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class LLM:
    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int | None = None,
        kv_cache_space: float = 1.0,
        block_size: int = 16,
        speculative_config: dict[str, Any] | None = None,
        num_kv_blocks: int | None = None,
    ) -> None:
        model_path = resolve_model_path(model)
        self.tokenizer = load_tokenizer(tokenizer or model_path)
        self.engine_args = EngineArgs(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_space=kv_cache_space,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            speculative_config=speculative_config,
            extra_eos_token_ids=tuple(eos_token_ids_of(self.tokenizer)),
        )
        self.engine = EngineCore(self.engine_args.create_engine_config())
        self.processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()

    @property
    def config(self):  # noqa: ANN201 - EngineConfig
        return self.engine.cfg

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- prompts -------------------------------------------------------------------------
    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]} instead")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._to_token_ids(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        raise TypeError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompt_list = list(prompts)
        encoded = [self._to_token_ids(p) for p in prompt_list]
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model folder has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = []
        for conv in conversations:
            text = render_chat(
                self.tokenizer, conv, add_generation_prompt, continue_final_message, chat_template_kwargs  # type: ignore[arg-type]
            )
            encoded.append((text, list(self.tokenizer(text, add_special_tokens=False).input_ids)))
        return self._run(encoded, sampling_params, use_tqdm)

    # ---- driving the engine --------------------------------------------------------------
    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            params_list = [SamplingParams()] * len(encoded)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(encoded)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(encoded):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(encoded)} prompts; pass one, or one per prompt"
                )
        # Validate everything before queuing anything, so a bad prompt leaves the engine untouched.
        for _, ids in encoded:
            self.engine.validate_prompt(ids)
        request_ids = []
        for (text, ids), params in zip(encoded, params_list):
            request_id = str(next(self._counter))
            request_ids.append(request_id)
            group = request_id if params.n > 1 else None
            for child_id, child_params in self.processor.add_request(request_id, text, ids, params):
                self.engine.add_request(EngineCoreRequest(child_id, ids, child_params, time.monotonic(), group))
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        num_out_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                engine_outputs = self.engine.step()
                num_out_tokens += sum(len(o.new_token_ids) for o in engine_outputs)
                processed = self.processor.process(engine_outputs)
                if processed.abort_ids:
                    self.engine.abort_requests(processed.abort_ids)
                for ro in processed.request_outputs:
                    if ro.finished:
                        finished[ro.request_id] = ro
                        bar.update(1)
                if use_tqdm:
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"output {num_out_tokens / elapsed:.1f} tok/s", refresh=False)
        finally:
            bar.close()
            leftover = [r for r in request_ids if r not in finished]
            for r in leftover:  # only on an exception: leave the engine clean
                self.engine.abort_requests(self.processor.abort_request(r))
        return [finished[r] for r in request_ids]

    def get_metrics(self) -> dict[str, Any]:
        """Engine counters, including speculative-decoding acceptance (same figures as /metrics)."""
        s = self.engine.stats()
        metrics: dict[str, Any] = dataclasses.asdict(s)
        metrics["num_steps"] = self.engine.num_steps
        runner = self.engine.runner
        if self.engine.step_seconds > 0:
            # Everything but the model forwards (target + drafter): scheduling, batch building,
            # sampling / verification, bookkeeping.
            busy = runner.forward_seconds + runner.drafter_seconds
            metrics["engine_overhead_fraction"] = max(0.0, 1.0 - busy / self.engine.step_seconds)
            metrics["step_seconds"] = self.engine.step_seconds
            metrics["forward_seconds"] = runner.forward_seconds
            metrics["drafter_seconds"] = runner.drafter_seconds
        metrics["prompt_tokens"] = self.engine.num_prompt_tokens
        metrics["generation_tokens"] = self.engine.num_generation_tokens
        if s.spec_num_drafts:
            metrics["spec_mean_acceptance_length"] = 1.0 + s.spec_num_accepted_tokens / s.spec_num_drafts
            metrics["spec_acceptance_rate_per_pos"] = [a / s.spec_num_drafts for a in s.spec_accepted_per_pos]
        return metrics
