"""How a throughput benchmark's requests choose their tokens: greedy (the default), or sampled with a
temperature, top-p and top-k, the same settings for folio and for the transformers peer."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from folio.sampling_params import SamplingParams


@dataclass(frozen=True)
class BenchSampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"--temperature must be at least 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be at least 0 (0 is off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def folio_params(self, max_tokens: int, seed: int) -> SamplingParams:
        """Each request its own seed, so a sampled run is the same run each time."""
        if self.greedy:
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=seed, ignore_eos=True,
        )  # fmt: skip

    def hf_generate_kwargs(self) -> dict[str, Any]:
        """transformers' `generate` arguments for the same choice (its top_k is 50 unless set: 0 is off)."""
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default) decodes greedily; above 0 samples, seeded"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus of sampled requests (default 1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k of sampled requests (default 0: off)")


def sampling_from_args(args: argparse.Namespace) -> BenchSampling:
    return BenchSampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
