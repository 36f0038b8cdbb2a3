"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from folio.config import CacheConfig, SchedulerConfig, parse_dtype, parse_memory
from folio.engine.engine_core import EngineCore
from folio.engine.model_loader import LoadedModel, load_model
from folio.engine.request import Request
from folio.outputs import CompletionOutput, RequestMetrics, RequestOutput
from folio.platform import configure_threads, default_device
from folio.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | None = None,
        kv_cache_memory: str | int | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 1024,
        max_model_len: int | None = None,
    ) -> None:
        from folio.loaders.catalog import resolve_model

        configure_threads()
        self.device = torch.device(device) if device else default_device()
        self.dtype = parse_dtype(dtype)
        self.loaded: LoadedModel = load_model(resolve_model(str(model)), self.dtype, self.device)
        self.tokenizer = self.loaded.tokenizer
        self.model_config = self.loaded.config
        self.engine = EngineCore(
            self.loaded.model,
            self.model_config,
            CacheConfig(block_size=block_size, kv_cache_memory=parse_memory(kv_cache_memory), num_blocks=num_kv_blocks),
            SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len or self.model_config.max_position_embeddings,
            ),
            self.dtype,
            self.device,
        )
        self._ids = itertools.count()

    # -- requests ----------------------------------------------------------------------------------
    def _make_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return Request(
            request_id=str(next(self._ids)),
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
        )

    def _output(self, request: Request, prompt: str | None) -> RequestOutput:
        reason = request.finish_reason.value if request.finish_reason else None
        return RequestOutput(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    self.tokenizer.decode(request.output_token_ids), list(request.output_token_ids), reason
                )
            ],
            finished=request.is_finished,
            metrics=RequestMetrics(
                request.arrival_time, request.first_token_time, request.finish_time, request.num_preemptions
            ),
        )

    # -- public API --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        bar = tqdm(total=len(requests), desc="generating", unit="req", disable=not use_tqdm or len(requests) < 2)
        try:
            for request in requests:
                self.engine.add_request(request)
            while self.engine.has_unfinished():
                finished = sum(r.is_finished for r in self.engine.step())
                bar.update(finished)
        finally:
            bar.close()
            for request in requests:  # a bad prompt or an error mid-run must not leave requests behind
                if not request.is_finished:
                    self.engine.abort_request(request.request_id)
        return [self._output(r, p if isinstance(p, str) else None) for r, p in zip(requests, prompts, strict=True)]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text as tokens are generated (one request)."""
        request = self._make_request(prompt, sampling_params or SamplingParams())
        self.engine.add_request(request)
        decoder = self.tokenizer.decode_stream()
        emitted = 0
        try:
            while not request.is_finished:
                self.engine.step()
                for token in request.output_token_ids[emitted:]:
                    if token in request.eos_token_ids and request.is_finished:
                        continue
                    text = decoder.step(token)
                    if text:
                        yield text
                emitted = len(request.output_token_ids)
        finally:
            if not request.is_finished:
                self.engine.abort_request(request.request_id)

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
