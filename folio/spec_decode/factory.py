"""The proposer a SpeculativeConfig names."""

from __future__ import annotations

from folio.config import SpeculativeConfig
from folio.spec_decode.ngram import NgramProposer
from folio.spec_decode.proposer import Proposer
from folio.spec_decode.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"no proposer for speculative method {config.method!r}")
