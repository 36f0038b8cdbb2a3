"""Runs the model on a scheduler's flat batch: builds tensors, owns the KV cache, samples.

The runner never touches the block pool: block ids arrive in the SchedulerOutput, a plain value, and
what it must remember about a request between steps (tokens, block table, sampling parameters, seeded
generator) lives in its own `RequestStates`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from folio.config import CacheConfig, ModelConfig, SpeculativeConfig
from folio.distributed.context_parallel import ContextParallel
from folio.kv_cache.groups import KVGroups
from folio.kv_cache.quant import kv_format, slot_bytes_per_head
from folio.kv_cache.tier_ops import TierOps
from folio.layers.attention.kv_tensors import LayerKV
from folio.lora.store import LoRAStore
from folio.outputs import TokenLogprob
from folio.sample.logprobs import gather_logprobs, top_candidates
from folio.spec_decode.proposer import DraftRequest, Proposer, next_draft_length
from folio.spec_decode.verification import Verified, verify_drafts, verify_greedy_choices
from folio.step import BeamCandidates, ModelRunnerOutput, SchedulerOutput
from folio.worker.batch_inputs import BatchInputs, prepare_batch
from folio.worker.context_step import run_split_context, split_over_ranks
from folio.worker.cuda_graphs import DecodeGraphs
from folio.worker.disk_tier_store import DiskTierStore
from folio.worker.host_tier_store import HostTierStore
from folio.worker.pipeline_step import Span, micro_batches, run_stage
from folio.worker.pooling import pool_embeddings
from folio.worker.request_states import RequestState, RequestStates
from folio.worker.row_sampling import sample_rows

logger = logging.getLogger("folio")

# Called with (request id, positions, their logits [len(positions), V]) for every row whose logits a
# step computes: analysis tools and the oracle tests read raw logits through it.
LogitsObserver = Callable[[str, list[int], torch.Tensor], None]
# A verification, for the proposer: the drafts checked and the target's greedy choice at each row.
DraftsChecked = tuple[list[int], list[int]]


def kv_bytes_per_token(
    config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto", num_kv_heads: int | None = None
) -> int:
    """K and V of every layer for one token, with their scales if the cache is 8-bit; `num_kv_heads`:
    the heads one tensor-parallel rank holds (default: all)."""
    per_head = slot_bytes_per_head(config.head_dim, dtype, kv_format(kv_cache_dtype))
    return 2 * config.num_layers * (num_kv_heads or config.num_kv_heads) * per_head


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        cache: CacheConfig,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        speculative_config: SpeculativeConfig | None = None,
        micro_batches: int = 1,
        context: ContextParallel | None = None,
        kv_groups: KVGroups | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        """`micro_batches`: how many pieces a pipeline stage splits a step into (unused whole);
        `context`: the ranks the context is split over (each holds every block's positions p with
        p % ranks == its rank: block_size / ranks slots of each block); `kv_groups`: the layers' KV cache
        groups (None: one, every layer in one block table); `cuda_graphs`: replay captured graphs for
        pure decode steps of a whole model on a GPU (cuda_graphs.py)."""
        self.model = model
        self.micro_batches = micro_batches
        self.config = config
        self.block_size = cache.block_size
        self.context = context if context is not None and context.size > 1 else None
        self.slots_per_block = self.block_size // (self.context.size if self.context is not None else 1)
        self.dtype = dtype
        self.device = device
        self.requests = RequestStates()
        self.in_transit: list[tuple[Any, torch.Tensor]] = []  # a pipeline stage's sends to the next stage
        self.speculative_config = speculative_config
        # Set by the engine once this runner's KV cache exists (a draft of the same model reads it).
        self.proposer: Proposer | None = None
        self.logits_observer: LogitsObserver | None = None
        self.lora: LoRAStore | None = None  # set by the engine with --enable-lora (whole models)
        self.host_tier: HostTierStore | None = None  # set by the engine with --kv-offload-ram
        self.disk_tier: DiskTierStore | None = None  # and with --kv-cache-dir
        fmt = kv_format(cache.kv_cache_dtype)
        slots = self.slots_per_block
        self.kv_groups = kv_groups
        self.graphs: DecodeGraphs | None = None
        graphs = cuda_graphs and device.type == "cuda" and model.stage.size == 1 and self.context is None
        if graphs:  # one block past the pool's: the scratch block that a graph's padded rows write to
            num_groups = kv_groups.num_groups if kv_groups is not None else 1
            self.graphs = DecodeGraphs(model, self.block_size, num_blocks, num_groups, device)
        bound_slots = (num_blocks + int(graphs)) * slots
        # Per layer; with several KV cache groups, the layers of one slot share their tensors.
        self.kv_caches: list[LayerKV] = model.bind_kv_cache(bound_slots, slots, dtype, fmt, device, kv_groups)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks of every layer's K and V before they diverge."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer_kv in {id(c): c for c in self.kv_caches}.values():
            layer_kv.copy_blocks(src, dst, self.slots_per_block)

    @torch.inference_mode()
    def forward(self, inputs: BatchInputs, out: SchedulerOutput) -> torch.Tensor | None:
        """Hidden states for every scheduled token, [T, hidden] (with the context split over ranks,
        only the rows whose logits the step needs are filled); None on a pipeline stage before the
        last (it sent its part on)."""
        stage = self.model.stage
        if self.context is not None:
            tables = [self.requests[c.request_id].block_ids for c in out.scheduled for _ in range(c.num_tokens)]
            scored = {*inputs.logits_rows, *inputs.prompt_rows}
            scored.update(row for first, k in inputs.draft_rows.values() for row in range(first, first + k + 1))
            scored.update(row for span in inputs.pooled.values() for row in span.rows)
            return run_split_context(self.model, self.context, inputs.input_ids, inputs.positions, inputs.meta, tables,
                                     self.block_size, list(scored))  # fmt: skip
        adapter_rows = self.lora is not None and self.lora.batch.active  # graphs hold the base weights only
        if self.graphs is not None and not adapter_rows and self.graphs.takes(out):
            return self.graphs.run(out, self.requests)
        if stage.size == 1:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta)
        spans = [Span(c.start_position, c.num_tokens, self.requests[c.request_id].block_ids, c.num_draft_tokens > 0)
                 for c in out.scheduled]  # fmt: skip
        batches = micro_batches(spans, self.micro_batches, self.block_size, self.device)
        parts = 2 if self.model.model.carries_residual else 1
        return run_stage(self.model, stage, inputs.input_ids, inputs.positions, batches,
                         (parts, self.config.hidden_size), self.dtype, self.in_transit)  # fmt: skip

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.context is not None:  # every rank has the rows: each computes its share of them
            tail = (self.config.vocab_size,)
            return split_over_ranks(self.context, hidden, self.model.compute_logits, tail, torch.float32)
        return self.model.compute_logits(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's `greedy_tokens` (argmax [N], all finite [N] bool), its rows dealt out over the
        ranks of a split context."""
        if self.context is None:
            return self.model.greedy_tokens(hidden)

        def packed(rows: torch.Tensor) -> torch.Tensor:
            tokens, finite = self.model.greedy_tokens(rows)
            return torch.stack([tokens.double(), finite.double()], dim=-1)

        both = split_over_ranks(self.context, hidden, packed, (2,), torch.float64)
        return both[:, 0].long(), both[:, 1].bool()

    def run_tier_ops(self, ops: TierOps) -> None:
        """The KV tiers' copies and file operations, in the order kv_cache/tier_ops.py gives."""
        disk = self.disk_tier  # disk operations come only from an engine that attached one
        if disk is not None:
            disk.save(ops.disk_saves)
        if ops.copies:
            assert self.host_tier is not None
            self.host_tier.run(ops.copies)
        if disk is not None:
            for load in ops.disk_loads:
                disk.load(load)
            for digest in ops.disk_removes:
                disk.remove(digest)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One forward over the batch; samples a token for each request whose chunk reached its end (an
        embedding request's pooled hidden state instead)."""
        self.run_tier_ops(out.tier_ops)  # first: a save reads a block this step may write into
        for state in self.requests.update(out):
            if self.proposer is not None:
                self.proposer.finish(state.request_id, state.token_ids)
        if out.is_empty:
            return ModelRunnerOutput()
        inputs = prepare_batch(out, self.requests, self.config.vocab_size, self.block_size, self.device)
        if out.block_copies:
            self.copy_blocks(list(out.block_copies))
        if self.lora is not None:
            self.lora.prepare([(c.num_tokens, self.requests[c.request_id].lora_name) for c in out.scheduled])
        hidden = self.forward(inputs, out)
        if hidden is None:  # the last pipeline stage reports the step
            return ModelRunnerOutput()
        prompt_logprobs = self._prompt_logprobs(hidden, inputs)
        accepted, accepted_logprobs, choices, failed = self._verify_drafts(hidden, inputs)
        embeddings, failed_pooling = pool_embeddings(hidden, inputs.pooled, self.requests)
        failed |= failed_pooling
        tokens: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        candidates: dict[str, BeamCandidates] = {}
        if inputs.logits_rows and self._all_plain_greedy(inputs):
            tokens, not_finite = self._greedy(hidden, inputs)
            failed |= not_finite
        elif inputs.logits_rows:
            # The LM head runs only on rows that sample: for a long prefill that is one row, not thousands.
            logits = self.compute_logits(_rows(hidden, inputs.logits_rows))
            if self.logits_observer is not None:
                for row, (request_id, flat) in enumerate(zip(inputs.sampled_ids, inputs.logits_rows, strict=True)):
                    self.logits_observer(request_id, [int(inputs.positions[flat])], logits[row : row + 1])
            result = sample_rows(logits.cpu(), inputs.samplers)
            ids = inputs.sampled_ids
            failed |= {ids[row]: problem for row, problem in result.failures.items()}
            tokens = {rid: token for rid, token in zip(ids, result.token_ids, strict=True) if rid not in failed}
            logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs, strict=True) if lp and rid not in failed}
            candidates = self._beam_candidates(logits, inputs)
        return ModelRunnerOutput(
            sampled_token_ids={rid: [token] for rid, token in tokens.items()} | accepted,
            logprobs={rid: [logprob] for rid, logprob in logprobs.items()} | accepted_logprobs,
            prompt_logprobs=prompt_logprobs,
            beam_candidates=candidates,
            failed=failed,
            draft_token_ids=self._propose(out, tokens, accepted, choices),
            embeddings=embeddings,
        )

    def _all_plain_greedy(self, inputs: BatchInputs) -> bool:
        """Whether every sampled row's token is its raw argmax and nothing else reads its logits."""
        if self.logits_observer is not None:
            return False
        return all(s.sampling_params.plain_greedy and s.allowed is None and not s.num_beam_candidates
                   for s in inputs.samplers)  # fmt: skip

    def _greedy(self, hidden: torch.Tensor, inputs: BatchInputs) -> tuple[dict[str, int], dict[str, str]]:
        """The argmax of each sampled row, without a sampling batch (or, split, a gathered vocabulary),
        and the rows that fail because their logits were not finite."""
        chosen, finite = self.greedy_tokens(_rows(hidden, inputs.logits_rows))
        picks = list(zip(inputs.sampled_ids, chosen.tolist(), finite.tolist(), strict=True))
        failed = {request_id: "the model's logits were not finite" for request_id, _, ok in picks if not ok}
        return {request_id: token for request_id, token, ok in picks if ok}, failed

    def _verify_drafts(
        self, hidden: torch.Tensor, inputs: BatchInputs
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprob]], dict[str, DraftsChecked], dict[str, str]]:
        """Each speculating request's accepted drafts and next token, and (drafts, the target's greedy
        choice at each row) for the proposer; a fault fails that request only."""
        accepted: dict[str, list[int]] = {}
        accepted_logprobs: dict[str, list[TokenLogprob]] = {}
        choices: dict[str, DraftsChecked] = {}
        failed: dict[str, str] = {}
        for request_id, (first, k) in inputs.draft_rows.items():
            state = self.requests[request_id]
            try:
                drafts = state.token_ids[len(state.token_ids) - k :]
                rows = hidden[first : first + k + 1]
                verified = self._verify_plain_greedy(rows, state, drafts, request_id in inputs.draft_masks)
                if verified is None:
                    logits = self.compute_logits(rows).float().cpu()
                    if self.logits_observer is not None:
                        self.logits_observer(request_id, inputs.positions[first : first + k + 1].tolist(), logits)
                    verified = verify_drafts(logits, state, drafts, inputs.draft_masks.get(request_id))
            except Exception:
                logger.exception("verifying the drafts of request %s failed; failing that request only", request_id)
                failed[request_id] = "sampling failed"
                continue
            if verified.problem is not None:
                failed[request_id] = verified.problem
                continue
            accepted[request_id] = verified.token_ids
            choices[request_id] = (drafts, verified.target_choices)
            if self.speculative_config is not None:
                most = self.speculative_config.num_speculative_tokens
                state.draft_length = next_draft_length(state.draft_length or most, k, len(verified.token_ids) - 1, most)
            if verified.logprobs is not None:
                accepted_logprobs[request_id] = verified.logprobs
        return accepted, accepted_logprobs, choices, failed

    def _verify_plain_greedy(
        self, rows: torch.Tensor, state: RequestState, drafts: list[int], masked: bool
    ) -> Verified | None:
        """A plain-greedy request's drafts checked against the target's argmax at each of its k + 1 rows
        (`greedy_tokens`: no logits gathered, and an 8-bit head's two-stage pick), as `verify_drafts` checks
        them when the logits are all finite; None where the whole logits are needed (sampling, a grammar's
        masks, an observer) or a row was not finite (verify_drafts then names the problem)."""
        if not state.sampling_params.plain_greedy or masked or self.logits_observer is not None:
            return None
        chosen, finite = self.greedy_tokens(rows)
        return verify_greedy_choices(chosen.tolist(), drafts) if bool(finite.all()) else None

    def _propose(
        self,
        out: SchedulerOutput,
        tokens: dict[str, int],
        accepted: dict[str, list[int]],
        choices: dict[str, DraftsChecked],
    ) -> dict[str, list[int]]:
        """Drafts for the next step, from each request's context and the tokens it just gained."""
        spec = self.speculative_config
        if self.proposer is None or spec is None or len(out.scheduled) > spec.disable_by_batch_size:
            return {}
        wanted: list[DraftRequest] = []
        for chunk in out.scheduled:
            new = accepted.get(chunk.request_id) or ([tokens[chunk.request_id]] if chunk.request_id in tokens else [])
            state = self.requests[chunk.request_id]
            params = state.sampling_params
            if not new or not params.speculate or chunk.num_beam_candidates:
                continue
            context = state.token_ids[: chunk.start_position + chunk.num_tokens - chunk.num_draft_tokens] + new
            drafts, target = choices.get(chunk.request_id, ([], []))
            most = state.draft_length or spec.num_speculative_tokens
            wanted.append(DraftRequest(chunk.request_id, context, state.num_prompt_tokens, most, tuple(drafts),
                                       tuple(target), tuple(tuple(t) for t in state.block_tables)))  # fmt: skip
        return self.proposer.propose(wanted) if wanted else {}

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: BatchInputs) -> dict[str, tuple[TokenLogprob, ...]]:
        """For requests with prompt_logprobs: each computed prompt position's logprob of the next prompt token."""
        if not inputs.prompt_rows:
            return {}
        logits = self.compute_logits(_rows(hidden, inputs.prompt_rows)).cpu()
        scored: dict[str, tuple[TokenLogprob, ...]] = {}
        targets = torch.tensor(inputs.prompt_targets)
        for request_id, (first, last) in inputs.prompt_scored.items():
            if self.logits_observer is not None:
                rows = inputs.prompt_rows[first:last]
                self.logits_observer(request_id, inputs.positions[rows].tolist(), logits[first:last])
            num_top = self.requests[request_id].sampling_params.prompt_logprobs
            found = gather_logprobs(logits[first:last], targets[first:last], [num_top] * (last - first))
            scored[request_id] = tuple(lp for lp in found if lp is not None)
        return scored

    @staticmethod
    def _beam_candidates(logits: torch.Tensor, inputs: BatchInputs) -> dict[str, BeamCandidates]:
        beam_rows = [i for i, spec in enumerate(inputs.samplers) if spec.num_beam_candidates]
        if not beam_rows:
            return {}
        k = max(inputs.samplers[i].num_beam_candidates for i in beam_rows)
        found = top_candidates(_rows(logits, beam_rows).cpu(), k)
        candidates = {}
        for row, best in zip(beam_rows, found, strict=True):
            n = inputs.samplers[row].num_beam_candidates
            candidates[inputs.sampled_ids[row]] = BeamCandidates(best.logprobs[:n], best.token_ids[:n])
        return candidates


def _rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return values[torch.tensor(rows, device=values.device)]
