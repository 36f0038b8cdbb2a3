"""MFU and MBU: how close a measured rate comes to this machine's own limits.

- Peaks are measured when a run starts (`measure_peaks`): the matmul rate of a square GEMM in the
  activation dtype (what the model's large products run at; float32's where that is faster), and the
  read bandwidth of summing a buffer far larger than the caches (what a decode step's weight and KV
  reads run at).
- A token's cost comes from the model's shapes and formats (`TokenCost`):
  FLOPs = 2 x the parameters every token multiplies (all projections and the LM head, not the
  embedding lookup) + 4 x layers x query heads x head dim x the context it attends to (a prompt's
  tokens but its last skip the LM head);
  bytes, for a decode step of B sequences = the weights the step reads (once per step, shared by the
  batch) / B + the context's KV cache (each sequence reads its own). The weights are counted as held
  (packed formats at their packed size), but where a greedy step reads a copy of a weight instead of
  it (an LM head's six-bit first pass), the copy alone (`LoadedModel.step_weight_bytes`).
- MFU = tokens/s x FLOPs per token / peak FLOP/s; MBU = tokens/s x bytes per token / peak bytes/s.
Batch-1 decode is bound by bandwidth (MBU is the figure that says how close it is); prefill and large
batches by arithmetic (MFU).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from folio.config import ModelConfig
from folio_tools.kv_calc import load_shape

MATMUL_SIZE = 1024  # a 1024^3 GEMM: large enough to reach the kernel's rate, small enough to be quick
GPU_MATMUL_SIZE = 8192  # a GPU's tensor cores reach their rate only on far larger products
BANDWIDTH_BYTES = 512 * 2**20  # far beyond the last-level cache
GPU_BANDWIDTH_BYTES = 4 * 2**30  # a GPU reads 512 MiB in ~0.1 ms: too short to time well


def _best_seconds(work: Any, repeats: int, device: torch.device | None = None) -> float:
    """Best wall time of `work` (waiting for a GPU's queue to drain, where `device` is one)."""
    on_gpu = device is not None and device.type == "cuda"

    def timed() -> None:
        work()
        if on_gpu:
            torch.cuda.synchronize(device)

    timed()  # warm-up: threads started, pages touched, GPU kernels picked
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        timed()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class MachinePeaks:
    dtype: str
    matmul_gflops: float  # a square GEMM in `dtype`, best of several
    read_gbps: float  # summing a 512 MiB float32 buffer, best of several

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gemm_gflops(dtype: torch.dtype, repeats: int, device: torch.device | None = None) -> float:
    device = device or torch.device("cpu")
    size = GPU_MATMUL_SIZE if device.type == "cuda" else MATMUL_SIZE
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / _best_seconds(lambda: torch.mm(a, b), repeats, device) / 1e9


def measure_peaks(dtype: torch.dtype, repeats: int = 5, device: torch.device | None = None) -> MachinePeaks:
    """The matmul peak is `dtype`'s GEMM rate, or float32's where that is higher: without bfloat16
    arithmetic (AVX2 machines, no AVX-512 BF16) a bfloat16 GEMM is emulated at a fraction of float32's
    rate, while the model's kernels widen bfloat16 to float32 and reach past it. `device`: where the
    model runs (default the CPU); a GPU's peaks are its own."""
    device = device or torch.device("cpu")
    gflops = gemm_gflops(dtype, repeats, device)
    if dtype != torch.float32:
        gflops = max(gflops, gemm_gflops(torch.float32, repeats, device))
    size = GPU_BANDWIDTH_BYTES if device.type == "cuda" else BANDWIDTH_BYTES
    buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
    read_s = _best_seconds(lambda: buffer.sum(), repeats, device)
    return MachinePeaks(str(dtype).removeprefix("torch."), gflops, size / read_s / 1e9)


def measure_machine_peaks(repeats: int = 3) -> MachinePeaks:
    """The machine's best matmul rate, whichever of float32 and bfloat16 GEMMs is faster, and its read
    bandwidth: the peaks of a run whose server's activation dtype the client does not know."""
    return max((measure_peaks(dtype, repeats) for dtype in (torch.float32, torch.bfloat16)),
               key=lambda peaks: peaks.matmul_gflops)  # fmt: skip


def mean_decode_context(prompt_tokens: float, gen_tokens: float) -> float:
    """The mean context a decoded token attends to: its prompt and half of what is decoded after it."""
    return prompt_tokens + gen_tokens / 2


def multiplied_parameters(config: ModelConfig, num_params: int) -> int:
    """The parameters a token multiplies: all of them but the embedding table, which is only looked up
    (a tied LM head multiplies that same table, so then nothing is left out)."""
    return num_params if config.tie_word_embeddings else num_params - config.vocab_size * config.hidden_size


@dataclass(frozen=True)
class TokenCost:
    multiplied_params: int
    num_layers: int
    attention_width: int  # query heads x head dim
    weight_bytes: int  # what a decode step reads, as the engine holds them (packed formats at their packed size)
    kv_bytes_per_token: int  # K and V of every layer for one cached token
    head_params: int = 0  # the LM head's (vocab x hidden), part of multiplied_params: a prompt runs it once

    @classmethod
    def of(cls, path: Path, weight_bytes: int, kv_bytes_per_token: int) -> TokenCost:
        shape = load_shape(path)
        config = shape.config
        return cls(multiplied_parameters(config, shape.num_params), config.num_layers,
                   config.num_heads * config.head_dim, weight_bytes, kv_bytes_per_token,
                   config.vocab_size * config.hidden_size)  # fmt: skip

    def flops(self, context: float) -> float:
        """One token's FLOPs when it attends to `context` tokens."""
        return 2 * self.multiplied_params + 4 * self.num_layers * self.attention_width * context

    def sequence_flops(self, num_tokens: int) -> float:
        """A whole sequence's FLOPs (prompt and output): token i attends to the i tokens up to itself."""
        return 2 * self.multiplied_params * num_tokens + 4 * self.num_layers * self.attention_width * (
            num_tokens * (num_tokens + 1) / 2
        )

    def prefill_flops(self, num_tokens: int) -> float:
        """A prompt's FLOPs: every token through the layers, the LM head on its last one only."""
        return self.sequence_flops(num_tokens) - 2 * self.head_params * (num_tokens - 1)

    def request_flops(self, prompt_tokens: int, output_tokens: int) -> float:
        """A served request's FLOPs: its prompt's prefill (which samples the first output token), then each
        later output token attending to everything before it."""
        decoded = max(output_tokens - 1, 0)
        contexts = decoded * prompt_tokens + decoded * (decoded + 1) / 2  # token i attends to prompt + i tokens
        return (
            self.prefill_flops(prompt_tokens)
            + decoded * 2 * self.multiplied_params
            + (4 * self.num_layers * self.attention_width * contexts)
        )

    def requests_mfu(self, lengths: Iterable[tuple[int, int]], seconds: float, peaks: MachinePeaks,
                     cached: Iterable[int] = ()) -> float | None:  # fmt: skip
        """The fraction of the matmul peak that requests of these (prompt, output) token counts, served in
        `seconds` of wall time, come to; None without time to divide by. `cached`: per request, the prompt
        tokens whose KV the server took from its prefix cache, whose prefill it never computed."""
        if seconds <= 0:
            return None
        work = sum(self.request_flops(prompt, output) for prompt, output in lengths)
        work -= sum(self.request_flops(tokens, 0) for tokens in cached)
        return work / seconds / (peaks.matmul_gflops * 1e9)

    def decode_bytes(self, batch: float, context: float) -> float:
        """One decoded token's share of its step's reads, with `batch` sequences in the step."""
        return self.weight_bytes / batch + context * self.kv_bytes_per_token

    def prefill_mfu(self, num_tokens: int, tokens_per_s: float, peaks: MachinePeaks) -> float:
        """The fraction of the matmul peak a prefill of `num_tokens`-token prompts reaches at `tokens_per_s`
        prompt tokens a second."""
        return tokens_per_s / num_tokens * self.prefill_flops(num_tokens) / (peaks.matmul_gflops * 1e9)

    def utilisation(self, tokens_per_s: float, batch: float, context: float, peaks: MachinePeaks) -> dict[str, float]:
        """MFU and MBU (fractions of the peaks) of a decode rate."""
        return {
            "mfu": tokens_per_s * self.flops(context) / (peaks.matmul_gflops * 1e9),
            "mbu": tokens_per_s * self.decode_bytes(batch, context) / (peaks.read_gbps * 1e9),
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
