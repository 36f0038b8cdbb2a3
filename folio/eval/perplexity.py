"""`folio eval perplexity`: how well a model (in a given weight format) predicts held-out text.

Each window of the held-out text (folio/eval/corpus.py) is prefilled as a prompt; the hidden state at
every position goes through the LM head, and the log-probability of the next token is summed.
Perplexity is exp(mean negative log-likelihood) over every predicted token. Prefix caching is off,
so every position is computed (a cached block would have no logits).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import torch

from folio import LLM
from folio.engine.request import Request
from folio.eval.corpus import held_out_windows
from folio.results import machine_info
from folio.sampling_params import SamplingParams


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


@torch.inference_mode()
def score_windows(llm: Any, windows: list[list[int]], chunk: int | None = None) -> tuple[float, int]:
    """(summed negative log-likelihood of every next token, number of tokens scored). With `chunk`,
    windows are prefilled that many tokens at a time: an unchunked window never reads its own KV
    cache, so an 8-bit cache would cost it nothing."""
    engine = llm.engine
    if chunk is None:
        return _score(engine, windows)
    budget = engine.scheduler.config
    engine.scheduler.config = replace(budget, max_num_batched_tokens=chunk)
    try:
        return _score(engine, windows)
    finally:
        engine.scheduler.config = budget


def _score(engine: Any, windows: list[list[int]]) -> tuple[float, int]:
    if engine.kv.enable_prefix_caching:
        raise ValueError("scoring needs every position computed: make the LLM with enable_prefix_caching=False")
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    requests = {f"ppl-{i}": Request(f"ppl-{i}", list(w), params) for i, w in enumerate(windows)}
    for request in requests.values():
        engine.add_request(request)
    total, count = 0.0, 0
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        inputs = engine.runner.prepare(out)
        if out.block_copies:
            engine.runner.copy_blocks(out.block_copies)
        hidden = engine.runner.forward(inputs)
        offset = 0
        for item in out.scheduled:
            tokens = requests[item.request_id].prompt_token_ids
            start, end = item.start_position, item.start_position + item.num_tokens
            scored = min(end, len(tokens) - 1) - start  # the last prompt position has no next token
            if scored > 0:
                logits = engine.runner.compute_logits(hidden[offset : offset + scored])
                targets = torch.tensor(tokens[start + 1 : start + 1 + scored], device=logits.device)
                logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, targets.unsqueeze(1))
                total -= float(logprobs.sum())
                count += scored
            offset += item.num_tokens
        # Every window ends at its prompt: finish it with an arbitrary token, never decoded further.
        engine.scheduler.update_from_output(out, {rid: 0 for rid in inputs.sampled_ids})
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
    return PerplexityResult(model, label, dtype, kv_cache_dtype, context, len(windows), count, total / count, elapsed)
