"""The Hugging Face transformers peer: the same requests through `model.generate` in static batches.

This mirrors the HF backend of vLLM's benchmark_throughput: requests go in fixed order, a batch at a
time, left-padded; every sequence of a batch decodes as many tokens as the batch's longest request
(EOS cannot end it early), and only the tokens each request asked for count as useful output.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from folio.platform import default_threads
from folio_tools.bench.harness.datasets import BenchRequest
from folio_tools.bench.throughput.report import EngineResult


def require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise RuntimeError("--peer hf needs transformers: pip install -e ./tools") from None


def load_hf_model(path: Path, dtype: torch.dtype) -> tuple[Any, float]:
    """Load the model at `path` (a .gguf file, dequantized by transformers, or an HF folder) in `dtype`;
    returns the model and the seconds it took."""
    require_transformers()
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    try:
        if path.is_file():
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; the user needs one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(f"transformers could not load {path}: {reason}") from exc
    return model.eval(), time.perf_counter() - start


def _left_padded(batch: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        n = len(request.prompt_token_ids)
        ids[row, width - n :] = torch.tensor(request.prompt_token_ids, dtype=torch.long)
        mask[row, width - n :] = 1
    return ids, mask


def run_hf(
    model: Any,
    requests: list[BenchRequest],
    batch_size: int,
    load_s: float,
    use_tqdm: bool = True,
    generate_kwargs: dict[str, Any] | None = None,
) -> EngineResult:
    """Time `generate` over all requests in batches of `batch_size`: greedy, or as `generate_kwargs`
    (do_sample, temperature, top_p, top_k) say."""
    choice = generate_kwargs or {"do_sample": False}
    torch.set_num_threads(default_threads())
    pad_id = 0  # any id works: padded positions are masked out of attention
    generated = 0
    bar = tqdm(total=len(requests), desc="hf generate", unit="req", disable=not use_tqdm)
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(requests), batch_size):
            batch = requests[first : first + batch_size]
            ids, mask = _left_padded(batch, pad_id)
            new_tokens = max(r.output_len for r in batch)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad_id,
                **choice,
            )
            if out.shape != (len(batch), ids.shape[1] + new_tokens):
                raise RuntimeError(f"transformers returned shape {tuple(out.shape)}, expected {new_tokens} new tokens")
            generated += len(batch) * new_tokens
            bar.update(len(batch))
    elapsed = time.perf_counter() - start
    bar.close()
    return EngineResult(
        engine="hf",
        num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(r.output_len for r in requests),
        generated_tokens=generated,
        elapsed_s=elapsed,
        load_s=load_s,
        threads=torch.get_num_threads(),
    )
