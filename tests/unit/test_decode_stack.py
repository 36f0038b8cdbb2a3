"""The C++ decode step (folio/models/decode_stack.py) against the Python layers it replaces.

Both run the same kernels in the same order, so greedy tokens and logprobs must be identical, for dense
float32 / bfloat16, 4-bit weights and 8-bit groups (of 32, and Q6_K's 16), over batches of decodes at
different positions, with GQA, MQA, a sliding window, q/k/v biases, llama3 RoPE, Qwen3's QK-norm and
Gemma 3's layout (four norms a layer, QK-norm, local and global RoPE, sliding layers). The real Gemma 3
file, whose projections are Q5_0, Q8_0, Q6_K and Q4_K, too. Models it cannot run must be left to the
Python layers.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from folio import LLM, SamplingParams, ops
from folio.layers.attention.kv_tensors import LayerKV
from folio.layers.linear import Linear
from folio.models.decode_stack import build_decode_stack
from folio.weight_formats import int4
from folio.weight_formats.activation_bits import set_activation_bits
from folio.weight_formats.int8 import Int8Groups, PackedInt8
from tests.tiny_models import make_tiny_model

KINDS = ["llama", "mqa", "mistral-window", "qwen2", "llama3-rope", "qwen3", "gemma3"]
SETTINGS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},
    "int8-groups": {"dtype": "float32"},  # then made 8-bit groups below, as a GGUF file's Q8_0 / Q6_K are
}
PROMPTS = [list(range(5, 5 + n)) for n in (3, 11, 20)]  # three lengths: a decode batch at different positions


class CountingStack:
    """Delegates to the real stack and counts the steps it ran."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.steps = stack, 0

    def forward(self, *args: torch.Tensor) -> list[torch.Tensor]:
        self.steps += 1
        return self.stack.forward(*args)


def _llm(folder, setting: str = "fp32", **settings) -> LLM:
    llm = LLM(folder, num_kv_blocks=128, block_size=4, **SETTINGS[setting], **settings)
    if setting == "int8-groups":
        _make_int8_groups(llm)
    return llm


def _model(llm: LLM) -> Any:
    return llm.engine.runner.model.model


def _int8_groups(weight: torch.Tensor, group: int) -> Int8Groups:
    grouped = weight.float().view(weight.shape[0], -1, group)
    scales = (grouped.abs().amax(-1) / 127).clamp_min(1e-8)
    codes = (grouped / scales.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return Int8Groups(codes.view(weight.shape), scales)


def _make_int8_groups(llm: LLM) -> None:
    """Every decoder projection held as 8-bit groups (the down projections in groups of 16, Q6_K's), then
    the stack built again over them."""
    model = llm.engine.runner.model
    for name, module in model.model.layers.named_modules():
        if isinstance(module, Linear):
            module.packed = PackedInt8(_int8_groups(module.weight.data, 16 if name.endswith("down_proj") else 32))
            module.weight.data = torch.empty(0)
    model.bind_decode_stack(torch.float32)


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_stack_generates_exactly_what_the_python_layers_generate(tmp_path, kind, setting):
    _assert_stack_equals_python_layers(_llm, make_tiny_model(kind, tmp_path / kind), setting)


def _assert_stack_equals_python_layers(make, folder, *args: Any) -> None:
    fast = make(folder, *args)
    assert _model(fast).decode_stack is not None
    counter = CountingStack(_model(fast).decode_stack.stack)
    _model(fast).decode_stack.stack = counter
    slow = make(folder, *args)
    _model(slow).decode_stack = None
    assert _generate(fast) == _generate(slow)
    assert counter.steps >= 11  # every step after the prompts' prefill went through the stack


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_file_through_the_stack_generates_what_the_python_layers_generate(gemma3_gguf, dtype):
    """Q5_0 q/k/gate/up, Q8_0 v, Q6_K down and Q4_K o, all kept quantized."""
    _assert_stack_equals_python_layers(lambda path, d: LLM(path, dtype=d, kv_cache_memory="32MiB"), gemma3_gguf, dtype)


def _llm_8_bit_activations(folder, setting: str) -> LLM:
    llm = _llm(folder, setting, activation_bits=8)
    if setting == "int8-groups":  # made after the LLM set its weights: set them and build the stack again
        model = llm.engine.runner.model
        assert set_activation_bits(model, 8) > 0
        model.bind_decode_stack(torch.float32)
    return llm


@pytest.mark.parametrize("setting", ["int4", "int8-groups"])
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_8_bit_activations_through_the_stack_equal_the_python_layers(tmp_path, kind, setting):
    folder = make_tiny_model(kind, tmp_path / kind)
    _assert_stack_equals_python_layers(_llm_8_bit_activations, folder, setting)
    eight, sixteen = _generate(_llm_8_bit_activations(folder, setting)), _generate(_llm(folder, setting))
    assert [lp for _, lp in eight] != [lp for _, lp in sixteen]  # the setting reached the kernels


def test_gemma3_file_with_8_bit_activations_through_the_stack(gemma3_gguf):
    _assert_stack_equals_python_layers(
        lambda path: LLM(path, kv_cache_memory="32MiB", activation_bits=8), gemma3_gguf
    )  # fmt: skip


def test_8_bit_activations_are_for_a_model_in_this_process(tmp_path):
    with pytest.raises(ValueError, match="activation-bits 8"):
        LLM(tmp_path, activation_bits=8, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="activation-bits must be one of"):
        LLM(tmp_path, activation_bits=4)


def test_the_weights_kernels_cap_the_rows_a_stack_step_takes(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "llama")
    assert _model(_llm(folder, "int4")).decode_stack.max_rows == int4.dot_max_rows(torch.bfloat16)
    assert _model(_llm(folder, "bf16")).decode_stack.max_rows == sys.maxsize
    assert _model(_llm(folder, "int8-groups")).decode_stack.max_rows == sys.maxsize  # float32: every row count


@pytest.mark.parametrize(
    ("kind", "settings"),
    [
        ("llama", {"kv_cache_dtype": "int8"}),  # 8-bit KV: written by the Python layers' quantizer
        ("llama", {"quantization": "nf4"}),  # a weight format the stack has no kernel for
        ("gemma3", {"kv_cache_dtype": "fp8"}),
        ("phi3", {"quantization": "int8"}),  # per-channel int8: aten's kernel, not the stack's
        ("gpt2", {}),  # another architecture
    ],
)
def test_models_it_cannot_run_keep_the_python_layers(tmp_path, kind, settings):
    llm = _llm(make_tiny_model(kind, tmp_path / kind), **settings)
    assert getattr(_model(llm), "decode_stack", None) is None
    assert len(_generate(llm)[0][0]) == 12


def test_a_cache_off_the_cpu_takes_no_cpu_kernel(tmp_path, monkeypatch):
    """On a GPU the stack is not built, and its CPU kernels are not compiled (a GPU run paid ~30 s each)."""
    llm = _llm(make_tiny_model("llama", tmp_path / "llama"))
    model = _model(llm)
    for layer in model.layers:
        cache = layer.self_attn.attn.cache
        layer.self_attn.attn.cache = LayerKV(cache.k.to("meta"), cache.v.to("meta"))

    def no_cpu_kernel(name: str) -> None:
        raise AssertionError(f"the {name} kernel was loaded for a cache on the meta device")

    monkeypatch.setattr(ops, "load", no_cpu_kernel)
    assert build_decode_stack(model, torch.float32) is None
