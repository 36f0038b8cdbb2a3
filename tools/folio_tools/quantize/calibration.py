"""What GPTQ and AWQ need to know about a layer's inputs, gathered in one pass over calibration text.

Every projection gets a forward pre-hook while the full-precision model prefills the calibration
windows; the hook accumulates the inputs' second moment X^T X (GPTQ's Hessian, and AWQ's measure of
output error) and their mean magnitude per channel (AWQ's activation statistic). All layers see the
full-precision model's activations: one pass, rather than re-running the calibration text after
each decoder layer is quantized as the GPTQ paper does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from folio.sampling_params import SamplingParams

BATCH_WINDOWS = 8  # windows prefilled per engine call (the progress bar advances per batch)


@dataclass
class InputStatistics:
    second_moment: torch.Tensor  # [K, K] float32: sum of x^T x over every calibration token
    abs_sum: torch.Tensor  # [K] float32: sum of |x|
    tokens: int = 0

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)

    def add(self, x: torch.Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1]).float()
        self.second_moment.addmm_(flat.t(), flat)
        self.abs_sum += flat.abs().sum(dim=0)
        self.tokens += flat.shape[0]


def collect_input_statistics(
    llm: object, windows: list[list[int]], layers: dict[str, nn.Module], show_progress: bool = True
) -> dict[str, InputStatistics]:
    """Prefill every window through `llm` (an LLM made with prefix caching off) and return the input
    statistics of each named layer."""
    stats = {}
    hooks = []
    for name, layer in layers.items():
        cols = layer.in_features
        stats[name] = InputStatistics(torch.zeros(cols, cols), torch.zeros(cols))
        hooks.append(layer.register_forward_pre_hook(lambda _m, args, s=stats[name]: s.add(args[0])))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    try:
        with tqdm(total=len(windows), desc="calibrating", unit="window", disable=not show_progress) as bar:
            for start in range(0, len(windows), BATCH_WINDOWS):
                batch = windows[start : start + BATCH_WINDOWS]
                llm.generate(batch, params, use_tqdm=False)  # type: ignore[attr-defined]
                bar.update(len(batch))
    finally:
        for hook in hooks:
            hook.remove()
    return stats
