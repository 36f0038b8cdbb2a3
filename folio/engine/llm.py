"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, `LLM.chat(messages)` and
`LLM.embed(prompts)`."""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from folio.config import SpeculativeConfig
from folio.engine.engine_core import EngineCore
from folio.engine.output_processor import OutputProcessor
from folio.engine.request import Request
from folio.engine_args import EngineArgs
from folio.loaders.model_loader import LoadedModel
from folio.lora.adapter import LoRARequest
from folio.outputs import CompletionOutput, EmbeddingOutput, RequestMetrics, RequestOutput
from folio.sampling_params import PoolingParams, SamplingParams

logger = logging.getLogger("folio")

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
        kv_offload_ram: str | int | None = None,
        kv_cache_dir: str | Path | None = None,
        kv_cache_disk: str | int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 1024,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        hybrid_kv_cache: bool = True,
        batching: str = "continuous",
        batch_size: int | None = None,
        batch_timeout_ms: float = 50.0,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        speculative_config: SpeculativeConfig | dict | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        context_parallel_size: int = 1,
        pipeline_micro_batches: int | None = None,
        pipeline_layers: str | Sequence[int] | None = None,  # layers per stage: "9,9" or (9, 9)
        nnodes: int = 1,
        master_addr: str | None = None,
        master_port: int | None = None,
        cpu_collectives: str = "shm",
        pooling: str = "last",
        compile: bool = False,
        activation_bits: int = 16,
        enforce_eager: bool = False,
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        lora_dtype: str = "auto",
    ) -> None:
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig(**speculative_config)
        if pipeline_layers is not None and not isinstance(pipeline_layers, str):
            pipeline_layers = ",".join(map(str, pipeline_layers))
        args = EngineArgs(
            str(model), dtype=dtype, device=device, kv_cache_memory=kv_cache_memory, num_kv_blocks=num_kv_blocks,
            kv_offload_ram=kv_offload_ram, kv_cache_dir=None if kv_cache_dir is None else str(kv_cache_dir),
            kv_cache_disk=kv_cache_disk, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            hybrid_kv_cache=hybrid_kv_cache, batching=batching, batch_size=batch_size,
            batch_timeout_ms=batch_timeout_ms, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            speculative_config=speculative_config, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, context_parallel_size=context_parallel_size,
            pipeline_micro_batches=pipeline_micro_batches, pipeline_layers=pipeline_layers, nnodes=nnodes,
            master_addr=master_addr, master_port=master_port, cpu_collectives=cpu_collectives, pooling=pooling,
            compile=compile, activation_bits=activation_bits, enforce_eager=enforce_eager, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank, lora_dtype=lora_dtype,
        )  # fmt: skip
        self.engine = EngineCore.from_engine_args(args)
        assert self.engine.loaded is not None
        self.loaded: LoadedModel = self.engine.loaded
        self.draft: LoadedModel | None = self.engine.draft
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.dtype, self.device = self.engine.dtype, self.engine.device
        # Ranks are processes: stop them when this LLM is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self._ids = itertools.count()

    @contextlib.contextmanager
    def _offline(self) -> Iterator[None]:
        """While this LLM steps the engine, every request was submitted first: a partial batch never
        waits for more (the gate's `flush`). The engine is left as it was for anyone else."""
        gate = self.engine.scheduler.gate
        before, gate.flush = gate.flush, True
        try:
            yield
        finally:
            gate.flush = before

    def close(self) -> None:
        """Stop the model's ranks now (an in-process model has none; the engine is unusable after)."""
        self._finalizer()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        return cls(args.model, **args.llm_kwargs())

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

    def _output(self, group: list[Request], prompt: str | None, processor: OutputProcessor) -> RequestOutput:
        first = group[0]
        outputs = []
        for request in group:
            text = processor.text(request)
            logprobs = list(request.output_logprobs) if request.sampling_params.logprobs is not None else None
            reason = request.finish_reason.value if request.finish_reason else None
            outputs.append(
                CompletionOutput(text, list(request.output_token_ids), reason, logprobs, request.cumulative_logprob)
            )
        return RequestOutput(
            request_id=first.request_id,
            prompt=prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=all(r.is_finished for r in group),
            metrics=RequestMetrics(
                first.arrival_time,
                first.first_token_time,
                max((r.finish_time for r in group if r.finish_time is not None), default=None),
                sum(r.num_preemptions for r in group),
                first.num_cached_tokens,
            ),
            prompt_logprobs=list(first.prompt_logprobs) if first.sampling_params.prompt_logprobs is not None else None,
        )

    def _run(
        self, groups: list[list[Request]], desc: str, use_tqdm: bool, processor: OutputProcessor | None = None
    ) -> None:
        """Add each group (a request and its forks) and step the engine until all are done."""
        requests = [r for group in groups for r in group]
        bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not use_tqdm or len(requests) < 2)
        with self._offline():
            try:
                for first, *forks in groups:
                    self.engine.add_request(first, forks)
                while self.engine.has_unfinished():
                    updated = self.engine.step()
                    if processor is not None:  # before counting: it may end requests (a stop string)
                        processor.process(updated)
                    bar.update(sum(r.is_finished for r in updated))
            finally:
                bar.close()
                for request in requests:  # a bad prompt or an error mid-run must not leave requests behind
                    if not request.is_finished:
                        self.engine.abort_request(request.request_id)

    # -- public API --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs come back in prompt order.
        `priority` (one per prompt, lower first) orders admission and preemption; `lora_request` (one, or
        one per prompt, None for the base model) runs prompts with LoRA adapters (LLM(enable_lora=True)),
        each registered the first time it is named."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        adapters = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(adapters)} LoRA requests")
        known = set(self.engine.lora_names())
        for adapter in {a for a in adapters if a is not None and a.name not in known}:
            self.engine.add_lora(adapter)
        groups = [self._make_samples(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        processor = OutputProcessor(self.engine, self.tokenizer)
        for group, rank, adapter in zip(groups, priorities, adapters, strict=True):
            for request in group:
                request.priority = rank
                request.lora_name = adapter.name if adapter is not None else None
                processor.add(request, stream_text=False)  # decoded once at the end, unless stop strings need it
        self._run(groups, "generating", use_tqdm, processor)
        return [
            self._output(group, p if isinstance(p, str) else None, processor)
            for group, p in zip(groups, prompts, strict=True)
        ]

    def _make_samples(self, prompt: Prompt, params: SamplingParams) -> list[Request]:
        """One request per sample; sample j draws with seed + j so that the samples differ."""
        first = self._make_request(prompt, params)
        forks = [Request(str(next(self._ids)), first.prompt_token_ids, replace(params, seed=params.sample_seed(j)),
                         eos_token_ids=first.eos_token_ids) for j in range(1, params.n)]  # fmt: skip
        return [first, *forks]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text as tokens are generated (one request)."""
        request = self._make_request(prompt, sampling_params or SamplingParams())
        self.engine.add_request(request)
        processor = OutputProcessor(self.engine, self.tokenizer)
        processor.add(request)
        with self._offline():
            try:
                while not request.is_finished:
                    for delta in processor.process(self.engine.step()):
                        if delta.text:
                            yield delta.text
            finally:
                if not request.is_finished:
                    self.engine.abort_request(request.request_id)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str | None = None,
        normalize: bool = True,
        use_tqdm: bool = True,
    ) -> list[EmbeddingOutput]:
        """Each prompt's final hidden state (after the final norm), pooled over its last token or the mean
        of all its tokens (`pooling`; None: the engine's `pooling` option), L2-normalised unless
        `normalize` is False. The prompts run as prefill-only requests, in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = SamplingParams(max_tokens=1, pooling=PoolingParams(pooling, normalize))
        requests = [self._make_request(p, params) for p in prompts]
        self._run([[r] for r in requests], "embedding", use_tqdm)
        outputs = []
        for request, prompt in zip(requests, prompts, strict=True):
            if request.embedding is None:
                raise RuntimeError(f"embedding request {request.request_id} failed: {request.error}")
            outputs.append(EmbeddingOutput(request.request_id, prompt if isinstance(prompt, str) else None,
                                           request.prompt_token_ids, request.embedding.tolist()))  # fmt: skip
        return outputs

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
