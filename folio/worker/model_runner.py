"""Runs the model on a scheduler's flat batch: builds tensors, owns the KV cache, samples.

The runner never touches the block pool; block ids arrive in the SchedulerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from folio.config import CacheConfig, ModelConfig
from folio.engine.beam_search import BeamCandidates, top_candidates
from folio.engine.scheduler_output import SchedulerOutput
from folio.kv_cache.quant import SCALE_DTYPE, kv_format, slot_bytes_per_head
from folio.layers.attention.kv_tensors import LayerKV
from folio.layers.attention.metadata import AttentionMetadata, build_attention_metadata
from folio.outputs import TokenLogprob
from folio.structured.grammar import MaskTiming
from folio.worker.row_sampling import SampleSpec, sample_rows


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_rows: list[int]  # row in [T] of each request that samples this step (a fork repeats its parent's)
    sampled_ids: list[str]  # request ids, aligned with logits_rows
    samplers: list[SampleSpec]  # sampling settings, aligned with logits_rows


@dataclass
class RunnerOutput:
    """What one step produced, by request id: the sampled token and, if asked for, its logprobs;
    for a beam, its best next tokens instead; for a request whose row failed, what failed."""

    token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob]
    beam_candidates: dict[str, BeamCandidates] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V of every layer for one token, with their scales if the cache is 8-bit."""
    per_head = slot_bytes_per_head(config.head_dim, dtype, kv_format(kv_cache_dtype))
    return 2 * config.num_layers * config.num_kv_heads * per_head


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On CPU, numpy's calloc-backed zeros map pages lazily, so a multi-GiB pool
    costs nothing until used (torch.zeros would touch every page up front). Zeros matter: padded key
    slots are masked, but garbage NaNs in V would still poison the attention product."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(int(np.prod(shape)) * itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        cache: CacheConfig,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = cache.block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = device
        slots = num_blocks * self.block_size
        shape = (slots, config.num_kv_heads, config.head_dim)
        self.mask_timing = MaskTiming()
        fmt = kv_format(cache.kv_cache_dtype)
        code_dtype = dtype if fmt is None else fmt.dtype
        self.kv_caches: list[LayerKV] = []
        for layer in model.attention_layers():
            layer_kv = LayerKV(_zeros(shape, code_dtype, device), _zeros(shape, code_dtype, device), fmt)
            if fmt is not None:
                layer_kv.k_scales = _zeros(shape[:2], SCALE_DTYPE, device)
                layer_kv.v_scales = _zeros(shape[:2], SCALE_DTYPE, device)
            layer.bind_cache(layer_kv, self.block_size)
            self.kv_caches.append(layer_kv)
        for module in model.modules():  # now, so that a start-up compiles or reports them, not a request
            if (packed := getattr(module, "packed", None)) is not None:
                packed.load_kernels()
        model.bind_decode_stack(dtype)

    def prepare(self, out: SchedulerOutput) -> BatchInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        sampled_ids: list[str] = []
        samplers: list[SampleSpec] = []
        for item in out.scheduled:
            input_ids.extend(item.token_ids)
            positions.extend(range(item.start_position, item.start_position + item.num_tokens))
            if item.needs_sample:
                logits_rows.append(len(input_ids) - 1)
                sampled_ids.append(item.request_id)
                samplers.append(
                    SampleSpec(item.sampling_params, item.generator, item.prompt_token_ids, item.output_token_ids,
                               item.num_beam_candidates, item.grammar)
                )  # fmt: skip
                for fork in item.forks:
                    logits_rows.append(len(input_ids) - 1)
                    sampled_ids.append(fork.request_id)
                    samplers.append(SampleSpec(fork.sampling_params, fork.generator, fork.prompt_token_ids, [],
                                               grammar=fork.grammar))  # fmt: skip
        meta = build_attention_metadata(
            [s.start_position for s in out.scheduled],
            [s.num_tokens for s in out.scheduled],
            [s.block_table for s in out.scheduled],
            self.block_size,
            self.device,
        )
        return BatchInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            meta=meta,
            logits_rows=logits_rows,
            sampled_ids=sampled_ids,
            samplers=samplers,
        )

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks of every layer's K and V before they diverge."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer_kv in self.kv_caches:
            layer_kv.copy_blocks(src, dst, self.block_size)

    @torch.inference_mode()
    def forward(self, inputs: BatchInputs) -> torch.Tensor:
        """Hidden states for every scheduled token, [T, hidden]."""
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """One forward over the batch; samples a token for each request whose chunk reached its end."""
        inputs = self.prepare(out)
        if out.block_copies:
            self.copy_blocks(out.block_copies)
        hidden = self.forward(inputs)
        if not inputs.logits_rows:
            return RunnerOutput({}, {})
        # The LM head runs only on rows that sample: for a long prefill that is one row, not thousands.
        logits = self.compute_logits(hidden[torch.tensor(inputs.logits_rows, device=hidden.device)])
        result = sample_rows(logits.cpu(), inputs.samplers, self.mask_timing)
        ids = inputs.sampled_ids
        failed = {ids[row]: problem for row, problem in result.failures.items()}
        tokens = {rid: token for rid, token in zip(ids, result.token_ids, strict=True) if rid not in failed}
        logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs, strict=True) if lp and rid not in failed}
        return RunnerOutput(tokens, logprobs, self._beam_candidates(logits, inputs), failed)

    @staticmethod
    def _beam_candidates(logits: torch.Tensor, inputs: BatchInputs) -> dict[str, BeamCandidates]:
        beam_rows = [i for i, spec in enumerate(inputs.samplers) if spec.num_beam_candidates]
        if not beam_rows:
            return {}
        k = max(inputs.samplers[i].num_beam_candidates for i in beam_rows)
        found = top_candidates(logits[torch.tensor(beam_rows, device=logits.device)].cpu(), k)
        candidates = {}
        for row, best in zip(beam_rows, found, strict=True):
            n = inputs.samplers[row].num_beam_candidates
            candidates[inputs.sampled_ids[row]] = BeamCandidates(best.logprobs[:n], best.token_ids[:n])
        return candidates
