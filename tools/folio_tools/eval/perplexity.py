"""`folio eval perplexity`: how well a model (in a given weight format) predicts held-out text.

Each window of the held-out text (folio_tools/eval/corpus.py) is a prompt whose tokens are scored as they
are prefilled (`prompt_logprobs`: the log-probability of each prompt token given those before it).
Perplexity is exp(mean negative log-likelihood) over every predicted token. A request that scores its
prompt skips the prefix cache, so every position is computed (a cached block would have no logits).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from folio import LLM
from folio.sampling_params import SamplingParams
from folio_tools.eval.corpus import held_out_windows
from folio_tools.results import machine_info


@dataclass
class PerplexityResult:
    model: str
    quantization: str  # see weight_format_label
    dtype: str
    kv_cache_dtype: str
    context: int
    num_windows: int
    num_predicted: int  # tokens scored: (context - 1) per window
    mean_nll: float
    elapsed_s: float
    activation_bits: int = 16  # into the int8 dot products of kept-quantized weights
    date_utc: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    machine: dict[str, Any] = field(default_factory=machine_info)

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity": self.perplexity}


def weight_format_label(llm: Any, quantization: str | None) -> str:
    """How the weights were held: the --quantization asked for ("none", "int8", ...), else "gguf" for a
    GGUF file's own formats or the checkpoint's method (e.g. "gptq-4bit-g32") for a quantized folder."""
    if quantization is not None:
        return quantization
    if llm.loaded.path.is_file():
        return "gguf"
    return llm.loaded.quantization.replace(" ", "-").replace("-bit", "bit")


def score_windows(llm: Any, windows: list[list[int]], chunk: int | None = None) -> tuple[float, int]:
    """(summed negative log-likelihood of every next token, number of tokens scored). With `chunk`,
    windows are prefilled that many tokens at a time: an unchunked window never reads its own KV
    cache, so an 8-bit cache would cost it nothing."""
    scheduler = llm.engine.scheduler
    if chunk is None:
        return _score(llm, windows)
    budget = scheduler.config
    scheduler.config = replace(budget, max_num_batched_tokens=chunk)
    try:
        return _score(llm, windows)
    finally:
        scheduler.config = budget


def _score(llm: Any, windows: list[list[int]]) -> tuple[float, int]:
    # Each window is a prompt scored token by token (prompt_logprobs); one arbitrary token ends it.
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    total, count = 0.0, 0
    for output in llm.generate(windows, params, use_tqdm=False):
        scored = output.prompt_logprobs[1:]  # the first token has no context to be predicted from
        total -= sum(logprob.logprob for logprob in scored)
        count += len(scored)
    return total, count


def run_perplexity(
    model: str, quantization: str | None, num_tokens: int, context: int, **engine: Any
) -> PerplexityResult:
    llm = LLM(model, quantization=quantization, enable_prefix_caching=False, **engine)  # engine: kv_cache_dtype too
    windows = held_out_windows(lambda text: llm.tokenizer.encode(text, add_special_tokens=False), num_tokens, context)
    start = time.perf_counter()
    total, count = score_windows(llm, windows)
    elapsed = time.perf_counter() - start
    kv_cache_dtype = llm.engine.kv_cache_dtype
    label, dtype = weight_format_label(llm, quantization), str(llm.dtype).removeprefix("torch.")
    return PerplexityResult(model, label, dtype, kv_cache_dtype, context, len(windows), count, total / count, elapsed,
                            engine.get("activation_bits", 16))  # fmt: skip
