"""The proposer a SpeculativeConfig names."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from folio.config import SpeculativeConfig
from folio.layers.attention.kv_tensors import LayerKV
from folio.models.base import CausalLM
from folio.spec_decode.draft_model import DraftModelProposer
from folio.spec_decode.lookahead import LookaheadProposer
from folio.spec_decode.ngram import NgramProposer
from folio.spec_decode.proposer import Proposer
from folio.spec_decode.suffix import SuffixProposer


def make_proposer(
    config: SpeculativeConfig,
    draft_model: CausalLM | None,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    target_kv: list[LayerKV] | None = None,
    target_layer_groups: Sequence[int] = (),
) -> Proposer:
    """`num_blocks` x `block_size`: the target's KV pool, which a draft model's own pool matches in
    tokens; `target_kv`: the target's cache, which a draft of the same architecture reads, each layer through
    the block table of its KV cache group (`target_layer_groups`)."""
    learned = {"ngram": NgramProposer, "suffix": SuffixProposer, "lookahead": LookaheadProposer}  # no model
    if config.method in learned:
        return learned[config.method](config)
    if config.method == "draft":
        if draft_model is None:
            raise ValueError("speculative method 'draft' needs the loaded draft model")
        return DraftModelProposer(draft_model, config, num_blocks, block_size, dtype, device, target_kv,
                                  target_layer_groups)  # fmt: skip
    raise ValueError(f"no proposer for speculative method {config.method!r}")
