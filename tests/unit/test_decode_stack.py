"""The C++ decode step (folio/models/decode_stack.py) against the Python layers it replaces.

Both run the same kernels in the same order, so greedy tokens and logprobs must be identical, for dense
float32 / bfloat16 and 4-bit weights, over batches of decodes at different positions, with GQA, MQA, a sliding
window, q/k/v biases and llama3 RoPE. Models it cannot run must be left to the Python layers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from folio import LLM, SamplingParams
from tests.tiny_models import make_tiny_model

KINDS = ["llama", "mqa", "mistral-window", "qwen2", "llama3-rope"]
SETTINGS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},
}
PROMPTS = [list(range(5, 5 + n)) for n in (3, 11, 20)]  # three lengths: a decode batch at different positions


class CountingStack:
    """Delegates to the real stack and counts the steps it ran."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.steps = stack, 0

    def forward(self, *args: torch.Tensor) -> list[torch.Tensor]:
        self.steps += 1
        return self.stack.forward(*args)


def _llm(folder, **settings) -> LLM:
    return LLM(folder, num_kv_blocks=128, block_size=4, **settings)


def _model(llm: LLM) -> Any:
    return llm.engine.runner.model.model


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_stack_generates_exactly_what_the_python_layers_generate(tmp_path, kind, setting):
    folder = make_tiny_model(kind, tmp_path / kind)
    fast = _llm(folder, **SETTINGS[setting])
    assert _model(fast).decode_stack is not None
    counter = CountingStack(_model(fast).decode_stack)
    _model(fast).decode_stack = counter
    slow = _llm(folder, **SETTINGS[setting])
    _model(slow).decode_stack = None
    assert _generate(fast) == _generate(slow)
    assert counter.steps >= 11  # every step after the prompts' prefill went through the stack


@pytest.mark.parametrize(
    ("kind", "settings"),
    [
        ("llama", {"kv_cache_dtype": "int8"}),  # 8-bit KV: written by the Python layers' quantizer
        ("llama", {"quantization": "nf4"}),  # a weight format the stack has no kernel for
        ("gemma3", {}),  # another architecture
    ],
)
def test_models_it_cannot_run_keep_the_python_layers(tmp_path, kind, settings):
    llm = _llm(make_tiny_model(kind, tmp_path / kind), **settings)
    assert getattr(_model(llm), "decode_stack", None) is None
    assert len(_generate(llm)[0][0]) == 12
