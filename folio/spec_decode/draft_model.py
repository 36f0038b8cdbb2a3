"""Draft-model speculation: a cheaper model that shares the target's vocabulary (a smaller model of
the same family, or the same GGUF file kept 4-bit while the target is served dense) drafts each
request's next k tokens greedily, one batched decode step per token; the target verifies them.

The draft keeps its own paged KV cache (its own BlockPool, the target's block size) holding each
request's context as far as the draft has it. Each step it first catches up on what the request
gained (the accepted drafts and the target's own token; the whole prompt the first time), then
drafts. What a verification rejected is simply replaced: the draft keeps the longest prefix its
cache shares with the request's context. Drafts are greedy (a one-hot proposal), which the rejection
sampler accepts exactly for sampled requests too.

A draft of the target's own architecture (the same model in another weight format) does not compute
the context's K/V at all: the target's cache already holds every context position but the last, so
those are copied from it, and catching up is one decode row. The draft's K/V would differ from the
target's only by its weights' rounding; its drafts are proposals either way, verified exactly."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from folio.config import SpeculativeConfig
from folio.kv_cache.block_pool import BlockPool
from folio.layers.attention.kv_tensors import LayerKV
from folio.layers.attention.metadata import build_attention_metadata
from folio.models.base import CausalLM
from folio.spec_decode.proposer import DraftRequest, Proposer, common_prefix


@dataclass
class _DraftSequence:
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V the draft's cache holds, in order
    block_ids: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model: CausalLM,
        config: SpeculativeConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        target_kv: list[LayerKV] | None = None,
        target_layer_groups: Sequence[int] = (),
    ) -> None:
        """`target_kv`: the target's K/V per layer, each layer read through the block table of its KV
        cache group (`target_layer_groups`, all the first group's if empty)."""
        self.model = model
        self.k = config.num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.pool = BlockPool(num_blocks)
        self.max_positions = model.config.max_position_embeddings
        self.kv = model.bind_kv_cache(num_blocks * block_size, block_size, dtype, None, device)
        self.target_kv = target_kv if target_kv is not None and _same_layout(self.kv, target_kv) else None
        self.target_groups = tuple(target_layer_groups) or (0,) * len(self.kv)
        self.sequences: dict[str, _DraftSequence] = {}

    def finish(self, request_id: str, token_ids: list[int]) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.pool.free(sequence.block_ids)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        # Catch up: each request feeds what its draft cache lacks (at least its last token, whose
        # logits give the first draft) in one flat batch.
        active: list[tuple[DraftRequest, _DraftSequence, int]] = []
        for request in requests:
            sequence = self.sequences.setdefault(request.request_id, _DraftSequence())
            keep = min(common_prefix(sequence.token_ids, request.token_ids), len(request.token_ids) - 1)
            del sequence.token_ids[keep:]
            num_drafts = min(self.k, request.max_tokens)
            if num_drafts > 0 and self._reserve(sequence, len(request.token_ids) + num_drafts - 1):
                active.append((request, sequence, keep))
        if not active:
            return {}
        drafts: dict[str, list[int]] = {}
        if self.target_kv is not None and all(r.block_tables for r, _, _ in active):
            self._copy_target_kv(active)
            active = [(r, s, len(r.token_ids) - 1) for r, s, _ in active]
        chunks = [(r.token_ids[keep:], keep, s) for r, s, keep in active]
        for (request, sequence, _), token in zip(active, self._step(chunks), strict=True):
            sequence.token_ids += request.token_ids[len(sequence.token_ids) :]  # it now holds them all
            drafts[request.request_id] = [token]
        # Then one decode step per further draft, over the requests that want more.
        for j in range(1, self.k):
            going = [(r, s) for r, s, _ in active if min(self.k, r.max_tokens) > j]
            if not going:
                break
            chunks = [([drafts[r.request_id][-1]], len(s.token_ids), s) for r, s in going]
            for (request, sequence), token in zip(going, self._step(chunks), strict=True):
                sequence.token_ids.append(drafts[request.request_id][-1])
                drafts[request.request_id].append(token)
        return drafts

    def _copy_target_kv(self, active: list[tuple[DraftRequest, _DraftSequence, int]]) -> None:
        """Every request's context positions from `keep` to the last (excluded), from the target's cache."""
        assert self.target_kv is not None
        num_groups = len(active[0][0].block_tables)
        sources: list[list[int]] = [[] for _ in range(num_groups)]  # per KV cache group of the target
        destination: list[int] = []
        size = self.block_size
        for request, sequence, keep in active:
            for position in range(keep, len(request.token_ids) - 1):
                block, offset = divmod(position, size)
                for source, table in zip(sources, request.block_tables, strict=True):
                    source.append(table[block] * size + offset)
                destination.append(sequence.block_ids[block] * size + offset)
        if not destination:
            return
        src = [torch.tensor(source, dtype=torch.long, device=self.device) for source in sources]
        dst = torch.tensor(destination, dtype=torch.long, device=self.device)
        for own, target, group in zip(self.kv, self.target_kv, self.target_groups, strict=True):
            # A window layer's positions behind its window come from the target's placeholder block: finite,
            # and never read unmasked by the draft's window layer either.
            own.k.index_copy_(0, dst, target.k.index_select(0, src[group]))
            own.v.index_copy_(0, dst, target.v.index_select(0, src[group]))

    def _reserve(self, sequence: _DraftSequence, num_tokens: int) -> bool:
        """Blocks for `num_tokens` positions; False (no drafts this step) when the pool or the draft's
        context length cannot take them."""
        if num_tokens > self.max_positions:
            return False
        missing = -(-num_tokens // self.block_size) - len(sequence.block_ids)
        if missing > self.pool.num_free_blocks:
            return False
        if missing > 0:
            sequence.block_ids += self.pool.allocate(missing)
        return True

    def _step(self, chunks: list[tuple[list[int], int, _DraftSequence]]) -> list[int]:
        """One forward of the draft over each chunk (tokens, first position); each chunk's greedy next token."""
        input_ids = [t for tokens, _, _ in chunks for t in tokens]
        positions = [p for tokens, start, _ in chunks for p in range(start, start + len(tokens))]
        meta = build_attention_metadata(
            [start for _, start, _ in chunks],
            [len(tokens) for tokens, _, _ in chunks],
            [s.block_ids for _, _, s in chunks],
            self.block_size,
            self.device,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            meta,
        )
        last_rows = [end - 1 for end in itertools.accumulate(len(tokens) for tokens, _, _ in chunks)]
        logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=hidden.device)])
        return logits.argmax(dim=-1).tolist()


def _same_layout(own: list[LayerKV], target: list[LayerKV]) -> bool:
    """Whether the target's cache holds K/V this draft could have computed: as many layers, the same
    heads, head size and dtype, and not 8-bit."""
    return len(own) == len(target) and all(
        t.fmt is None and o.k.shape[1:] == t.k.shape[1:] and o.k.dtype == t.k.dtype
        for o, t in zip(own, target, strict=True)
    )
